"""`holdback up --replicas URL` in front of a real vLLM, as a user starts it: the banner's sample line names the
model vLLM serves, and that line, sent as a batch with the official client, completes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support import REPO, free_port, poll

pytestmark = pytest.mark.e2e


def test_up_in_front_of_vllm_prints_a_line_for_its_model_and_completes_it(vllm):
    data_dir = Path(tempfile.mkdtemp(prefix="hbvup-"))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "HOLDBACK_ADMIN_KEY")}
    env.update(HOLDBACK_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    ports = [str(free_port()) for _ in range(4)]
    log = data_dir / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "holdback.cli", "up", "--replicas", vllm.url, "--api-port", ports[0],
                           "--gateway-port", ports[1], "--processor-metrics-port", ports[2],
                           "--worker-metrics-port", ports[3]], cwd=REPO, env=env, stdout=log.open("wb"),
                          stderr=subprocess.STDOUT)
    try:
        def banner_printed():
            text = log.read_text()
            return text if "holdback is up." in text and "stops everything" in text else None

        banner = poll(banner_printed, 240, "the banner", lambda: log.read_text()[-3000:])
        lines = banner.splitlines()
        sample = json.loads(lines[next(i for i, x in enumerate(lines) if x.startswith("A request line")) + 1])
        assert sample["body"]["model"] == "tiny", sample
        tenant_key = banner.split("(tenant key: ", 1)[1].split(")", 1)[0]
        client = OpenAI(base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key=tenant_key, max_retries=5)
        upload = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(sample).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=sample["url"], completion_window="24h")
        done = poll(lambda: (lambda b: b if b.status in ("completed", "failed") else None)(
            client.batches.retrieve(batch.id)), 240, "the sample batch", lambda: log.read_text()[-3000:])
        assert done.status == "completed" and done.request_counts.completed == 1, done
    finally:
        up.terminate()
        up.wait(60)

"""Submit examples/requests.jsonl with the official openai client: one batch per endpoint (a batch has one
endpoint, so its lines are grouped by their `url`), then print each batch's results.

    python examples/submit.py http://127.0.0.1:8000/v1 TENANT_KEY
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from openai import OpenAI

REQUESTS = Path(__file__).with_name("requests.jsonl")


def main(base_url: str, api_key: str) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    by_endpoint: dict[str, list[str]] = defaultdict(list)
    for line in REQUESTS.read_text().splitlines():
        by_endpoint[json.loads(line)["url"]].append(line)
    for endpoint, lines in by_endpoint.items():
        upload = client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)
        print(f"{endpoint}: {batch.status} {batch.request_counts}")
        if batch.output_file_id:
            for result in client.files.content(batch.output_file_id).text.splitlines():
                print("  ", result[:160])


if __name__ == "__main__":
    main(*sys.argv[1:3])

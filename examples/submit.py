"""Submit examples/requests.jsonl with the official openai client: one batch per endpoint (a batch has one
endpoint, so its lines are grouped by their `url`), then print each batch's output and error lines.

    python examples/submit.py http://127.0.0.1:8000/v1 TENANT_KEY [FILE]

FILE defaults to examples/requests.jsonl. `holdback submit FILE` does the same without the openai package.
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


def main(base_url: str, api_key: str, requests: Path = REQUESTS) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    by_endpoint: dict[str, list[str]] = defaultdict(list)
    for line in requests.read_text().splitlines():
        if line.strip():
            by_endpoint[json.loads(line)["url"]].append(line)
    for endpoint, lines in by_endpoint.items():
        upload = client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)
        print(f"{endpoint}: {batch.id} {batch.status} {batch.request_counts}")
        for error in (batch.errors.data if batch.errors else None) or []:  # the input was refused
            print(f"   line {error.line}: {error.code}: {error.message}")
        if batch.output_file_id:
            for result in client.files.content(batch.output_file_id).text.splitlines():
                print("  ", result[:160])
        if batch.error_file_id:
            print("   errors:")
            for error in client.files.content(batch.error_file_id).text.splitlines():
                print("  ", error[:300])


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], *(Path(a) for a in sys.argv[3:4]))

"""A batch whose output meets a full file store is not failed: finalization is retried, nothing half-written
is published, and the batch completes with its whole output once there is room again."""

from __future__ import annotations

import os

from tests.batch_processor.test_processor_support import Harness, chat, jsonl
from tests.support import small_disk


def test_output_on_a_full_disk_waits_for_room_then_completes_whole(backend, tmp_path):
    with small_disk(tmp_path / "files", size="1m") as disk:
        harness = Harness(backend, files_url=f"file://{disk}")
        try:
            batch_id = harness.submit(jsonl([chat(i) for i in range(20)]))
            processor = harness.processor(window=50)
            processor.tick()
            rows = harness.rows(batch_id)
            assert len(rows) == 20
            for row in rows:
                harness.succeed(row.id)
            before = sorted(os.listdir(disk))  # the input file
            filler = disk / "filler"
            with open(filler, "wb", buffering=0) as fh:  # the rest of the disk, to the last byte it takes
                try:
                    while True:
                        fh.write(b"\0" * 4096)
                except OSError:
                    pass
            finished = processor.tick().finished
            assert batch_id not in finished, "a full store fails no batch"
            assert harness.batch(batch_id).status in ("in_progress", "finalizing")
            assert sorted(os.listdir(disk)) == sorted([*before, "filler"]), "nothing half-written is left"
            filler.unlink()
            assert processor.tick().finished == {batch_id: "completed"}
            batch = harness.batch(batch_id)
            assert sorted(line["custom_id"] for line in harness.read_file(batch.output_file_id)) == sorted(
                f"req-{i}" for i in range(20))
        finally:
            harness.close()

"""`holdback submit FILE` against a running `holdback up`, as a newcomer runs it: the commands the banner
prints work as printed from another terminal (no HOLDBACK_* variables there), with replicas that serve a model
other than the example file's; results, failed requests and a refused input each end up where it says.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from holdback.cli.submit import SubmitError, read_parts
from tests.e2e.test_up import BANNER_END, banner_command, start_up, stop_up, terminal_env, up_env
from tests.support import REPO, free_port, free_ports, poll, wait_http

pytestmark = pytest.mark.e2e

MODEL = "acme-7b"  # what the simulated replicas serve here; examples/requests.jsonl names sim-model


def _line(custom_id: str, url: str = "/v1/chat/completions", model: str = MODEL, content: str = "hi") -> str:
    body = {"model": model, "max_tokens": 4}
    body.update({"messages": [{"role": "user", "content": content}]} if "chat" in url else
                {"input": content} if "embeddings" in url else {"prompt": content})
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(command: list[str], cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=terminal_env(), capture_output=True, text=True, timeout=timeout)


def test_the_banner_commands_submit_and_download_and_failures_are_shown(backend, tmp_path):
    data_dir = Path(tempfile.mkdtemp(prefix="hbsub-"))
    api, gateway, sim = free_port(), free_port(), free_ports(2)
    proc = start_up(up_env(backend, data_dir), data_dir / "up.log", "--api-port", str(api), "--gateway-port",
                    str(gateway), "--sim-port", str(sim), f"--sim-arg=--model={MODEL}", "--sim-arg=--decode-base-ms=1",
                    "--worker-concurrency", "16", "--processor-metrics-port", str(free_port()),
                    "--worker-metrics-port", str(free_port()))
    log = data_dir / "up.log"
    try:
        wait_http(f"http://127.0.0.1:{api}/readyz", timeout=120, proc=proc)
        banner = poll(lambda: BANNER_END in (text := log.read_text(errors="replace"))
                      and text, 120, "the banner", lambda: log.read_text(errors="replace")[-3000:])
        # The sample line names the model the replicas serve, not the example file's.
        sample = json.loads(banner.split("A request line", 1)[1].splitlines()[1])
        assert sample["body"]["model"] == MODEL, banner

        # The banner's submit command, verbatim, from the repository in a terminal without our variables.
        submit = banner_command(banner, "Run the example requests")
        assert submit[1:3] == ["submit", "examples/requests.jsonl"] and submit[submit.index("--model") + 1] == MODEL
        done = _run(submit + ["--out", str(tmp_path / "examples")])
        assert done.returncode == 0, done.stdout + done.stderr
        examples = [json.loads(x) for x in (REPO / "examples" / "requests.jsonl").read_text().splitlines()]
        outputs = sorted((tmp_path / "examples").glob("batch_*-output.jsonl"))
        assert len(outputs) == 3 == done.stdout.count(" completed ("), done.stdout  # one batch per endpoint
        results = [json.loads(x) for f in outputs for x in f.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in examples)
        assert {r["response"]["status_code"] for r in results} == {200}
        for f in outputs:
            assert f"output: {f}" in done.stdout, done.stdout

        # A request the replica refuses goes to the error file, downloaded, its first line printed; exit 1.
        failing = tmp_path / "failing.jsonl"
        failing.write_text(_line("fits") + "\n" + _line("too-long", content="word " * 20000) + "\n")
        key = ["--api-url", f"http://127.0.0.1:{api}", "--key", json.loads((data_dir / "local-keys.json")
                                                                           .read_text())["tenant"]]
        holdback = [sys.executable, "-m", "holdback.cli"]
        partial = _run([*holdback, "submit", str(failing), *key, "--out", str(tmp_path / "failing")])
        assert partial.returncode == 1, partial.stdout + partial.stderr
        (errors,) = (tmp_path / "failing").glob("batch_*-errors.jsonl")
        (refused,) = [json.loads(x) for x in errors.read_text().splitlines()]
        assert refused["custom_id"] == "too-long" and refused["response"]["status_code"] == 400
        assert f"errors: {errors} (1 lines), the first:" in partial.stdout, partial.stdout
        assert re.search(r"too-long: HTTP 400 .*maximum context length", partial.stdout), partial.stdout
        assert "1 completed, 1 failed of 2" in partial.stdout

        # examples/submit.py (the official client) prints the error file's lines too.
        assert "official openai client" not in banner, "examples/submit.py sends the file's own model, not served here"
        official = [sys.executable, "examples/submit.py", f"http://127.0.0.1:{api}/v1", key[-1]]
        printed = _run([*official, str(failing)])
        assert printed.returncode == 0, printed.stdout + printed.stderr
        assert re.search(r'errors:\n .*"custom_id": ?"too-long".*maximum context length', printed.stdout), printed.stdout

        # A refused input: the batch fails validation, and the error names the line of the file given (the
        # chat lines are the second batch's lines 1 and 2, the file's lines 2 and 3).
        mixed = tmp_path / "mixed.jsonl"
        mixed.write_text("\n".join([_line("c0", "/v1/completions"), _line("a"), _line("a")]) + "\n")
        invalid = _run([*holdback, "submit", str(mixed), *key, "--out", str(tmp_path / "mixed")])
        assert invalid.returncode == 1, invalid.stdout + invalid.stderr
        assert "becomes 2 batches" in invalid.stdout
        assert re.search(r"failed \(/v1/chat/completions, acme-7b\).*\n  " + re.escape(str(mixed))
                         + r" line 3: duplicate_custom_id",
                         invalid.stdout), invalid.stdout
        assert f"completed (/v1/completions, {MODEL}): 1 completed, 0 failed" in invalid.stdout
        assert "its lines are the file's lines 2, 3" in invalid.stdout, invalid.stdout

        # One batch per endpoint and model, each of at most --max-requests lines, reported together; the replicas
        # serve no other-model, so only that batch's line fails.
        split = tmp_path / "split.jsonl"
        split.write_text("\n".join([_line("s0"), _line("s1"), _line("other", model="other-model"), _line("s2")]) + "\n")
        parted = _run([*holdback, "submit", str(split), *key, "--max-requests", "2", "--out", str(tmp_path / "split")])
        assert parted.returncode == 1, parted.stdout + parted.stderr
        assert "becomes 3 batches" in parted.stdout and parted.stdout.count("submitted batch_") == 3, parted.stdout
        for report in (f"(/v1/chat/completions, {MODEL}, part 1 of 2): 2 completed, 0 failed of 2",
                       f"(/v1/chat/completions, {MODEL}, part 2 of 2): 1 completed, 0 failed of 1",
                       f"failed (/v1/chat/completions, other-model): 0 completed, 0 failed of 1\n  {split} line 3: "
                       "model_not_found", "batches: 2 completed, 1 failed; 0 requests failed"):
            assert report in parted.stdout, parted.stdout
        answered = [json.loads(x) for f in (tmp_path / "split").glob("batch_*-output.jsonl")
                    for x in f.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in answered) == ["s0", "s1", "s2"]

        # --model puts the served name in every line; a wrong key is refused saying what to pass.
        renamed = tmp_path / "renamed.jsonl"
        renamed.write_text(_line("r0", model="sim-model") + "\n")
        assert _run([*holdback, "submit", str(renamed), *key, "--model", MODEL, "--out", str(tmp_path / "r")]
                    ).returncode == 0
        wrong = _run([*holdback, "submit", str(renamed), "--api-url", f"http://127.0.0.1:{api}", "--key", "hb-nope"])
        assert wrong.returncode == 2 and "refused the key (401)" in wrong.stderr and "--key" in wrong.stderr
    finally:
        code = stop_up(proc)
    assert code == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("content, message", [
    ("", "has no request lines"),
    ("\n\n", "has no request lines"),
    ('{"custom_id": "a", "url": "/v1/chat/completions"}\n{oops\n', "line 2 is not JSON"),
    ('["a list"]\n', 'line 1 has no "url"'),
    ('{"custom_id": "a"}\n', 'line 1 has no "url"'),
])
def test_a_file_that_cannot_be_grouped_is_refused_naming_the_line(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    with pytest.raises(SubmitError, match=re.escape(message)):
        read_parts(path, None, 10)
    with pytest.raises(SubmitError, match="no such file"):
        read_parts(tmp_path / "missing.jsonl", None, 10)


def test_lines_are_grouped_by_endpoint_keeping_their_line_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_line("c0", "/v1/completions"), "", _line("a", model="x"), _line("e", "/v1/embeddings"),
                               _line("b", model="y")]) + "\n")
    parts = read_parts(path, "served", 10)  # --model: every line names one model
    assert [(p.endpoint, p.line_numbers) for p in parts] == [
        ("/v1/completions", [1]), ("/v1/chat/completions", [3, 5]), ("/v1/embeddings", [4])]
    assert parts[1].original_line(2) == 5 and parts[1].original_line(None) is None
    assert {json.loads(x)["body"]["model"] for p in parts for x in p.lines} == {"served"}


def test_lines_are_grouped_by_endpoint_and_model_in_batches_of_at_most_the_limit(tmp_path):
    """A batch has one model and at most the Batch API's request limit (the processor refuses more): each
    endpoint's lines go in one batch per model, and a group over the limit in several."""
    path = tmp_path / "in.jsonl"
    lines = [_line("a0", model="a"), _line("b0", model="b"), _line("a1", model="a"), _line("e0", "/v1/embeddings"),
             _line("a2", model="a"), _line("a3", model="a"), _line("a4", model="a"), '{"url": "/v1/chat/completions"}']
    path.write_text("\n".join(lines) + "\n")
    parts = read_parts(path, None, 2)
    assert [(p.label, p.line_numbers) for p in parts] == [
        ("/v1/chat/completions, a, part 1 of 3", [1, 3]), ("/v1/chat/completions, a, part 2 of 3", [5, 6]),
        ("/v1/chat/completions, a, part 3 of 3", [7]), ("/v1/chat/completions, b", [2]),
        (f"/v1/embeddings, {MODEL}", [4]), ("/v1/chat/completions, no model", [8])]
    assert [json.loads(x)["custom_id"] for x in parts[1].lines] == ["a2", "a3"] and parts[1].original_line(2) == 6
    # By default the limit is the one the Batch API enforces (HOLDBACK_MAX_BATCH_REQUESTS), not a copy of it.
    from holdback.cli.submit import _parser
    from holdback.settings import Settings

    assert _parser(Settings()).parse_args([str(path)]).max_requests == Settings().max_batch_requests
    assert len(read_parts(path, None, Settings().max_batch_requests)) == 4


def test_no_key_and_no_server_each_say_what_to_pass(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(_line("a") + "\n")
    holdback = [sys.executable, "-m", "holdback.cli", "submit", str(path)]
    no_keys = _run([*holdback, "--keys", str(tmp_path / "none.json")], timeout=60)
    assert no_keys.returncode == 2 and "pass --key" in no_keys.stderr, no_keys.stderr
    down = _run([*holdback, "--key", "k", "--api-url", f"http://127.0.0.1:{free_port()}"], timeout=60)
    assert down.returncode == 2 and "cannot reach the Batch API" in down.stderr and "--api-url" in down.stderr


def test_the_report_counts_cancelled_and_expired_rows_apart_from_failed_ones(tmp_path, capsys):
    """OpenAI's request_counts count a row a cancel closed as failed; the report says what closed it."""
    from argparse import Namespace

    from holdback.cli.submit import BatchPart, _report

    errors = [{"custom_id": "a", "response": {"status_code": 400, "body": {"error": {"message": "bad"}}}},
              {"custom_id": "b", "response": None, "error": {"code": "batch_cancelled", "message": "cancelled"}},
              {"custom_id": "c", "response": None, "error": {"code": "batch_cancelled", "message": "cancelled"}},
              {"custom_id": "d", "response": None, "error": {"code": "batch_expired", "message": "expired"}}]

    class Files:
        def download(self, file_id, target):  # noqa: ANN001
            target.write_text("".join(json.dumps(e) + "\n" for e in errors) if file_id == "err" else "{}\n")
            return len(errors) if file_id == "err" else 1

    batch = {"id": "batch_1", "status": "cancelled", "output_file_id": "out", "error_file_id": "err",
             "request_counts": {"total": 6, "completed": 2, "failed": 4}}
    part = BatchPart("/v1/chat/completions", MODEL, [b"{}"] * 6, list(range(1, 7)), batch)
    assert _report(Namespace(out=tmp_path, show_errors=0, file=tmp_path / "in.jsonl"), part, Files()) is False
    assert f"batch_1 cancelled (/v1/chat/completions, {MODEL}): 2 completed, 1 failed, 2 cancelled before they finished, " \
           "1 expired before they finished of 6" in capsys.readouterr().out


def test_the_closed_row_codes_are_the_contracts_on_both_sides():
    """The processor writes the codes, `holdback submit` reads them; each spells them once, in holdback.contract
    (and the submit client does not import the processor to get them)."""
    from batch_processor import closing
    from holdback import contract
    from holdback.cli import submit

    assert (closing.CANCELLED_CODE, closing.EXPIRED_CODE) == (contract.CANCELLED_CODE, contract.EXPIRED_CODE)
    assert set(submit.CLOSED_CODES) == {contract.CANCELLED_CODE, contract.EXPIRED_CODE}
    for module in (closing, submit):
        source = Path(module.__file__).read_text()
        assert not re.search(r"""['"]batch_(cancelled|expired)['"]""", source), module.__name__
    assert "batch_processor" not in Path(submit.__file__).read_text()

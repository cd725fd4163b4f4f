"""`holdback submit FILE`: run a JSONL file of requests end to end without writing code.

It uploads the file, creates the batch, waits with progress until the batch ends, downloads the output and
error files and prints where they are, with the first error lines. A batch has one endpoint and one model and
holds at most the Batch API's request limit, so a file whose lines name several `url`s (examples/requests.jsonl
does) or several `body.model`s becomes one batch per endpoint and model, its lines grouped in order, and a group
over the limit becomes several; the report covers them all. It speaks plain HTTP to the Batch API: no openai
package is needed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from holdback.cli.up import LOCAL_KEYS
from holdback.contract import CANCELLED_CODE, EXPIRED_CODE
from holdback.env_flags import flags_from_env
from holdback.progress import Progress
from holdback.settings import Settings

TERMINAL = ("completed", "failed", "expired", "cancelled")
EXAMPLE_LINE = ('{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", '
                '"body": {"model": "sim-model", "messages": [{"role": "user", "content": "Hello"}]}}')


class SubmitError(Exception):
    """Something the user can change: the message says what."""


@dataclass
class BatchPart:
    """One batch's lines (one endpoint, one model, at most the batch limit), and for each the line number it has
    in the input file; `piece` of `pieces` when its endpoint and model had more lines than one batch holds."""

    endpoint: str
    model: str | None
    lines: list[bytes] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)
    batch: dict = field(default_factory=dict)
    piece: int = 1
    pieces: int = 1

    @property
    def label(self) -> str:
        """`/v1/chat/completions, acme-7b` (`, part 2 of 3` when its group was split)."""
        text = f"{self.endpoint}, {self.model if self.model is not None else 'no model'}"
        return text + (f", part {self.piece} of {self.pieces}" if self.pieces > 1 else "")

    def original_line(self, line: int | None) -> int | None:
        """The input file's line number for a line number of this part's upload (1-based)."""
        if line is None or not 1 <= line <= len(self.line_numbers):
            return line
        return self.line_numbers[line - 1]


def read_parts(path: Path, model: str | None, max_requests: int) -> list[BatchPart]:
    """Group the file's request lines by endpoint and model, each group in batches of at most `max_requests`,
    refusing any line that cannot be grouped."""
    if not path.is_file():
        raise SubmitError(f"{path}: no such file; pass a JSONL file with one request per line, e.g.\n  {EXAMPLE_LINE}")
    groups: dict[tuple[str, str | None], BatchPart] = {}
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            request = json.loads(raw)
        except ValueError as exc:
            raise SubmitError(f"{path} line {number} is not JSON ({exc}); every line must be one request "
                              f"object, e.g.\n  {EXAMPLE_LINE}") from None
        url = request.get("url") if isinstance(request, dict) else None
        if not isinstance(url, str) or not url:
            raise SubmitError(f"{path} line {number} has no \"url\"; each line names its endpoint, e.g. "
                              "\"url\": \"/v1/chat/completions\"")
        body = request.get("body")
        if model is not None and isinstance(body, dict):
            body["model"] = model
            raw = json.dumps(request).encode()
        # A line without a usable model is grouped apart; the Batch API's validation names what it lacks.
        named = body.get("model") if isinstance(body, dict) else None
        named = named if isinstance(named, str) else None
        group = groups.setdefault((url, named), BatchPart(url, named))
        group.lines.append(raw)
        group.line_numbers.append(number)
    if not groups:
        raise SubmitError(f"{path} has no request lines; write one JSON request per line, e.g.\n  {EXAMPLE_LINE}")
    parts = []
    for group in groups.values():
        starts = range(0, len(group.lines), max_requests)
        parts += [BatchPart(group.endpoint, group.model, group.lines[i:i + max_requests],
                            group.line_numbers[i:i + max_requests], piece=n, pieces=len(starts))
                  for n, i in enumerate(starts, start=1)]
    return parts


class BatchApi:
    """The few Batch API calls `submit` makes, each failure turned into a SubmitError saying what to do."""

    def __init__(self, base_url: str, key: str, http: httpx.Client):
        self.base = base_url.rstrip("/")
        self.http = http
        self.headers = {"Authorization": f"Bearer {key}"}

    def _call(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        try:
            r = self.http.request(method, f"{self.base}{path}", headers=self.headers, **kwargs)
        except httpx.HTTPError as exc:
            raise SubmitError(f"cannot reach the Batch API at {self.base} ({type(exc).__name__}: {exc}); is "
                              "`holdback up` running? Point --api-url at the server otherwise") from None
        if r.status_code == 401:
            raise SubmitError(f"the Batch API at {self.base} refused the key (401): pass a tenant key with --key "
                              "(`holdback keys create --tenant NAME` makes one), or run where `holdback up` runs")
        if r.status_code >= 400:
            raise SubmitError(f"{method} {path} answered {r.status_code}: {_error_message(r)}")
        return r

    def upload(self, name: str, content: bytes) -> dict:
        return self._call("POST", "/v1/files", data={"purpose": "batch"},
                          files={"file": (name, content, "application/jsonl")}).json()

    def create_batch(self, file_id: str, endpoint: str, window: str, source: str) -> dict:
        return self._call("POST", "/v1/batches", json={
            "input_file_id": file_id, "endpoint": endpoint, "completion_window": window,
            "metadata": {"source": "holdback submit", "file": source[:512]}}).json()

    def batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/v1/batches/{batch_id}").json()

    def download(self, file_id: str, target: Path) -> int:
        """Stream a file's bytes to `target`; returns its number of lines."""
        lines = 0
        try:
            with self.http.stream("GET", f"{self.base}/v1/files/{file_id}/content", headers=self.headers) as r:
                if r.status_code >= 400:
                    r.read()
                    raise SubmitError(f"downloading {file_id} answered {r.status_code}: {_error_message(r)}")
                with open(target, "wb") as out:
                    for chunk in r.iter_bytes():
                        out.write(chunk)
                        lines += chunk.count(b"\n")
        except httpx.HTTPError as exc:
            raise SubmitError(f"downloading {file_id} from {self.base} failed ({type(exc).__name__}: {exc}); "
                              f"run again or fetch GET /v1/files/{file_id}/content") from None
        return lines


def _error_message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def _parser(settings: Settings) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="holdback submit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path, metavar="FILE", help="JSONL input, one request per line (OpenAI Batch format)")
    p.add_argument("--api-url", default="http://127.0.0.1:8000", help="Batch API base URL (default %(default)s)")
    p.add_argument("--key", default=None,
                   help="tenant API key (default: the tenant key `holdback up` keeps in --keys)")
    p.add_argument("--keys", type=Path, default=settings.data_dir / LOCAL_KEYS,
                   help="keys file written by `holdback up`, read when --key is not given (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="folder the output and error files are written to (default %(default)s)")
    p.add_argument("--model", default=None,
                   help="set every line's body.model to this name, e.g. the model your replicas serve "
                        "(default: each line's own)")
    p.add_argument("--max-requests", type=int, default=settings.max_batch_requests,
                   help="most requests per batch: a larger group of lines becomes several batches (default "
                        "%(default)s, the Batch API's limit, HOLDBACK_MAX_BATCH_REQUESTS)")
    p.add_argument("--completion-window", default="24h",
                   help="the batch's completion window, e.g. 24h, 1h, 30m (default %(default)s)")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds between status checks (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop waiting after this many seconds; the batch keeps running (default: until it ends)")
    p.add_argument("--show-errors", type=int, default=5,
                   help="error lines printed per batch (default %(default)s)")
    return flags_from_env(p, "submit")


def _tenant_key(args: argparse.Namespace) -> str:
    if args.key:
        return args.key
    if not args.keys.exists():
        raise SubmitError(f"no key: pass --key with a tenant key (`holdback keys create --tenant NAME` makes one), or "
                          f"run where `holdback up` runs (it keeps its keys in {args.keys})")
    try:
        return json.loads(args.keys.read_text())["tenant"]
    except (ValueError, KeyError, TypeError):
        raise SubmitError(f"{args.keys} holds no tenant key; pass --key") from None


def main(argv: list[str]) -> int:
    settings = Settings()
    p = _parser(settings)
    args = p.parse_args(argv)
    if args.poll_interval <= 0 or (args.timeout is not None and args.timeout <= 0) or args.show_errors < 0 \
            or args.max_requests < 1:
        p.error("--poll-interval and --timeout must be above 0, --show-errors at least 0, --max-requests at least 1")
    try:
        parts = read_parts(args.file, args.model, args.max_requests)
        key = _tenant_key(args)
        args.out.mkdir(parents=True, exist_ok=True)
        with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as http:
            return _run(args, parts, BatchApi(args.api_url, key, http))
    except SubmitError as exc:
        print(f"holdback submit: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, parts: list[BatchPart], api: BatchApi) -> int:
    if len(parts) > 1:
        print(f"{args.file} becomes {len(parts)} batches (a batch has one endpoint and one model and holds at most "
              f"{args.max_requests} requests): " + "; ".join(f"{p.label} ({len(p.lines)})" for p in parts))
    for part in parts:
        name = args.file.name if len(parts) == 1 else f"{args.file.stem}-{_file_name_part(part.label)}.jsonl"
        upload = api.upload(name, b"\n".join(part.lines) + b"\n")
        part.batch = api.create_batch(upload["id"], part.endpoint, args.completion_window, str(args.file))
        print(f"submitted {part.batch['id']}: {len(part.lines)} requests ({part.label}; input {upload['id']})")
    try:
        waited = _wait(args, parts, api)
    except KeyboardInterrupt:
        print("\nstopped waiting; the batches keep running: " + ", ".join(p.batch["id"] for p in parts))
        return 130
    if not waited:
        print(f"still running after {args.timeout:g} s; the batches keep running: "
              + ", ".join(f"{p.batch['id']} ({p.batch['status']})" for p in parts))
        return 1
    clean = True
    for part in parts:
        clean = _report(args, part, api) and clean
    return 0 if clean else 1


def _file_name_part(label: str) -> str:
    """`/v1/chat/completions, org/model-7b, part 2 of 3` -> `v1-chat-completions-org-model-7b-part-2-of-3`."""
    return "-".join(filter(None, re.split(r"[^A-Za-z0-9._]+", label)))


def _wait(args: argparse.Namespace, parts: list[BatchPart], api: BatchApi) -> bool:
    """Poll every batch until each has ended (True) or --timeout passed (False)."""
    total = sum(len(p.lines) for p in parts)
    progress = Progress(total, "requests", every=max(5.0, args.poll_interval))
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        while True:
            for part in parts:
                if part.batch["status"] not in TERMINAL:
                    part.batch = api.batch(part.batch["id"])
            ended = all(p.batch["status"] in TERMINAL for p in parts)
            done = sum(_counts(p.batch)["completed"] + _counts(p.batch)["failed"] for p in parts)
            status = _status_text(parts)
            progress.update(done, status, force=ended)
            if ended:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(args.poll_interval)
    finally:
        progress.close()


def _status_text(parts: list[BatchPart]) -> str:
    """`in_progress, 3 failed` for one batch; `batches: 2 in_progress, 1 failed; 3 requests failed` for several
    (a batch's status `failed` is not a count of requests)."""
    failed = sum(_counts(p.batch)["failed"] for p in parts)
    if len(parts) == 1:
        return f"{parts[0].batch['status']}, {failed} failed"
    statuses: dict[str, int] = {}
    for p in parts:
        statuses[p.batch["status"]] = statuses.get(p.batch["status"], 0) + 1
    return "batches: " + ", ".join(f"{n} {status}" for status, n in statuses.items()) + f"; {failed} requests failed"


def _counts(batch: dict) -> dict[str, int]:
    counts = batch.get("request_counts") or {}
    return {k: int(counts.get(k) or 0) for k in ("total", "completed", "failed")}


# Error-file codes of rows that never failed: a cancel or the completion window closed them before they ran to
# an answer (OpenAI's request_counts count them as failed; the report names them for what they are).
CLOSED_CODES = {CANCELLED_CODE: "cancelled", EXPIRED_CODE: "expired"}


def _closed_rows(error_file: Path) -> dict[str, int]:
    """How many of the error file's lines a cancel or expiry closed, by what closed them."""
    closed = {name: 0 for name in CLOSED_CODES.values()}
    with open(error_file, "rb") as f:
        for raw in f:
            try:
                error = json.loads(raw).get("error") or {}
            except (ValueError, AttributeError):
                continue
            name = CLOSED_CODES.get(error.get("code")) if isinstance(error, dict) else None
            if name:
                closed[name] += 1
    return closed


def _report(args: argparse.Namespace, part: BatchPart, api: BatchApi) -> bool:
    """Download the batch's files and say what happened; True when every request succeeded."""
    batch, counts = part.batch, _counts(part.batch)
    errors_target = args.out / f"{batch['id']}-errors.jsonl"
    error_lines = api.download(batch["error_file_id"], errors_target) if batch.get("error_file_id") else 0
    closed = _closed_rows(errors_target) if error_lines else {}
    failed = counts["failed"] - sum(closed.values())
    ended = "".join(f", {n} {name} before they finished" for name, n in closed.items() if n)
    print(f"\n{batch['id']} {batch['status']} ({part.label}): {counts['completed']} completed, "
          f"{failed} failed{ended} of {counts['total'] or len(part.lines)}")
    for error in ((batch.get("errors") or {}).get("data") or [])[:args.show_errors]:
        line = part.original_line(error.get("line"))
        where = f"{args.file} line {line}: " if line else ""
        print(f"  {where}{error.get('code')}: {error.get('message')}")
    if batch.get("errors") and part.line_numbers != list(range(1, len(part.lines) + 1)):
        shown = ", ".join(map(str, part.line_numbers[:10])) + (", ..." if len(part.lines) > 10 else "")
        print(f"  (a line number inside a message counts this batch's own lines; its lines are the file's lines {shown})")
    if batch.get("output_file_id"):
        target = args.out / f"{batch['id']}-output.jsonl"
        print(f"  output: {target} ({api.download(batch['output_file_id'], target)} lines)")
    if batch.get("error_file_id"):
        target, lines = errors_target, error_lines
        print(f"  errors: {target} ({lines} lines)" + (", the first:" if lines and args.show_errors else ""))
        with open(target, "rb") as f:
            for _, raw in zip(range(args.show_errors), f):
                print("    " + _error_line(raw))
    return batch["status"] == "completed" and counts["failed"] == 0


def _error_line(raw: bytes) -> str:
    """One error-file line as `custom_id: status message`, or the raw line when it has another shape."""
    try:
        line = json.loads(raw)
        response = line.get("response") or {}
        error = line.get("error") or (response.get("body") or {}).get("error") or {}
        status = f"HTTP {response['status_code']} " if response.get("status_code") else ""
        if isinstance(error, dict):
            # vLLM's error bodies repeat the HTTP status as their code; say it once.
            shown = error.get("code") not in (None, "", response.get("status_code"), str(response.get("status_code")))
            code = f"{error['code']}: " if shown else ""
            message = code + str(error.get("message") or "")
        else:
            message = str(error)
        return f"{line.get('custom_id')}: {status}{message}"[:300]
    except (ValueError, AttributeError, TypeError):
        return raw.decode(errors="replace").rstrip()[:300]

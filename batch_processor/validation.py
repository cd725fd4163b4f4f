"""Validation of a batch input file, one JSONL line at a time (OpenAI Batch input format).

`InputValidator.check(line_no, raw)` returns the parsed request or records a `LineError` with the
line number, the parameter at fault and a message that says what to change. The codes follow the
vocabulary OpenAI-compatible servers report: invalid_json_line, missing_custom_id,
duplicate_custom_id, invalid_method, url_mismatch, invalid_body, missing_model, model_mismatch,
streaming_unsupported, gateway_owned_field (priority, cache_salt), background_unsupported and missing_input
(/v1/responses), too_many_tasks, empty_file, and invalid_line for a line that could not be checked.

With the gateway's model list (`models`, batch_processor.served_models), a line naming a model the gateway does
not serve is not an error of the file but of that line: it comes back as a request with a `refusal`
(model_not_found, naming the models served), which goes to the batch's error file while the other lines run;
only when every line is refused does the batch fail, with those errors. Without the list there is no verdict:
`ModelsUnavailable` goes up to the caller (the batch waits), never a line error. A batch targets one model, so
model_mismatch compares a line's model with the first served model of the file.

Validation is total: whatever one line contains, the result is a request or that line's error, never an
exception. Values are checked for what the database cannot store (NUL, unpaired surrogates) and bodies for
nesting depth before a row is written.

Speed: lines are parsed and bodies re-serialised with orjson (several times faster than `json`, which was
as slow as the database's bulk load) wherever orjson gives exactly `json`'s result, and with `json` (through
`holdback.strict_json`) everywhere else, so every line gets the same verdict, error and stored body text
as with `json` alone:
- orjson reads integers beyond 64 bits as floats: a line with a run of 19 digits anywhere is parsed by `json`;
- a line orjson refuses (invalid UTF-8 or JSON, lone surrogates, a byte-order mark, NaN, 1e400, nesting past
  1024) is parsed by `json`, which gives the error or the value it always did;
- orjson spells floats below 1e-4 differently (`0.00001` for `1e-05`, `1e-8` for `1e-08`): a body whose
  orjson text may hold such a number is re-serialised by `json`.
`tests/batch_processor/test_validation_fast_path.py` checks both paths against each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

import orjson

from batch_processor.served_models import KnownModels, ModelsUnavailable
from holdback import strict_json
from holdback.contract import GATEWAY_OWNED_FIELDS, RESPONSES_ENDPOINT

MAX_ERRORS = 100
# Column widths in holdback.models: longer values could not be stored.
MAX_CUSTOM_ID_CHARS = 512
MAX_MODEL_CHARS = 256
# Deepest nesting of arrays and objects a line may have: far beyond any chat or tool schema, well inside
# what parsing and re-serialising can do without running out of stack.
MAX_NESTING = 64

# A line's shape: digits → "9", "[" and "{" → "[", everything else → " ". orjson reads an integer exactly
# unless it has 19 digits or more (the longest exact one has 20, the shortest inexact one 19).
_LINE_SHAPE = bytes(0x39 if 0x30 <= b <= 0x39 else 0x5B if b in b"[{" else 0x20 for b in range(256))
_LONG_DIGIT_RUN = b"9" * 19
# A body text's number shapes: everything but digits, "+", "-", "." and "e" dropped, digits → "9", "-" → "+".
# orjson's float text is `json`'s except below 1e-4, where orjson writes 0.0000123 for 1.23e-05 and 1e-8 for
# 1e-08: "9e+" (any exponent) and ".9999" find all of those, and text that looks like them (or does once
# the rest is dropped), which only costs speed. Dropping the rest keeps the searched text short.
_NUMBER_SHAPE = bytes(0x39 if 0x30 <= b <= 0x39 else 0x2B if b == 0x2D else b for b in range(256))
_NOT_NUMBER = bytes(b for b in range(256) if b not in b"0123456789+-.e")


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


class ValidRequest(NamedTuple):  # a tuple: one is built for every line of every batch
    line: int
    custom_id: str
    url: str
    body: str  # compact JSON of the line's `body`, what the worker sends upstream
    model: str
    # Set when the line is well formed but cannot run (its model is not served): it goes to the error file.
    refusal: LineError | None = None


def _responses_problem(body: dict) -> tuple[str, str, str] | None:
    """What a /v1/responses body lacks for a batch, as (code, message, param), else None. The rest of its fields
    are the replica's to check (vLLM answers a bad one with a 400, which goes to the error file)."""
    value = body.get("input")
    if not ((isinstance(value, str) and value) or (isinstance(value, list) and value)):
        what = "missing" if value is None else json.dumps(value)[:40]
        return ("missing_input", f"body.input is {what}; a /v1/responses request needs its input: a non-empty "
                "string, or a non-empty list of input items such as [{\"role\": \"user\", \"content\": \"...\"}].",
                "body.input")
    if body.get("background") is True:
        return ("background_unsupported", "body.background is true; a batch line runs as one request and "
                "its answer goes to the output file. Remove background or set it to false.", "body.background")
    return None


# The endpoints whose bodies are checked beyond `model`, `stream` and the gateway's fields.
_BODY_CHECKS = {RESPONSES_ENDPOINT.path: _responses_problem}


class InputValidator:
    """Checks lines in order; `errors` fills up (to `max_errors`) instead of raising."""

    def __init__(self, endpoint: str, max_requests: int, max_errors: int = MAX_ERRORS,
                 models: KnownModels | None = None):
        self.endpoint = endpoint
        self.max_requests = max_requests
        self.max_errors = max_errors
        self.models = models  # None: every model name is taken as served
        self._body_check = _BODY_CHECKS.get(endpoint)
        self.errors: list[LineError] = []
        self.refused: list[LineError] = []  # well-formed lines that cannot run: the error file's
        self.model: str | None = None
        self.model_line: int | None = None
        self.count = 0
        self._seen: dict[str, int] = {}
        # Set once reading further cannot change the verdict: too many lines, or the error list is full.
        self.stopped = False

    @property
    def ok(self) -> bool:
        return not self.errors

    def _fail(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        self.errors.append(LineError(code, message, line, param))
        if len(self.errors) >= self.max_errors:
            self.stopped = True

    def check(self, line_no: int, raw: bytes) -> ValidRequest | None:
        if not raw or raw.isspace():
            return None  # blank lines (a trailing newline, a blank separator) are not requests
        self.count += 1
        if self.count > self.max_requests:
            self._fail("too_many_tasks",
                       f"The input file has more than {self.max_requests} requests; a batch may hold at most "
                       f"{self.max_requests}. Split the file into several batches.", line_no)
            self.stopped = True
            return None
        try:
            return self._check_line(line_no, raw)
        except ModelsUnavailable:
            raise  # no verdict on any line without the gateway's list: the batch waits for it
        except Exception as exc:  # noqa: BLE001 - one line's surprise is that line's error, never the batch's
            self._fail("invalid_line", f"This line could not be checked ({type(exc).__name__}); simplify it or "
                       "split it into several requests.", line_no)
            return None

    def _check_line(self, line_no: int, raw: bytes) -> ValidRequest | None:
        shape = raw.translate(_LINE_SHAPE)
        if _LONG_DIGIT_RUN not in shape:
            try:
                item = orjson.loads(raw)
            except orjson.JSONDecodeError:
                pass  # json decides: the error it gives, or the value it reads where orjson refused
            else:
                brackets = shape.count(b"[")
                return (self._accept_plain(line_no, item, brackets)
                        or self._check_parsed(line_no, raw, item, brackets, fast=True))
        return self._check_line_json(line_no, raw)

    def _accept_plain(self, line_no: int, item: object, brackets: int) -> ValidRequest | None:
        """The request of an orjson-parsed line that passes every check at first sight, else None (and
        nothing recorded: `_check_parsed` then checks the line again and reports what is wrong). The same
        checks as `_check_request` for the common case, with less work a line."""
        if brackets > MAX_NESTING or type(item) is not dict:
            return None
        custom_id, body = item.get("custom_id"), item.get("body")
        if (type(custom_id) is not str or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS
                or "\x00" in custom_id or custom_id in self._seen or item.get("method") != "POST"
                or item.get("url") != self.endpoint or type(body) is not dict):
            return None
        model = body.get("model")
        if (model != self.model or self.model is None or body.get("stream") is True
                or any(name in body for name in GATEWAY_OWNED_FIELDS)
                or (self._body_check is not None and self._body_check(body) is not None)):
            return None  # self.model is a checked (and served) name: equal to it, model is one too
        self._seen[custom_id] = line_no
        return ValidRequest(line_no, custom_id, self.endpoint, _compact_fast(body), model)

    def _check_line_json(self, line_no: int, raw: bytes) -> ValidRequest | None:
        """The line parsed by `json`, the reference for what every line gets."""
        try:
            item = strict_json.loads(raw)
        except RecursionError:
            item = None  # nested too deep to parse: reported below like any over-deep line
        except strict_json.NonStandardConstant as exc:
            self._fail("invalid_json_line",
                       f"This line is not valid JSON: {exc.detail}; write a finite number, or null.", line_no)
            return None
        except (UnicodeDecodeError, ValueError):
            self._fail("invalid_json_line",
                       "This line is not parseable as valid JSON. Each line must be one complete JSON object "
                       "in UTF-8.", line_no)
            return None
        return self._check_parsed(line_no, raw, item, raw.count(b"[") + raw.count(b"{"), fast=False)

    def _check_parsed(self, line_no: int, raw: bytes, item: object, brackets: int,
                      fast: bool) -> ValidRequest | None:
        """`brackets`: the line's "[" and "{"; `fast`: `item` came from orjson (no integer beyond 64 bits,
        no lone surrogate, no infinity)."""
        # Every nesting level needs an opening bracket, so a line with few of them needs no walk.
        if item is None or (brackets > MAX_NESTING and _depth(item) > MAX_NESTING):
            self._fail("invalid_json_line", f"This line nests arrays and objects more than {MAX_NESTING} levels "
                       "deep; flatten it.", line_no)
            return None
        if not isinstance(item, dict):
            self._fail("invalid_json_line",
                       f"This line is valid JSON but a {type(item).__name__}, not an object; each line must be "
                       'an object like {"custom_id": ..., "method": "POST", "url": ..., "body": {...}}.', line_no)
            return None
        # NUL and unpaired surrogates can only come from \u escapes, or from a surrogate's own UTF-8 bytes
        # (ED A0-BF ..), which json reads too. orjson refuses unpaired surrogates: its values are checked for
        # NUL alone, which is quicker than searching the line for escapes.
        escapes = fast or b"\\u" in raw or b"\xed" in raw
        return self._check_request(line_no, item, escapes=escapes, fast=fast)

    def _check_request(self, line_no: int, item: dict, escapes: bool = True,
                       fast: bool = False) -> ValidRequest | None:
        custom_id = item.get("custom_id")
        if custom_id is None or custom_id == "":
            self._fail("missing_custom_id", "The line has no custom_id; give every request a custom_id string that "
                       "is unique within the batch.", line_no, "custom_id")
            return None
        if not isinstance(custom_id, str):
            self._fail("missing_custom_id", f"custom_id must be a string, not {type(custom_id).__name__}.",
                       line_no, "custom_id")
            return None
        if len(custom_id) > MAX_CUSTOM_ID_CHARS:
            self._fail("missing_custom_id", f"custom_id is {len(custom_id)} characters long; use at most "
                       f"{MAX_CUSTOM_ID_CHARS}.", line_no, "custom_id")
            return None
        if escapes and (problem := _unstorable(custom_id)):
            self._fail("missing_custom_id", f"custom_id contains {problem}; use printable text.", line_no, "custom_id")
            return None
        first = self._seen.get(custom_id)
        if first is not None:
            self._fail("duplicate_custom_id", f"custom_id {custom_id!r} was already used on line {first}; "
                       "custom_id must be unique within the batch.", line_no, "custom_id")
            return None
        self._seen[custom_id] = line_no

        method = item.get("method")
        if method != "POST":
            self._fail("invalid_method", f"method is {method!r}; batch requests must use \"POST\".",
                       line_no, "method")
            return None
        url = item.get("url")
        if url != self.endpoint:
            self._fail("url_mismatch", f"url is {url!r} but this batch's endpoint is {self.endpoint!r}; every line's "
                       "url must equal the endpoint the batch was created with.", line_no, "url")
            return None
        body = item.get("body")
        if not isinstance(body, dict):
            what = "missing" if body is None else f"a {type(body).__name__}"
            self._fail("invalid_body", f"body is {what}; it must be a JSON object with the endpoint's request "
                       "parameters, including model.", line_no, "body")
            return None

        model = body.get("model")
        if not isinstance(model, str) or not model:
            self._fail("missing_model", "body.model is missing; name the model every request of this batch "
                       "should use.", line_no, "body.model")
            return None
        if len(model) > MAX_MODEL_CHARS:
            self._fail("missing_model", f"body.model is {len(model)} characters long; use at most "
                       f"{MAX_MODEL_CHARS}.", line_no, "body.model")
            return None
        if escapes and (problem := _unstorable(model)):
            self._fail("missing_model", f"body.model contains {problem}; name the model in printable text.",
                       line_no, "body.model")
            return None
        refusal = None
        if self.models is not None and model not in self.models:
            refusal = LineError("model_not_found", f"body.model is {model!r}, which the gateway does not serve; "
                                f"use one of the models it serves: {self.models.listing()}.", line_no, "body.model")
        elif self.model is None:
            self.model, self.model_line = model, line_no
        elif model != self.model:
            self._fail("model_mismatch", f"body.model is {model!r} but line {self.model_line} uses "
                       f"{self.model!r}; a batch may target only one model. Split the file by model.",
                       line_no, "body.model")
            return None
        if body.get("stream") is True:
            self._fail("streaming_unsupported", "body.stream is true; batch requests cannot stream. Remove "
                       "stream or set it to false.", line_no, "body.stream")
            return None
        owned = next((name for name in GATEWAY_OWNED_FIELDS if name in body), None)
        if owned is not None:
            self._fail("gateway_owned_field", f"body.{owned} is set by holdback's gateway (the batch's priority "
                       "and the tenant's prefix-cache scope), never by a request; remove it from the line.",
                       line_no, f"body.{owned}")
            return None
        problem = self._body_check(body) if self._body_check is not None else None
        if problem is not None:
            self._fail(problem[0], problem[1], line_no, problem[2])
            return None
        if refusal is not None:
            self.refused.append(refusal)
        if fast:
            # orjson refused unpaired surrogates and both writers escape NUL: the text is storable.
            return ValidRequest(line_no, custom_id, url, _compact_fast(body), model, refusal)
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
        if escapes and _unstorable(text):
            # An unpaired surrogate inside the body: keep it as the \u escape it came in as (JSON escapes
            # NUL by itself), so the stored text is valid UTF-8 and the request is forwarded unchanged.
            text = json.dumps(body, separators=(",", ":"))
        return ValidRequest(line_no, custom_id, url, text, model, refusal)

    @property
    def runnable(self) -> int:
        """Requests that will be sent: every valid line but the refused ones."""
        return self.count - len(self.refused)

    def finish(self) -> list[LineError]:
        """Call after the last line: adds `empty_file` when there was nothing to run; when the batch fails
        (some line is invalid, or every line was refused) its errors include the refused lines' too."""
        if self.count == 0 and not self.errors:
            self._fail("empty_file", "The input file has no requests; upload a JSONL file with one request per "
                       "line.", None)
        if self.refused and (self.errors or self.runnable == 0):
            room = self.max_errors - len(self.errors)
            merged = self.errors + self.refused[:max(room, 0)]
            self.errors[:] = sorted(merged, key=lambda e: (e.line is None, e.line or 0))
        return self.errors


def _compact_fast(body: dict) -> str:
    """`json.dumps(body, separators=(",", ":"), ensure_ascii=False)` of a body orjson parsed, by orjson where
    that gives the same text (see the module docstring)."""
    text = orjson.dumps(body)
    shape = text.translate(_NUMBER_SHAPE, _NOT_NUMBER)
    if b"9e+" in shape or b".9999" in shape:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return text.decode()


def _unstorable(value: str) -> str | None:
    """What in `value` no database text column can hold (PostgreSQL refuses NUL; UTF-8 has no surrogates)."""
    if "\x00" in value:
        return "a NUL character (\\u0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape)"
    return None


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (the value may be deeper than the stack allows)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return deepest

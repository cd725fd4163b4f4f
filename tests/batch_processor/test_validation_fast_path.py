"""The validator's orjson path gives every line exactly what the `json` path gives: the same request with the
same stored body text, or the same error (code, message, line, param). Lines are built to hit where the two
parsers differ: integers beyond 64 bits, floats of every magnitude, lone surrogates (escaped and raw), NUL,
a byte-order mark, NaN and 1e400, deep nesting, duplicate keys, control characters, and text that looks like
numbers."""

from __future__ import annotations

import json
import random
import struct

import pytest

from batch_processor.validation import InputValidator

ENDPOINT = "/v1/chat/completions"


class JsonOnly(InputValidator):
    """The reference: every line parsed and re-serialised by `json`."""

    def _check_line(self, line_no, raw):
        return self._check_line_json(line_no, raw)


def _verdicts(validator: InputValidator, lines: list[bytes]) -> tuple[list, list]:
    requests = [validator.check(n, raw) for n, raw in enumerate(lines, start=1)]
    return requests, validator.finish()


class Counted(InputValidator):
    """The validator as shipped, counting the lines it leaves to `json`."""

    by_json = 0

    def _check_line_json(self, line_no, raw):
        self.by_json += 1
        return super()._check_line_json(line_no, raw)


def _assert_same(lines: list[bytes]) -> tuple[list, int]:
    fast, reference = Counted(ENDPOINT, 10**6, 10**6), JsonOnly(ENDPOINT, 10**6, 10**6)
    got, want = _verdicts(fast, lines), _verdicts(reference, lines)
    for n, (a, b) in enumerate(zip(got[0], want[0]), start=1):
        assert a == b, f"line {n}: {lines[n - 1][:200]!r}"
    assert got[1] == want[1]
    assert (fast.count, fast.model) == (reference.count, reference.model)
    return got[0], fast.by_json


def _float(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.3:
        value = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        return 0.5 if value != value or value in (float("inf"), float("-inf")) else value
    if kind < 0.6:
        return round(rng.uniform(-1000, 1000), rng.randint(0, 8))
    return rng.uniform(-1, 1) * 10.0 ** rng.randint(-30, 30)


def _line(custom_id: object, body: object, **extra: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": body, **extra},
                      ensure_ascii=False).encode("utf-8", "surrogatepass")


def _body(rng: random.Random, model: str = "m1") -> dict:
    words = ["e-mail", "re-use", "1.00001", "0.0000", "1e+16", "x" * 3, "ünïcödé", "\u2028", "\x7f", "\t\n",
             "😀", '"quoted"', "back\\slash", "\x00"]
    big = rng.random() < 0.1  # an integer (or a digit run in text) beyond 64 bits: json's path
    return {"model": model, "temperature": _float(rng), "top_p": _float(rng),
            "max_tokens": rng.choice([2**63 - 1, -(2**63), 2**64 - 1, 2**64, "12345678901234567890"] if big
                                     else [0, 1, 64, 10**15, -(10**18)]),
            "logit_bias": {str(rng.randint(0, 10**6)): _float(rng) for _ in range(rng.randint(0, 3))},
            "messages": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))}],
            "stop": [_float(rng), None, True, False, [], {}]}


def test_random_valid_lines_give_the_same_rows():
    rng = random.Random(19)
    lines = [_line(f"req-{i}", _body(rng)) for i in range(3000)]
    requests, by_json = _assert_same(lines)
    assert all(r is not None for r in requests)
    assert by_json < len(lines) / 2, "most lines should take the orjson path (else this compares json with itself)"


EDGE_BODIES = [
    {"model": "m1", "n": 2**64}, {"model": "m1", "n": -(2**63) - 1}, {"model": "m1", "n": 10**30},
    {"model": "m1", "n": 2**64 - 1}, {"model": "m1", "t": 1e-5}, {"model": "m1", "t": 1.5e-7},
    {"model": "m1", "t": 1e16}, {"model": "m1", "t": 1e22}, {"model": "m1", "t": 5e-324},
    {"model": "m1", "t": 1.7976931348623157e308}, {"model": "m1", "t": -0.0}, {"model": "m1", "t": 0.0001},
    {"model": "m1", "t": 123456789012345.6},
]
EDGE_LINES = [
    *(_line(f"edge-{i}", body) for i, body in enumerate(EDGE_BODIES)),
    _line(2**70, {"model": "m1"}), _line(12.5, {"model": "m1"}), _line("big-body", 2**70),
    b"123456789012345678901234567890", b"1.5", b"[1, 2]", b'"text"', b"null",
    _line("nan", {"model": "m1", "t": float("nan")}), _line("inf", {"model": "m1", "t": float("inf")}),
    _line("huge", {"model": "m1"}).replace(b'"m1"}', b'"m1", "t": 1e400}'),
    _line("lone-escaped", {"model": "m1", "user": "a\udc80b"}).replace("\udc80".encode("utf-8", "surrogatepass"),
                                                                       b"\\udc80"),
    _line("lone-raw", {"model": "m1", "user": "a\udc80b"}),
    _line("lone\udc80id", {"model": "m1"}).replace("\udc80".encode("utf-8", "surrogatepass"), b"\\udc80"),
    _line("nul", {"model": "m1", "user": "a\x00b"}), _line("nul\x00id", {"model": "m1"}),
    b"\xef\xbb\xbf" + _line("bom", {"model": "m1"}), _line("utf16", {"model": "m1"}).decode().encode("utf-16"),
    b'{"custom_id": "dup", "custom_id": "dup2", "method": "POST", "url": "' + ENDPOINT.encode()
    + b'", "body": {"model": "m1", "x": 1, "model": "m1", "x": 2}}',
    _line("deep", {"model": "m1", "tools": json.loads("[" * 70 + "]" * 70)}),
    _line("deeper", {"model": "m1"}).replace(b'"m1"}', b'"m1", "t": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
    _line("ctl", {"model": "m1"}).replace(b'"m1"', b'"m\x01"'), b'{"custom_id": "x", ', b"\xff\xfe{}",
    _line("stream", {"model": "m1", "stream": True}), _line("other-model", {"model": "m2"}),
    _line("no-model", {"messages": []}), _line("get", {"model": "m1"}).replace(b'"POST"', b'"GET"'),
    _line("digits-in-text", {"model": "m1", "user": "card 1234567890123456789"}),
    _line("edge-0", {"model": "m1"}),  # a duplicate custom_id
]


@pytest.mark.parametrize("index", range(len(EDGE_LINES)))
def test_edge_lines_give_the_same_verdict(index: int):
    _assert_same([_line("first", {"model": "m1"}), EDGE_LINES[index]])


def test_edge_lines_in_one_file_give_the_same_verdicts():
    requests, by_json = _assert_same(EDGE_LINES)
    assert 0 < by_json < len(EDGE_LINES)
    assert any(r is None for r in requests) and any(r is not None for r in requests)

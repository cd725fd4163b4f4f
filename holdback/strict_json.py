"""Standard JSON only: Python's `json` accepts NaN, Infinity and -Infinity, which no other JSON parser does,
and turns a number beyond a double's range (`1e400`) into infinity, which it then writes back as `Infinity`.

The API's request bodies and the processor's input lines both parse with `loads` here, so a body that a
replica (or any client reading an output file) would choke on is refused where it enters.
"""

from __future__ import annotations

import json
import math
from typing import Any


class NonStandardConstant(ValueError):
    """The text holds NaN, Infinity or -Infinity, which are not JSON values, or a number no double can hold.
    `detail` says which, in words that fit after "not valid JSON: "."""

    def __init__(self, constant: str, detail: str | None = None):
        self.constant = constant
        self.detail = detail or f"{constant} is not a JSON value (JSON has no NaN or Infinity)"
        super().__init__(self.detail)


def _refuse(constant: str) -> float:
    raise NonStandardConstant(constant)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise NonStandardConstant(shown, f"the number {shown} is beyond the range of a 64-bit float (it would be "
                                         "stored as Infinity, which is not JSON)")
    return value


def loads(text: str | bytes) -> Any:
    """`json.loads` that raises `NonStandardConstant` (a `ValueError`, like any bad JSON) for NaN/Infinity and for
    a number too large for a double."""
    return json.loads(text, parse_constant=_refuse, parse_float=_finite)

"""Standard JSON only: Python's `json` accepts NaN, Infinity and -Infinity, which no other JSON parser does.

The API's request bodies and the processor's input lines both parse with `loads` here, so a body that a
replica (or any client reading an output file) would choke on is refused where it enters.
"""

from __future__ import annotations

import json
from typing import Any


class NonStandardConstant(ValueError):
    """The text holds NaN, Infinity or -Infinity, which are not JSON values."""

    def __init__(self, constant: str):
        super().__init__(f"{constant} is not a JSON value")
        self.constant = constant


def _refuse(constant: str) -> float:
    raise NonStandardConstant(constant)


def loads(text: str | bytes) -> Any:
    """`json.loads` that raises `NonStandardConstant` for NaN/Infinity (a `ValueError`, like any bad JSON)."""
    return json.loads(text, parse_constant=_refuse)

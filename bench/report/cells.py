"""How the report writes a figure in a table cell or a sentence: a dash for what was not measured."""

from __future__ import annotations


def fmt(v, digits: int = 0, suffix: str = "") -> str:  # noqa: ANN001
    if v is None:
        return "—"
    if isinstance(v, float) and digits == 0:
        return f"{v:,.0f}{suffix}"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{suffix}"
    return f"{v:,}{suffix}"


def pct(a, b) -> str:  # noqa: ANN001
    if a is None or b in (None, 0):
        return "—"
    return f"{(a / b - 1) * 100:+.0f}%"


def interval(lo, hi, digits: int = 2) -> str:  # noqa: ANN001
    return "—" if lo is None or hi is None else f"[{lo:,.{digits}f}, {hi:,.{digits}f}]"


def ratio(a, b, digits: int = 2) -> str:  # noqa: ANN001
    return "—" if a is None or b in (None, 0) else f"{a / b:.{digits}f}"

"""Progress of long commands (`holdback demo`, `holdback bench study`): a tqdm bar on a terminal, and
plain lines at most every few seconds when output goes to a file or a pipe (no carriage returns there).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, unit: str, *, stream: TextIO | None = None, every: float = 5.0):
        self.stream = stream or sys.stdout
        self.total, self.unit, self.every = total, unit, every
        self.bar = tqdm(total=total, unit=unit, file=self.stream, dynamic_ncols=True) if self.stream.isatty() else None
        self.printed_at = float("-inf")

    def update(self, done: int, status: str = "", *, force: bool = False) -> None:
        """Show `done` of the total with a status; `force` prints a plain line even inside the interval."""
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.refresh()
            return
        now = time.monotonic()
        if force or now - self.printed_at >= self.every:
            self.printed_at = now
            print(f"{done}/{self.total} {self.unit}" + (f" | {status}" if status else ""), file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A message above the bar (or a plain line)."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

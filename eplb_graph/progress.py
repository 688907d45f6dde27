"""A dependency-free progress display for long CLI runs (stderr; silent when disabled).

On a terminal it is a bar redrawn in place. Anywhere else (a pipe, a CI log, ``tee``) redraws
would pile up as one endless line, and nothing at all would leave a long run looking hung, so it
writes one plain line per tenth of the run instead, plus the phases the run announces.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_LINE_FRACTION = 0.1  # off a terminal: one line per tenth of the run
NO_PROGRESS_HELP = "no progress display (a bar on a terminal, else a line per tenth of the run)"


def announce(message: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
    """One line for a phase of a run (``warming up ...``), where progress is shown."""
    if enabled:
        stream = stream or sys.stderr
        stream.write(f"{message}\n")
        stream.flush()


class ProgressBar:
    """``with ProgressBar(total, "simulate") as bar: bar.update(n)``.

    A terminal gets a bar redrawn at most 10x/s; other streams get a line per tenth. A run that
    ends without an error ends at 100%, whatever the last update said.
    """

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._suffix = ""
        self._started = time.perf_counter()
        self._last_draw = 0.0
        isatty = getattr(self.stream, "isatty", None)
        self._terminal = bool(isatty and isatty())
        self._next_line = _LINE_FRACTION

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if not self.enabled:
            return
        if exc_type is None:
            self.done = self.total
        if self._terminal:
            self._draw(force=True)
            self.stream.write("\n")
        elif exc_type is None:
            self._line()
        self.stream.flush()

    def update(self, count: int = 1, suffix: str = "") -> None:
        self.done = min(self.total, self.done + count)
        self._suffix = suffix
        if not self.enabled:
            return
        if self._terminal:
            self._draw()
        elif self.done / self.total >= self._next_line and self.done < self.total:
            self._line()
            while self._next_line <= self.done / self.total:
                self._next_line += _LINE_FRACTION

    def _status(self, now: float) -> str:
        fraction = self.done / self.total
        elapsed = now - self._started
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
        return (
            f"{fraction:6.1%} {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s "
            f"{self._suffix}"
        ).rstrip()

    def _line(self) -> None:
        self.stream.write(f"{self.label}: {self._status(time.perf_counter()).lstrip()}\n")
        self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 30
        filled = int(self.done / self.total * width)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self._status(now)}"
        )
        self.stream.flush()

"""A dependency-free progress bar for long CLI runs (stderr; silent when disabled)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``with ProgressBar(total, "simulate") as bar: bar.update(n)``; redraws at most 10x/s."""

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._started = time.perf_counter()
        self._last_draw = 0.0

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def update(self, count: int = 1, suffix: str = "") -> None:
        self.done = min(self.total, self.done + count)
        self._suffix = suffix
        if self.enabled:
            self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        fraction = self.done / self.total
        width = 30
        filled = int(fraction * width)
        elapsed = now - self._started
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
        suffix = getattr(self, "_suffix", "")
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {fraction:6.1%} "
            f"{self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s {suffix}"
        )
        self.stream.flush()

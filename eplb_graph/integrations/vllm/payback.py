"""Does each rearrangement repay its cost? A per-rearrangement ledger for the metrics files.

A rearrangement costs serving the time its in-flight steps took beyond an idle step (weights
staged, copied and installed between replays; in synchronous mode the whole move inside one
step). It pays back in every later step that runs faster under the new placement. EPLB exists
for that balance, so each rank's metrics file keeps one entry per recent rearrangement:

- ``cost_ms``: sum over the steps run while it was in flight of (step time - the median idle
  step before it started; the median of all recent idle steps when none ran before it);
- ``step_ms_before`` / ``step_ms_after``: median serving step time in the idle steps before it
  started (since the previous one finished) and since it finished;
- ``expert_ms_before`` / ``expert_ms_after``: the same for this rank's expert-op time;
- ``steps_since`` (idle steps since it finished, until the next one started) and ``saved_ms`` =
  (step_ms_before - step_ms_after) x steps_since;
- ``net_ms`` = saved_ms - cost_ms (``null`` until both sides have samples).

Serving step time is the same on every rank (the combine all-reduce waits for the busiest
rank), so ``saved_ms`` is what the engine as a whole gained, as long as the load (batch size,
prefill share) stayed comparable before and after; ``expert_ms_*`` says which rank's work moved.
The ledger is fed one number pair per timed step from the serving thread: O(1) per step, the
medians are computed only when a metrics file is written.
"""

from __future__ import annotations

from collections import deque
from typing import Any

KEPT = 16
"""Rearrangements kept in the file (the newest)."""
SAMPLES = 1024
"""Step samples kept per side of a rearrangement (enough for a stable median)."""


def _median_ms(samples) -> float | None:
    ordered = sorted(samples)
    return 1e3 * ordered[len(ordered) // 2] if ordered else None


class _Entry:
    """One rearrangement: its cost while in flight and the steps on either side of it."""

    def __init__(self, index: int, before_steps, before_expert) -> None:
        self.index = index
        self.before_steps = before_steps
        self.before_expert = before_expert
        self.in_flight: list[float] = []
        self.after_steps: deque[float] = deque(maxlen=SAMPLES)
        self.after_expert: deque[float] = deque(maxlen=SAMPLES)
        self.steps_since = 0
        self.finished = False

    def figures(self, idle_median_s: float | None) -> dict[str, Any]:
        before_s = sorted(self.before_steps)
        baseline = before_s[len(before_s) // 2] if before_s else idle_median_s
        cost = (
            1e3 * sum(max(0.0, t - baseline) for t in self.in_flight)
            if baseline is not None
            else None
        )
        before, after = _median_ms(self.before_steps), _median_ms(self.after_steps)
        saved = (before - after) * self.steps_since if before is not None and after else None
        return {
            "rearrangement": self.index,
            "finished": self.finished,
            "in_flight_steps": len(self.in_flight),
            "cost_ms": cost,
            "step_ms_before": before,
            "step_ms_after": after,
            "expert_ms_before": _median_ms(self.before_expert),
            "expert_ms_after": _median_ms(self.after_expert),
            "steps_since": self.steps_since,
            "saved_ms": saved,
            "net_ms": saved - cost if saved is not None and cost is not None else None,
        }


class PaybackLedger:
    """Per-rearrangement cost and saving, fed once per timed serving step."""

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque(maxlen=KEPT)
        self._open: _Entry | None = None  # the rearrangement in flight, if any
        self._idle_steps: deque[float] = deque(maxlen=SAMPLES)  # since the last one finished
        self._idle_expert: deque[float] = deque(maxlen=SAMPLES)
        self._all_idle: deque[float] = deque(maxlen=SAMPLES)
        self._started = 0

    def step(self, step_s: float, expert_s: float, in_flight: bool, finished: int) -> None:
        """One timed step: its serving and expert seconds, whether a rearrangement was in flight
        during it, and how many rearrangements finished during it (a synchronous one starts
        and finishes in the same step)."""
        if in_flight:
            if self._open is None:
                self._started += 1
                self._open = _Entry(self._started, self._idle_steps, self._idle_expert)
                self._entries.append(self._open)
                self._idle_steps = deque(maxlen=SAMPLES)
                self._idle_expert = deque(maxlen=SAMPLES)
            self._open.in_flight.append(step_s)
            if finished:  # it ended during this step (a synchronous one: in its own step)
                self._open.finished = True
                self._open = None
            return
        if self._open is not None:  # the in-flight one ended before this idle step
            self._open.finished = True
            self._open = None
        self._all_idle.append(step_s)
        self._idle_steps.append(step_s)
        self._idle_expert.append(expert_s)
        if self._entries and self._entries[-1].finished:
            newest = self._entries[-1]
            newest.after_steps.append(step_s)
            newest.after_expert.append(expert_s)
            newest.steps_since += 1

    def figures(self) -> list[dict[str, Any]]:
        """The kept rearrangements, oldest first (what the metrics file's ``paybacks`` holds)."""
        idle = sorted(self._all_idle)
        idle_median = idle[len(idle) // 2] if idle else None
        return [entry.figures(idle_median) for entry in self._entries]

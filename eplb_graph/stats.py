"""``EplbStats``: everything one rank's EPLB has done, as one immutable value.

Why one value: the metrics files, Prometheus, the demo, the simulator and the host attaches all
report the same counters, and each used to read them from whichever object counted them (the
pipeline, the installer, the commit scheduler, the worker, the clock), under names that drifted
apart. :meth:`~eplb_graph.runtime.EplbRuntime.stats` builds this once, from every owner, under
one name per concept; the readers read only this.

Relations that hold at every call (``tests/test_liveness.py`` checks them on live ranks)::

    rearrangements_completed + rearrangements_aborted + rearrangements_noop
        == rearrangements_finished <= rearrangements_started
    rearrangements_completed <= layers_committed <= layers_delivered
    windows_committed + windows_pending <= windows_closed        (asynchronous)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

__all__ = ["EplbStats", "Progress"]


class Progress(NamedTuple):
    """Counters that move only when EPLB does something: a cheap test, every step, of whether
    :class:`EplbStats` changed (a window closed, a rearrangement started, committed a layer or
    ended)."""

    windows_closed: int
    rearrangements_started: int
    rearrangements_finished: int
    rearrangements_aborted: int
    plans_recorded: int
    record_failures: int
    layers_committed: int


@dataclass(frozen=True)
class EplbStats:
    """One rank's EPLB, as plain values (``docs/user-guide.md`` documents every field)."""

    # -- serving -----------------------------------------------------------------------------
    steps: int
    """Steps served (``end_step`` calls)."""
    is_async: bool
    windows_closed: int
    placement_version: int
    """Commits of the placement so far (it changes when the placement does)."""
    recording: bool
    """Whether the steps now served record load (they can reach the next window)."""
    last_logged_balancedness: float | None
    cost_samples_taken: int
    cost_samples_dropped: int
    """Expert-op calls left out of the cost model for taking far longer than it predicts."""

    # -- decisions -----------------------------------------------------------------------------
    last_decision: dict | None
    """The last window's decision: ``step``, ``action``, ``reason`` (and ``candidate``)."""
    planning_failures: int
    planning_seconds: float
    """Time spent deciding (policy and payback gate) over all windows."""
    gate: dict | None
    """The payback gate's document (``rearrange="when_it_pays"``; ``None`` otherwise)."""
    last_window_balancedness: float | None
    window_balancedness: tuple[float, ...]
    last_hotness: dict | None

    # -- rearrangements ----------------------------------------------------------------------------
    rearrangements_started: int
    rearrangements_finished: int
    """Ended: completed, aborted or without any change."""
    rearrangements_completed: int
    """Changed at least one layer, and every changed layer is committed on this rank."""
    rearrangements_aborted: int
    rearrangements_noop: int
    """Agreed a plan equal to the committed placement (a window kept)."""
    layers_delivered: int
    """Layers handed over for an agreed step (asynchronous) or installed (synchronous)."""
    layers_committed: int
    commit_ms: tuple[float, ...]
    """Main-thread time of each layer's install and commit (ms), in order."""
    bytes_received: int
    movement_cost_ms: float | None
    """What moving weights has cost this rank's serving so far (ms): the steps that ran a
    synchronous rearrangement, or moving steps' time beyond idle ones (asynchronous); ``None``
    before any was priced. Set against the steps it shortened, it says whether moving paid."""
    plans_recorded: int
    record_failures: int
    last_error: str | None
    moving: bool
    """A rearrangement is moving weights now (asynchronous)."""

    # -- the asynchronous commit protocol (``None`` in synchronous mode) ------------------------
    windows_committed: int | None = None
    windows_pending: int | None = None
    windows_coalesced: int | None = None
    windows_stood_in: int | None = None
    job_rounds_failed: int | None = None
    commit_margin_steps: int | None = None
    fence_waits: int | None = None
    vetoes: int | None = None
    late_items: int | None = None
    """Published layers whose agreed step had passed (dropped). Must stay 0."""
    fence_timeouts: int | None = None
    """Fence waits beyond 60 s (the worker thread is broken). Must stay 0."""
    worker_alive: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values (a copy), for JSON."""
        return asdict(self)

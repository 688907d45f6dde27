"""The load window: recorded every step, closed, snapshotted, reduced; and the state machine
that steps it.

Each step's load pass ``[L, P]`` (physical-slot counts written by the routing op) is copied into
row ``cursor`` of a ring ``[W, L, P]`` allocated once, and the pass is zeroed, all in place and
without a host sync. Next to every row the window keeps the committed placement that was live
while that row was recorded (an immutable host snapshot shared by all rows of one placement
version), so folding to logical experts never attributes old-placement counts to new experts.

At a window close the rows are copied into one of two snapshot buffers (still on the device, no
host sync) and handed to whoever plans; planning folds them to logical experts and sums them
across ranks in one collective (:func:`reduce_window`).

**The per-step state machine** (:class:`EplbController`, host side, between graph replays).
Per step the runner calls :meth:`EplbController.begin_step` before the forward (batch phase,
valid-token count) and :meth:`EplbController.end_step` after it. On ordinary steps this is a
handful of in-place device writes: no collective, no host sync. Work happens only on due steps:

- a balancedness log (``log_balancedness``, every ``log_balancedness_interval`` steps): one
  collective over the recent load;
- a window close (every ``step_interval`` steps, the first after ``step_interval // 4``): the
  window is snapshotted in place (no collective, no host sync) and handed to one sink, the
  rebalance pipeline, which reduces, plans and moves (inline in sync mode, on the movement
  worker's thread in async mode).

Every rank takes the same steps in the same order, whatever its local batch phase: a batch
outside ``load_collection_phase`` only records nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eplb_graph.control.feedback import (
    ServingFeedback,
    WindowFeedback,
    empty_feedback,
    feedback_size,
)
from eplb_graph.control.phases import BatchPhase
from eplb_graph.policy.metrics import balancedness_of_slots
from eplb_graph.state import EplbState

if TYPE_CHECKING:  # the settings module imports the control plane's phases
    from eplb_graph.settings import RuntimeSettings

logger = logging.getLogger(__name__)

LoadReducer = Callable[[torch.Tensor], torch.Tensor]
"""Sums a CPU tensor across EP ranks (in place or not) and returns the sum; one collective."""


def local_reducer(tensor: torch.Tensor) -> torch.Tensor:
    """Single-process reducer (simulator, tests): the local load is the global load."""
    return tensor


def process_group_reducer(group) -> LoadReducer:
    """All-reduce on ``group`` (a gloo group for CPU tensors; the EPLB group, never serving's)."""
    import torch.distributed as dist

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    return reduce


class LoadWindow:
    """Ring of the last ``window_size`` steps' load passes.

    Args:
        window_size: W, number of steps kept.
        num_layers, num_slots: L and P of the load pass.
        dtype, device: of the ring (same as the load pass).
    """

    def __init__(
        self,
        window_size: int,
        num_layers: int,
        num_slots: int,
        *,
        dtype: torch.dtype = torch.int64,
        device: torch.device | str = "cpu",
    ) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.rows = torch.zeros(window_size, num_layers, num_slots, dtype=dtype, device=device)
        # Placement snapshot (phy2log [L, P], never mutated) per row; None: nothing recorded.
        self._placements: list[torch.Tensor | None] = [None] * window_size
        self.cursor = 0
        self.steps_seen = 0

    @property
    def window_size(self) -> int:
        return self.rows.shape[0]

    def fold_pass_(self, load_pass: torch.Tensor, placement: torch.Tensor, recorded: bool) -> None:
        """Move one step's load pass ``[L, P]`` into the ring (in place) and zero the pass.

        ``placement`` is the committed ``phy2log [L, P]`` snapshot the step ran under. A step that
        did not record still takes a row (zeroed): windows count steps, not recorded steps.
        """
        row = self.rows[self.cursor]
        if recorded:
            row.copy_(load_pass)
            load_pass.zero_()
            self._placements[self.cursor] = placement
        else:
            row.zero_()
            self._placements[self.cursor] = None
        self.cursor = (self.cursor + 1) % self.window_size
        self.steps_seen += 1

    def recorded_steps(self) -> int:
        """Rows of the ring that hold a recorded step (the others were zeroed)."""
        return sum(placement is not None for placement in self._placements)

    def chronological_rows(self) -> list[int]:
        """Row indices from oldest to newest among the rows written so far."""
        filled = min(self.steps_seen, self.window_size)
        start = (self.cursor - filled) % self.window_size
        return [(start + i) % self.window_size for i in range(filled)]

    def snapshot(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """The written rows in chronological order and their placements.

        ``out`` (``[W, L, P]`` on the window's device) receives the rows in place when given:
        the async path hands it to the worker without allocating and without a host sync.
        Returns ``(rows [r, L, P], placements [r])``.
        """
        order = self.chronological_rows()
        index = torch.tensor(order, dtype=torch.int64, device=self.rows.device)
        if out is None:
            rows = self.rows.index_select(0, index)
        else:
            rows = torch.index_select(self.rows, 0, index, out=out[: len(order)])
        return rows, [self._placements[row] for row in order]


def fold_to_logical(
    rows: torch.Tensor, placements: list, num_logical: int, num_samples: int
) -> torch.Tensor:
    """Fold chronological slot-load rows ``[r, L, P]`` to ``[S, L, N]`` int64 CPU time buckets.

    ``placements[i]`` is the ``phy2log [L, P]`` row ``i`` was recorded under (``None``: nothing
    recorded). Rows sharing a placement are folded together with one ``scatter_add_``.
    """
    count = rows.shape[0]
    num_layers = rows.shape[1]
    buckets = max(1, min(num_samples, count))
    samples = torch.zeros(buckets, num_layers, num_logical, dtype=torch.int64)
    if count == 0:
        return samples
    rows_host = rows.to("cpu", torch.int64)
    bucket_of_row = (torch.arange(count) * buckets) // count
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for position, placement in enumerate(placements):
        if placement is not None:
            groups.setdefault(id(placement), (placement, []))[1].append(position)
    for placement, positions in groups.values():
        index = torch.tensor(positions)
        physical = rows_host.index_select(0, index)  # [r, L, P]
        logical = torch.zeros(len(positions), num_layers, num_logical, dtype=torch.int64)
        logical.scatter_add_(2, placement.expand_as(physical), physical)
        samples.index_add_(0, bucket_of_row.index_select(0, index), logical)
    return samples


@dataclass(frozen=True)
class WindowSnapshot:
    """A closed window, before any reduction: what the controller hands to planning.

    ``rows`` is a view of one of two buffers the controller allocated once and alternates
    between. Whoever plans copies it first thing and then checks ``still_valid()`` (the buffer
    was not refilled meanwhile), so a late reader detects reuse instead of reading torn data.
    """

    step: int
    rows: torch.Tensor  # [r, L, P] chronological, on the state's device
    placements: list  # [r] phy2log [L, P] per row (None: not recorded)
    committed: torch.Tensor  # [L, P] phy2log live at the close
    still_valid: Callable[[], bool] = lambda: True
    ready: object | None = None  # device event recorded after the copy (None on CPU)
    feedback: torch.Tensor | None = None  # this rank's serving figures (control/feedback.py)
    host_rows: torch.Tensor | None = None
    """The rows already copied to the host (the movement worker copies them as soon as its job
    is agreed); ``None``: whoever plans copies them first thing."""

    def copy_rows(self) -> torch.Tensor | None:
        """The rows on the host; ``None`` if the buffer was reused meanwhile (a seqlock: the
        version is checked after the copy)."""
        if self.ready is not None:
            self.ready.synchronize()  # the device copy into the buffer has finished
        rows = self.rows.to("cpu", copy=True)
        return rows if self.still_valid() else None


class SnapshotBuffers:
    """Two snapshot buffers ``[W, L, P]`` on the window's device, alternated at each close.

    A snapshot stays intact until the close after next; each buffer carries a version that the
    snapshot's ``still_valid`` compares, so a reader that comes later than that finds out.
    """

    def __init__(self, window: LoadWindow) -> None:
        self._window = window
        self._buffers = [torch.empty_like(window.rows) for _ in range(2)]
        self._versions = [0, 0]
        self._closes = 0

    def take(
        self, step: int, committed: torch.Tensor, feedback: torch.Tensor | None = None
    ) -> WindowSnapshot:
        """Snapshot the window into the next buffer (in place, no host sync)."""
        index = self._closes % 2
        self._closes += 1
        self._versions[index] += 1  # invalidates any snapshot still pointing here
        version = self._versions[index]
        rows, placements = self._window.snapshot(out=self._buffers[index])
        ready = None
        if rows.is_cuda:
            ready = torch.cuda.Event()
            ready.record()

        def still_valid() -> bool:
            return self._versions[index] == version

        return WindowSnapshot(step, rows, placements, committed, still_valid, ready, feedback)


@dataclass(frozen=True)
class WindowLoad:
    """The reduced load of one closed window (identical on every rank)."""

    step: int
    logical: torch.Tensor  # [S, L, N] int64, oldest time bucket first
    physical: torch.Tensor  # [L, P] int64, summed over the window
    committed: torch.Tensor  # [L, P] phy2log the window is planned against
    feedback: WindowFeedback | None = None  # serving figures summed over ranks (None: none)


def reduce_window(
    rows: torch.Tensor,
    snapshot: WindowSnapshot,
    committed: torch.Tensor,
    reduce: LoadReducer,
    num_logical: int,
    time_samples: int,
    num_ranks: int = 1,
) -> WindowLoad:
    """Fold a window's host ``rows`` to logical experts and sum them across ranks in one
    collective.

    The collective's size depends only on shapes every rank shares, and it is issued even if
    the local fold fails (with zeros; the error is re-raised after), so a local failure never
    leaves a peer paired with a different collective.
    """
    count, num_layers, num_slots = rows.shape
    buckets = max(1, min(time_samples, count))
    logical_size = buckets * num_layers * num_logical
    failure: Exception | None = None
    try:
        logical = fold_to_logical(rows, snapshot.placements, num_logical, time_samples)
        physical = rows.sum(dim=0).to("cpu", torch.int64)
        feedback = snapshot.feedback
        if feedback is None or feedback.numel() != feedback_size(num_ranks, num_layers):
            feedback = empty_feedback(num_ranks, num_layers)
        packed = torch.cat([logical.reshape(-1), physical.reshape(-1), feedback.to(torch.int64)])
    except Exception as error:  # still take part in the collective
        failure = error
        packed = torch.zeros(
            logical_size + num_layers * num_slots + feedback_size(num_ranks, num_layers),
            dtype=torch.int64,
        )
    packed = reduce(packed)
    if failure is not None:
        raise failure
    logical = packed[:logical_size].view(buckets, num_layers, num_logical)
    physical = packed[logical_size : logical_size + num_layers * num_slots]
    summed = packed[logical_size + num_layers * num_slots :]
    feedback = WindowFeedback.parse(summed) if int(summed[0]) > 0 else None
    return WindowLoad(
        snapshot.step, logical, physical.view(num_layers, num_slots), committed, feedback
    )


# -- the per-step state machine ------------------------------------------------------------------

WindowSink = Callable[[WindowSnapshot], None]
"""Receives every closed window (the rebalance pipeline, or a simulator's stand-in)."""


class EplbController:
    """Steps the load window and hands every closed window to ``on_window_closed``.

    Args:
        state: this rank's device state (its ``load`` is the load pass the graph writes).
        settings: window, interval, phase filter, logging.
        on_window_closed: receives each closed window's snapshot. Every rank hands off every
            window, so whoever plans walks the same sequence of windows on every rank.
        reduce: sums CPU tensors across EP ranks for the balancedness log only
            (:func:`process_group_reducer` over a group of its own).
        record_load: whether this rank records load at all. With replicated routing (every rank
            routes every token) one rank records and the others only take their steps, so the
            cross-rank sum counts each token once.
    """

    def __init__(
        self,
        state: EplbState,
        settings: RuntimeSettings,
        on_window_closed: WindowSink,
        *,
        reduce: LoadReducer = local_reducer,
        record_load: bool = True,
    ) -> None:
        self.state = state
        self.record_load = record_load
        self.settings = settings
        self.on_window_closed = on_window_closed
        self.reduce = reduce
        self.window = LoadWindow(
            settings.effective_window_size,
            state.num_layers,
            state.num_slots,
            dtype=state.load.dtype,
            device=state.device,
        )
        self._snapshots = SnapshotBuffers(self.window)
        self.step = 0
        # Upstream: the first rearrangement comes after step_interval // 4 steps.
        self.steps_to_rearrangement = max(1, settings.step_interval // 4)
        self.windows_closed = 0
        self.last_logged_balancedness: float | None = None
        self._recording = False
        self._phase: BatchPhase | None = None
        # What serving measured (step times, expert-op samples, movement cost) for the planner.
        self.feedback = ServingFeedback(state.expert_stats, state.rank, state.num_ranks)
        self._in_window = False
        self._step_started = 0.0
        self._in_flight = False
        self._moving = False
        self._num_valid_tokens = 0

    # -- per step --------------------------------------------------------------------------------
    def recording_due(self) -> bool:
        """Record only steps whose load can reach the next window close or balancedness log."""
        if self.settings.log_balancedness:
            return True
        return self.steps_to_rearrangement <= self.window.window_size

    def begin_step(
        self,
        *,
        has_prefill: bool,
        num_valid_tokens: int,
        in_flight: bool = False,
        moving: bool = False,
        started: float | None = None,
    ) -> None:
        """Before the forward: decide the batch phase once, set the graph's step inputs.

        ``in_flight``: the worker holds a job (asynchronous: reducing, planning or moving), so
        this step's time is not the placement's alone. ``moving``: that job is moving weights,
        so the step's extra time is the rearrangement's cost. ``started``: when the step began
        (``perf_counter``), if before this call (the runtime installs staged layers first).
        """
        self._step_started = time.perf_counter() if started is None else started
        self._in_flight = in_flight
        self._moving = moving
        self._num_valid_tokens = num_valid_tokens
        self._phase = BatchPhase.of_batch(has_prefill)
        collects = self.settings.load_collection_phase.collects(self._phase)
        # Every rank (recording or not) knows whether this step's load joins the next window.
        self._in_window = collects and self.steps_to_rearrangement <= self.window.window_size
        self._recording = self.record_load and collects and self.recording_due()
        self.state.set_step_inputs_(num_valid_tokens, self._recording)
        self.state.advance_offset_()

    def end_step(self) -> None:
        """After the forward: fold the load pass into the window; close it when due."""
        if self._phase is None:
            raise RuntimeError("end_step() called without begin_step()")
        version, placement = self.state.committed_snapshot()
        self.feedback.step(
            step_us=int(1e6 * (time.perf_counter() - self._step_started)),
            tokens=self._num_valid_tokens,
            decode=self._phase is BatchPhase.DECODE,
            in_flight=self._in_flight,
            version=version,
            in_window=self._in_window,
            moving=self._moving,
        )
        self.window.fold_pass_(self.state.load, placement, self._recording)
        self._phase = None
        self.step += 1
        self.steps_to_rearrangement -= 1
        if (
            self.settings.log_balancedness
            and self.step % self.settings.log_balancedness_interval == 0
        ):
            self._log_balancedness()
        if self.steps_to_rearrangement == 0:
            self.steps_to_rearrangement = self.settings.step_interval
            self._close_window()

    # -- due work ----------------------------------------------------------------------------
    def _log_balancedness(self) -> None:
        recent = min(
            self.settings.log_balancedness_interval,
            self.window.steps_seen,
            self.window.window_size,
        )
        rows = self.window.chronological_rows()[-recent:]
        index = torch.tensor(rows, device=self.window.rows.device)
        physical = self.window.rows.index_select(0, index).sum(dim=0).to("cpu", torch.int64)
        physical = self.reduce(physical)
        value = balancedness_of_slots(physical, self.state.num_ranks)
        self.last_logged_balancedness = value
        if self.state.rank == 0:
            logger.info(
                "EPLB step %d: balancedness %.4f over the last %d steps; %d steps until the next "
                "rearrangement",
                self.step,
                value,
                recent,
                self.steps_to_rearrangement,
            )

    def _close_window(self) -> None:
        version, committed = self.state.committed_snapshot()
        self.windows_closed += 1
        feedback = self.feedback.take(self.window.recorded_steps())
        started = time.perf_counter()
        self.on_window_closed(self._snapshots.take(self.step, committed, feedback))
        if self.state.placement_version != version:  # moved inline (synchronous)
            self.feedback.moved_inline(int(1e6 * (time.perf_counter() - started)))

    # -- monitoring --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Structured state for monitoring (plain Python values)."""
        return {
            "step": self.step,
            "steps_to_rearrangement": self.steps_to_rearrangement,
            "recording": self.recording_due(),
            "windows_closed": self.windows_closed,
            "placement_version": self.state.placement_version,
            "last_logged_balancedness": self.last_logged_balancedness,
            "cost_samples": self.feedback.snapshot(),
        }

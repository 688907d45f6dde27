"""The per-step EPLB state machine (host side, between graph replays).

Per step the runner calls :meth:`EplbController.begin_step` before the forward (batch phase,
valid-token count) and :meth:`EplbController.end_step` after it. On ordinary steps this is a
handful of in-place device writes: no collective, no host sync. Work happens only on due steps:

- a balancedness log (``log_balancedness``, every ``log_balancedness_interval`` steps): one
  collective over the recent load;
- a window close (every ``step_interval`` steps, the first after ``step_interval // 4``): one
  collective carrying the whole window folded to logical experts plus the physical totals, then
  the planner (a rebalance policy) and the hand-off of the new placement.

Every rank takes the same steps and the same collectives in the same order, whatever its local
batch phase: a batch outside ``load_collection_phase`` only records nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eplb_graph.control.phases import BatchPhase
from eplb_graph.control.settings import ControlSettings
from eplb_graph.control.window import LoadWindow, fold_to_logical
from eplb_graph.state import EplbState

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


@dataclass(frozen=True)
class WindowLoad:
    """The reduced load of one closed window (identical on every rank)."""

    step: int
    logical: torch.Tensor  # [S, L, N] int64, oldest time bucket first
    physical: torch.Tensor  # [L, P] int64, summed over the window
    committed: torch.Tensor  # [L, P] phy2log live when the window closed


@dataclass(frozen=True)
class WindowReport:
    """What one window close produced: the reduced load, and the plan if one was made."""

    load: WindowLoad
    balancedness: float  # of the committed placement under the window's executed load
    new_phy2log: torch.Tensor | None  # [L, P] or None when the planner kept the placement
    planner_seconds: float


Planner = Callable[[WindowLoad], "torch.Tensor | None"]


@dataclass(frozen=True)
class WindowSnapshot:
    """A closed window handed to the movement worker (async mode) before any reduction.

    ``rows`` is a view of one of two buffers the controller allocated once and alternates
    between; the worker copies it first thing and then checks ``still_valid()`` (the buffer was
    not refilled meanwhile), so a late worker detects reuse instead of reading torn data.
    """

    step: int
    rows: torch.Tensor  # [r, L, P] chronological, on the state's device
    placements: list  # [r] phy2log [L, P] per row (None: not recorded)
    committed: torch.Tensor  # [L, P] phy2log live at the close
    still_valid: Callable[[], bool] = lambda: True
    ready: object | None = None  # device event recorded after the copy (None on CPU)


def reduce_window(
    snapshot: WindowSnapshot, reduce: LoadReducer, num_logical: int, time_samples: int
) -> WindowLoad:
    """Fold a window to logical experts and sum it across ranks in one collective.

    The collective's size depends only on shapes every rank shares, and it is issued even if
    the local fold fails (with zeros; the error is re-raised after), so a local failure never
    leaves a peer paired with a different collective.
    """
    rows = snapshot.rows
    count, num_layers, num_slots = rows.shape
    buckets = max(1, min(time_samples, count))
    logical_size = buckets * num_layers * num_logical
    failure: Exception | None = None
    try:
        logical = fold_to_logical(rows, snapshot.placements, num_logical, time_samples)
        physical = rows.sum(dim=0).to("cpu", torch.int64)
        packed = torch.cat([logical.reshape(-1), physical.reshape(-1)])
    except Exception as error:  # still take part in the collective
        failure = error
        packed = torch.zeros(logical_size + num_layers * num_slots, dtype=torch.int64)
    packed = reduce(packed)
    if failure is not None:
        raise failure
    logical = packed[:logical_size].view(buckets, num_layers, num_logical)
    physical = packed[logical_size:].view(num_layers, num_slots)
    return WindowLoad(snapshot.step, logical, physical, snapshot.committed)


def balancedness_of_slots(physical: torch.Tensor, num_ranks: int) -> float:
    """Upstream balancedness of executed slot load ``[L, P]``: sum of per-layer mean rank load
    over sum of per-layer max rank load (0 when nothing ran)."""
    per_rank = physical.to(torch.float64).reshape(physical.shape[0], num_ranks, -1).sum(dim=2)
    peak = float(per_rank.max(dim=1).values.sum())
    return 0.0 if peak == 0.0 else float(per_rank.mean(dim=1).sum()) / peak


def hotness_snapshot(load: WindowLoad, new_phy2log: torch.Tensor | None, num_ranks: int) -> dict:
    """Peak-to-mean "expert hotness" of the committed placement and of the plan (or of the
    committed one again when no plan was made) under the window's logical load, as plain
    values for monitoring."""
    from eplb_graph.policy.metrics import expert_hotness

    logical = load.logical.sum(dim=0).to(torch.float64)
    new = load.committed if new_phy2log is None else new_phy2log
    return expert_hotness(load.committed, new, logical, num_ranks).as_dict()


class EplbController:
    """Steps the load window and decides when to plan a rearrangement.

    Args:
        state: this rank's device state (its ``load`` is the load pass the graph writes).
        settings: window, interval, phase filter, policy, logging.
        reduce: sums CPU tensors across EP ranks (:func:`process_group_reducer`).
        planner: called with the reduced window at each close; returns the new ``phy2log``
            or ``None`` to keep the placement. In async mode the movement worker runs it.
        on_plan: receives each non-``None`` plan (the movement plane / commit scheduler).
        handoff: async mode. At a window close the controller snapshots the window in place (no
            collective, no host sync on the main thread) into one of two reused buffers and
            calls ``handoff(snapshot)``; every rank hands off every window, so the workers walk
            the same sequence of jobs. ``reduce``/``planner``/``on_plan`` are the worker's
            business in this mode.
    """

    def __init__(
        self,
        state: EplbState,
        settings: ControlSettings,
        *,
        reduce: LoadReducer = local_reducer,
        planner: Planner | None = None,
        on_plan: Callable[[WindowReport], None] | None = None,
        handoff: Callable[[WindowSnapshot], None] | None = None,
    ) -> None:
        self.state = state
        self.settings = settings
        self.reduce = reduce
        self.planner = planner
        self.on_plan = on_plan
        self.handoff = handoff
        self.window = LoadWindow(
            settings.effective_window_size,
            state.num_layers,
            state.num_slots,
            dtype=state.load.dtype,
            device=state.device,
        )
        # Two buffers, alternated: a window's snapshot stays intact until the close after next.
        self._snapshot_buffers = (
            [torch.empty_like(self.window.rows) for _ in range(2)] if handoff is not None else []
        )
        self._snapshot_versions = [0, 0]
        self._closes = 0
        self.step = 0
        # Upstream: the first rearrangement comes after step_interval // 4 steps.
        self.steps_to_rearrangement = max(1, settings.step_interval // 4)
        self.rearrangements_planned = 0
        self.last_report: WindowReport | None = None
        self.last_logged_balancedness: float | None = None
        self.last_hotness: dict | None = None
        self._recording = False
        self._phase: BatchPhase | None = None

    # -- per step --------------------------------------------------------------------------------
    def recording_due(self) -> bool:
        """Record only steps whose load can reach the next window close or balancedness log."""
        if self.settings.log_balancedness:
            return True
        return self.steps_to_rearrangement <= self.settings.effective_window_size

    def begin_step(self, *, has_prefill: bool, num_valid_tokens: int) -> None:
        """Before the forward: decide the batch phase once, set the graph's step inputs."""
        self._phase = BatchPhase.of_batch(has_prefill)
        collects = self.settings.load_collection_phase.collects(self._phase)
        self._recording = collects and self.recording_due()
        self.state.set_step_inputs_(num_valid_tokens, self._recording)
        self.state.advance_offset_()

    def end_step(self) -> WindowReport | None:
        """After the forward: fold the load pass into the window; close it when due."""
        if self._phase is None:
            raise RuntimeError("end_step() called without begin_step()")
        _, placement = self.state.committed_snapshot()
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
            return self._close_window()
        return None

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

    def _close_window(self) -> WindowReport | None:
        _, committed = self.state.committed_snapshot()
        if self.handoff is not None:
            self._hand_off(committed)
            return None
        rows, placements = self.window.snapshot()
        load = reduce_window(
            WindowSnapshot(self.step, rows, placements, committed),
            self.reduce,
            self.state.num_logical,
            self.settings.time_samples,
        )
        physical = load.physical
        balance = balancedness_of_slots(physical, self.state.num_ranks)
        started = time.perf_counter()
        new_phy2log = self.planner(load) if self.planner is not None else None
        elapsed = time.perf_counter() - started
        report = WindowReport(load, balance, new_phy2log, elapsed)
        self.last_report = report
        self.last_hotness = hotness_snapshot(load, new_phy2log, self.state.num_ranks)
        if self.state.rank == 0:
            logger.info("EPLB window closed at step %d: hotness %s", self.step, self.last_hotness)
        if new_phy2log is not None:
            self.rearrangements_planned += 1
            if self.on_plan is not None:
                self.on_plan(report)
        return report

    def _hand_off(self, committed: torch.Tensor) -> None:
        index = self._closes % 2
        self._closes += 1
        self._snapshot_versions[index] += 1  # invalidates any snapshot still pointing here
        version = self._snapshot_versions[index]
        rows, placements = self.window.snapshot(out=self._snapshot_buffers[index])
        ready = None
        if rows.is_cuda:
            ready = torch.cuda.Event()
            ready.record()

        def still_valid() -> bool:
            return self._snapshot_versions[index] == version

        self.handoff(WindowSnapshot(self.step, rows, placements, committed, still_valid, ready))

    # -- monitoring --------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Structured state for monitoring (plain Python values)."""
        report = self.last_report
        return {
            "step": self.step,
            "steps_to_rearrangement": self.steps_to_rearrangement,
            "recording": self.recording_due(),
            "rearrangements_planned": self.rearrangements_planned,
            "placement_version": self.state.placement_version,
            "last_logged_balancedness": self.last_logged_balancedness,
            "last_window_balancedness": None if report is None else report.balancedness,
            "last_planner_seconds": None if report is None else report.planner_seconds,
            "last_hotness": self.last_hotness,
        }

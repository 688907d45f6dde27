"""The per-step EPLB state machine (host side, between graph replays).

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
from typing import TYPE_CHECKING

import torch

from eplb_graph.control.feedback import ServingFeedback
from eplb_graph.control.phases import BatchPhase
from eplb_graph.control.window import (
    LoadReducer,
    LoadWindow,
    SnapshotBuffers,
    WindowSnapshot,
    local_reducer,
)
from eplb_graph.policy.metrics import balancedness_of_slots
from eplb_graph.state import EplbState

if TYPE_CHECKING:  # the settings module imports the control plane's phases
    from eplb_graph.settings import RuntimeSettings

logger = logging.getLogger(__name__)

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
            (:func:`~eplb_graph.control.window.process_group_reducer` over a group of its own).
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
        return self.steps_to_rearrangement <= self.settings.effective_window_size

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
        self._in_window = (
            collects and self.steps_to_rearrangement <= self.settings.effective_window_size
        )
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

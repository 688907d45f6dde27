"""``EplbRuntime``: what a model runner calls around every forward.

It wires the control plane (window, phases, policy), the movement worker and the commit
scheduler to one rank's :class:`~eplb_graph.state.EplbState` and weight views::

    runtime.begin_step(has_prefill=..., num_valid_tokens=...)   # commits due layers
    replay the compiled / captured forward
    runtime.end_step()                                          # folds load, may hand off

On ordinary steps both calls are a few in-place tensor writes and a queue poll: no collective
and no host sync on the main thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from eplb_graph.control import (
    ControlSettings,
    EplbController,
    local_reducer,
    process_group_reducer,
)
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.movement.clock import StepClock
from eplb_graph.movement.scheduler import CommitScheduler
from eplb_graph.movement.settings import MovementSettings
from eplb_graph.movement.staging import StagingPool
from eplb_graph.movement.sync import rearrange_sync_
from eplb_graph.movement.worker import MovementWorker
from eplb_graph.state import EplbState

logger = logging.getLogger(__name__)


class EplbRuntime:
    """One rank's EPLB runtime.

    Args:
        state: the rank's EPLB state (read by the compiled forward).
        views: live weight views, one per MoE layer.
        control: window / interval / phase / policy settings.
        groups: gloo group provider for the EPLB traffic (``GroupRing``); never the serving group.
        rank: this rank's index in the EP group.
        use_async: plan and move on the worker thread (default) or synchronously at the close.
        movement: worker settings (layers per step, margins, timeouts).
        planner: overrides the policy planner built from ``control``.
        fault_hook: test-only fault injection passed to the worker.
        record_map_path: record mode (legacy ``expert_map_record_path``): plans are written to
            this expert-map JSON by rank 0 and never applied (async mode only).
    """

    def __init__(
        self,
        state: EplbState,
        views: Sequence,
        control: ControlSettings,
        groups: Callable[[], object],
        rank: int,
        *,
        use_async: bool = True,
        movement: MovementSettings | None = None,
        planner: Callable | None = None,
        fault_hook: Callable | None = None,
        record_map_path: str | None = None,
    ) -> None:
        if len(views) != state.num_layers:
            raise ValueError(
                f"need one weight view per layer ({state.num_layers}), got {len(views)}"
            )
        self.state = state
        self.views = list(views)
        self.rank = rank
        self.use_async = use_async
        self.movement = movement or MovementSettings()
        self.planner = planner or PolicyPlanner(
            control.policy,
            state.num_slots,
            control.num_groups,
            control.num_nodes,
            state.num_ranks,
            dict(control.policy_options),
        )
        slot_nbytes = max(view.slot_nbytes for view in self.views)
        self.pool = StagingPool(
            self.movement.num_staging_blocks, state.num_slots // state.num_ranks, slot_nbytes
        )
        self.groups = groups
        self.clock = StepClock()
        self.sync_layers_committed = 0
        if use_async:
            self.worker = MovementWorker(
                state,
                self.views,
                self.clock,
                self.pool,
                groups,
                rank,
                planner=self.planner,
                settings=self.movement,
                time_samples=control.time_samples,
                fault_hook=fault_hook,
                record_only_path=record_map_path,
            )
            self.scheduler = CommitScheduler(state, self.views, self.worker, self.pool, self.clock)
            # The balancedness log (opt-in) sums recent load across ranks on the main thread,
            # at logging steps only, over a gloo group of its own (never the serving group or
            # the worker's).
            reduce = local_reducer
            if control.log_balancedness and dist.is_initialized() and state.num_ranks > 1:
                reduce = process_group_reducer(dist.new_group(backend="gloo"))
            self.controller = EplbController(state, control, handoff=self._handoff, reduce=reduce)
        else:
            if record_map_path is not None:
                raise ValueError("record mode (record_map_path) needs use_async=True")
            self.worker = None
            self.scheduler = None
            self.controller = EplbController(
                state,
                control,
                reduce=process_group_reducer(groups()),
                planner=self.planner,
                on_plan=self._rearrange_sync,
            )

    # -- per step ------------------------------------------------------------------------------
    def begin_step(self, *, has_prefill: bool, num_valid_tokens: int) -> list[int]:
        committed = self.scheduler.begin_step() if self.scheduler is not None else []
        self.controller.begin_step(has_prefill=has_prefill, num_valid_tokens=num_valid_tokens)
        return committed

    def end_step(self) -> None:
        self.controller.end_step()
        if self.scheduler is not None:
            self.scheduler.end_step()
        else:
            self.clock.advance()

    # -- explicit rearrangement (all ranks, same step) ---------------------------------------
    def rearrange_to(self, new_phy2log: torch.Tensor) -> bool:
        """Move to ``new_phy2log [L, P]`` (every rank must call this at the same step).

        Async: queued behind any job in flight (the worker plans against the placement
        committed when it starts) and committed layer by layer at agreed steps. Sync: now.
        """
        if not self.use_async:
            self._move_sync(new_phy2log)
            return True
        self.scheduler.mark_busy()
        self.worker.submit_plan(new_phy2log)
        return True

    @property
    def busy(self) -> bool:
        return bool(self.scheduler is not None and self.scheduler.busy)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    # -- internals -------------------------------------------------------------------------------
    def _handoff(self, snapshot) -> None:
        self.scheduler.mark_busy()
        self.worker.submit_window(snapshot)

    def _rearrange_sync(self, report) -> None:
        self._move_sync(report.new_phy2log)

    def _move_sync(self, new_phy2log: torch.Tensor) -> None:
        committed = rearrange_sync_(
            self.state,
            self.views,
            new_phy2log,
            self.groups(),
            self.rank,
            self.pool,
            timeout_s=self.movement.exchange_timeout_s,
            max_batch_ops=self.movement.max_batch_ops,
        )
        self.sync_layers_committed += len(committed)

    def metrics(self) -> dict:
        """Structured snapshot for monitoring."""
        data = {"control": self.controller.snapshot(), "async": self.use_async}
        if self.worker is not None:
            w, s = self.worker.stats, self.scheduler.stats
            data["movement"] = {
                "rearrangements_started": w.rearrangements_started,
                "rearrangements_completed": w.rearrangements_completed,
                "rearrangements_aborted": w.rearrangements_aborted,
                "layers_published": w.layers_published,
                "layers_committed": s.layers_committed,
                "bytes_received": w.bytes_received,
                "late_items": s.late_items,
                "fence_waits": self.clock.fence_waits,
                "fence_timeouts": s.fence_timeouts,
                "vetoes": self.clock.vetoes,
                "last_error": w.last_error,
                "last_hotness": w.last_hotness,
                "policy_seconds": w.policy_seconds,
                "plans_recorded": w.plans_recorded,
                "rearrangements_noop": w.rearrangements_noop,
                "worker_alive": self.worker.alive,
            }
        else:
            data["movement"] = {"layers_committed": self.sync_layers_committed}
        return data

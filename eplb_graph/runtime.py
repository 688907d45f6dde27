"""``EplbRuntime``: what a model runner calls around every forward.

It wires the control plane (window, phases) and the movement plane (the rebalance pipeline, its
worker thread and commit scheduler in async mode) to one rank's :class:`~eplb_graph.state.EplbState`
and weight views::

    runtime.begin_step(has_prefill=..., num_valid_tokens=...)   # async: installs due layers
    replay the compiled / captured forward
    runtime.end_step()                                          # folds load, may rebalance

Threads: the calling (main) thread owns the state's tensors and the live weights; in async mode
the worker thread owns the rebalance pipeline and writes neither (it prepares, stages and
exchanges). On ordinary steps both calls are a few in-place tensor writes and a queue poll: no
collective and no host sync on the main thread. In sync mode the whole pipeline runs inside the
``end_step`` that closes a window (serving stalls for it; the layers are committed when it
returns), and ``begin_step`` never commits anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from eplb_graph.arguments import SettingsError
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window import EplbController, local_reducer, process_group_reducer
from eplb_graph.movement.commit import (
    CommitScheduler,
    InstallNow,
    PublishAtAgreedStep,
    StepClock,
)
from eplb_graph.movement.rebalance import FaultHook, PlanJob, RebalancePipeline, views_per_layer
from eplb_graph.movement.staging import LayerInstaller, StagingPool, check_staging_budget
from eplb_graph.movement.transport import StoreAgreement, default_store
from eplb_graph.movement.worker import MovementWorker
from eplb_graph.settings import RuntimeSettings
from eplb_graph.state import EplbState
from eplb_graph.stats import EplbStats, Progress

logger = logging.getLogger(__name__)


class EplbRuntime:
    """One rank's EPLB runtime.

    Args:
        state: the rank's EPLB state (read by the compiled forward).
        views: live weight views, one per MoE layer.
        settings: what to plan and when (window, interval, phase, policy, gate), how to move
            (staging, chunking, margins, timeouts), sync or async, record mode
            (``record_map_path``: plans are written to that expert-map JSON by rank 0 and never
            applied). The movement fields are capped by the model's layers
            (:meth:`RuntimeSettings.for_layers`); experts or ranks given there must match the
            state's.
        groups: gloo group provider for the EPLB traffic (``GroupRing``); never the serving group.
        rank: this rank's index in the EP group.
        planner: overrides the policy planner built from ``settings``.
        fault_hook: test-only fault injection in the pipeline.
        agreement: the store-decided votes (default: over the job's rendezvous store).
        record_load: whether this rank records load. Where every rank routes every token
            (replicated routing), pass ``rank == 0`` so each token is counted once.
    """

    def __init__(
        self,
        state: EplbState,
        views: Sequence,
        settings: RuntimeSettings,
        groups: Callable[[], object],
        rank: int,
        *,
        planner: Callable | None = None,
        fault_hook: FaultHook | None = None,
        agreement: StoreAgreement | None = None,
        record_load: bool = True,
    ) -> None:
        _check_model(settings, state)
        self.state = state
        self.views = views_per_layer(state, views)
        self.rank = rank
        # Capped by the model (a chunk or block count beyond its layers is never used).
        self.settings = settings = settings.for_layers(state.num_layers)
        self.use_async = use_async = settings.use_async
        # Read top-down, one rearrangement's path: what decides, where weights are staged and
        # installed, how ranks agree, the pipeline that moves, and the controller that starts
        # it at every window close.
        self.planner = planner or self._default_planner(settings)
        self.pool, self.installer = self._staging()
        self.clock = StepClock()
        self.agreement = agreement or self._default_agreement()
        self.worker = MovementWorker(rank) if use_async else None
        self.pipeline = RebalancePipeline(
            state,
            self.views,
            self.pool,
            groups,
            rank,
            self.agreement,
            self._delivery(),
            planner=self.planner,
            settings=settings,
            fault_hook=fault_hook,
        )
        self.scheduler: CommitScheduler | None = None
        if self.worker is not None:
            self.scheduler = CommitScheduler(
                self.worker, self.installer, self.clock, self.agreement.veto
            )
            self.worker.start(self.pipeline)
        # Where a closed window (or an explicit plan) goes: to the worker through the scheduler
        # (async), or through the pipeline now (sync).
        self.submit = self.pipeline.run if self.scheduler is None else self.scheduler.submit
        self.controller = EplbController(
            state,
            settings,
            self.submit,
            reduce=self._balancedness_reducer(settings),
            record_load=record_load,
        )
        gate = getattr(self.planner, "gate", None)
        if gate is not None:
            # The serving thread judges outlier calls against the model the worker last fitted
            # (an immutable object: reading the reference needs no lock).
            self.controller.feedback.model_source = lambda: gate.model

    # -- building ------------------------------------------------------------------------------
    def _default_planner(self, settings: RuntimeSettings) -> PolicyPlanner:
        state = self.state
        return PolicyPlanner(
            settings.policy,
            state.num_slots,
            settings.num_groups,
            settings.num_nodes,
            state.num_ranks,
            dict(settings.policy_options),
            settings.min_gain_percent,
            rearrange=settings.rearrange,
            max_replicas=state.max_replicas,
            step_interval=settings.step_interval,
            copy_bytes=self._slot_nbytes,
            announce=self.rank == 0,
            windows_path=settings.windows_path if self.rank == 0 else None,
        )

    @property
    def _slot_nbytes(self) -> int:
        return max(view.slot_nbytes for view in self.views)

    def _staging(self) -> tuple[StagingPool, LayerInstaller]:
        """The staging blocks (their memory checked against its budget before any of it is
        allocated) and the installer that empties them into the live weights."""
        slots_per_rank = self.state.num_slots // self.state.num_ranks
        blocks = self.settings.num_staging_blocks
        nbytes = self._slot_nbytes
        check_staging_budget(blocks, slots_per_rank, nbytes, self.settings.staging_budget_bytes)
        pool = StagingPool(blocks, slots_per_rank, nbytes)
        return pool, LayerInstaller(self.state, self.views, pool)

    def _default_agreement(self) -> StoreAgreement:
        lag = self.settings.exchange_timeout_s + self.settings.agree_timeout_s
        return StoreAgreement(
            default_store(),
            self.rank,
            self.state.num_ranks,
            vote_timeout_s=lag,
            decision_timeout_s=2 * lag + 5.0,
        )

    def _delivery(self) -> PublishAtAgreedStep | InstallNow:
        """Async: publish to the main thread for an agreed step; sync: install at once."""
        if self.worker is None:
            return InstallNow(self.installer)
        return PublishAtAgreedStep(
            self.clock, self.pool, self.worker.publish, self.settings.commit_margin_steps
        )

    def _balancedness_reducer(self, settings: RuntimeSettings):
        """The balancedness log (opt-in) sums recent load across ranks on the main thread, at
        logging steps only, over a gloo group of its own (never the serving group)."""
        if settings.log_balancedness and dist.is_initialized() and self.state.num_ranks > 1:
            return process_group_reducer(dist.new_group(backend="gloo"))
        return local_reducer

    # -- per step ------------------------------------------------------------------------------
    def begin_step(self, *, has_prefill: bool, num_valid_tokens: int) -> list[int]:
        """Before the forward; returns the layers committed now (always empty in sync mode).

        The step is timed from before the installs: installing a staged layer is part of what
        moving cost this step (and a step that installs a job's last layers still moved).
        """
        started = time.perf_counter()
        moving = self.moving
        committed = self.scheduler.begin_step() if self.scheduler is not None else []
        self.controller.begin_step(
            has_prefill=has_prefill,
            num_valid_tokens=num_valid_tokens,
            in_flight=self.busy or moving,
            moving=moving,
            started=started,
        )
        return committed

    def end_step(self) -> None:
        """After the forward; a window close starts (async) or runs (sync) a rearrangement."""
        self.controller.end_step()
        if self.scheduler is not None:
            self.scheduler.end_step()
        else:
            self.clock.advance()

    # -- explicit rearrangement (all ranks, same step) ---------------------------------------
    def rearrange_to(self, new_phy2log: torch.Tensor) -> None:
        """Move to ``new_phy2log [L, P]`` (every rank must call this at the same step).

        Async: queued behind any job in flight (planned against the placement committed when
        it starts) and committed layer by layer at agreed steps. Sync: now.
        """
        self.submit(PlanJob(torch.as_tensor(new_phy2log).clone(), self.clock.step))

    @property
    def busy(self) -> bool:
        """A rearrangement handed to the worker has not finished yet (async only)."""
        return self.scheduler is not None and self.scheduler.busy

    @property
    def moving(self) -> bool:
        """A job is moving weights: it got past planning with layers to move, and its layers
        are not all installed yet (async only). Every window close makes the worker busy; only
        this part of it is a rearrangement's cost."""
        return (
            self.scheduler is not None
            and self.pipeline.moves_started > self.scheduler.moves_settled
        )

    def close(self) -> None:
        """Stop the movement worker. Serving has ended: a job waiting for the main thread to
        install earlier layers (which it never will now) aborts at once instead of holding the
        thread for ``install_wait_s``."""
        if self.worker is not None:
            self.pool.close()
            self.worker.stop()

    # -- what it has done ------------------------------------------------------------------------
    def progress(self) -> Progress:
        """Counters that move only when EPLB does something: a cheap test, every step, of
        whether :meth:`stats` changed."""
        pipeline = self.pipeline.stats
        finished = (
            self.scheduler.stats.rearrangements_finished
            if self.scheduler is not None
            else pipeline.rearrangements_started
        )
        return Progress(
            self.controller.windows_closed,
            pipeline.rearrangements_started,
            finished,
            self._aborted(),
            pipeline.plans_recorded,
            pipeline.record_failures,
            self.installer.stats.layers_committed,
        )

    def stats(self) -> EplbStats:
        """Everything this rank's EPLB has done, as one immutable value (:mod:`eplb_graph.stats`).

        Async, the rearrangement counts are the main thread's: a rearrangement counts once its
        end marker is consumed (after its every layer is installed), so the counts agree with
        the commits this thread has made.
        """
        pipeline, controller = self.pipeline.stats, self.controller
        feedback = controller.feedback
        moved = feedback.movement_cost_us
        gate = getattr(self.planner, "gate", None)
        scheduler = self.scheduler
        if scheduler is not None:
            completed = scheduler.stats.rearrangements_completed
            finished = scheduler.stats.rearrangements_finished
        else:
            completed, finished = pipeline.jobs_delivered, pipeline.rearrangements_started
        protocol = {}
        if scheduler is not None:
            protocol = {
                "windows_committed": scheduler.stats.windows_committed,
                "windows_pending": scheduler.jobs_in_flight,
                "windows_coalesced": self.worker.windows_coalesced,
                "windows_stood_in": self.worker.windows_stood_in,
                "job_rounds_failed": self.worker.job_rounds_failed,
                "commit_margin_steps": self.pipeline.delivery.margin,
                "fence_waits": self.clock.fence_waits,
                "vetoes": self.clock.vetoes,
                "late_items": scheduler.stats.late_items,
                "fence_timeouts": scheduler.stats.fence_timeouts,
                "worker_alive": self.worker.alive,
            }
        return EplbStats(
            steps=controller.step,
            is_async=self.use_async,
            windows_closed=controller.windows_closed,
            placement_version=self.state.placement_version,
            recording=controller.recording_due(),
            last_logged_balancedness=controller.last_logged_balancedness,
            cost_samples_taken=feedback.samples_taken,
            cost_samples_dropped=feedback.samples_dropped,
            last_decision=getattr(self.planner, "last_decision", None),
            planning_failures=getattr(self.planner, "failures", 0),
            planning_seconds=pipeline.policy_seconds,
            gate=None if gate is None else gate.published,
            last_window_balancedness=pipeline.last_window_balancedness,
            window_balancedness=tuple(pipeline.window_balancedness),
            last_hotness=pipeline.last_hotness,
            rearrangements_started=pipeline.rearrangements_started,
            rearrangements_finished=finished,
            rearrangements_completed=completed,
            rearrangements_aborted=self._aborted(),
            rearrangements_noop=pipeline.rearrangements_noop,
            layers_delivered=pipeline.layers_delivered,
            layers_committed=self.installer.stats.layers_committed,
            commit_ms=tuple(1e3 * s for s in self.installer.stats.commit_seconds),
            bytes_received=pipeline.bytes_received,
            movement_cost_ms=None if moved is None else moved / 1e3,
            plans_recorded=pipeline.plans_recorded,
            record_failures=pipeline.record_failures,
            last_error=pipeline.last_error,
            moving=self.moving,
            **protocol,
        )

    def _aborted(self) -> int:
        if self.scheduler is not None:
            return self.scheduler.stats.rearrangements_failed
        return self.pipeline.stats.rearrangements_aborted

    @property
    def last_step_expert_ns(self) -> int:
        """This rank's expert-op ns in the last step (all layers; 0 where the op is not timed
        on the host): read once per step, by the controller."""
        return self.controller.feedback.last_step_expert_ns

    def calibrate_expert_cost(self, rows, active, micros) -> None:
        """Give the expert cost model calls timed outside serving (a calibration at attach):
        ``rows``, ``active`` slots and ``micros`` per call, equal lengths."""
        self.controller.feedback.calibrate(rows, active, micros)


def _check_model(settings: RuntimeSettings, state: EplbState) -> None:
    """Settings resolved for one model must not drive a state built for another."""
    if not isinstance(settings, RuntimeSettings):
        raise TypeError(f"settings must be RuntimeSettings, got {type(settings).__name__}")
    for name, want, have in (
        ("experts", settings.num_experts, state.num_logical),
        ("physical slots", settings.num_physical_experts, state.num_slots),
        ("EP ranks", settings.ep_size, state.num_ranks),
    ):
        if want is not None and want != have:
            raise SettingsError(
                f"the settings describe {want} {name} but the state holds {have}; build the "
                "state from settings.initial_placement (or resolve for this model)"
            )

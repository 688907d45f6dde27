"""The one rebalance pipeline: a closed window (or an explicit plan) in, committed layers out.

One rearrangement, top-down (:meth:`RebalancePipeline.run`):

1. **group**: pick a healthy gloo group. Every rank probes the current one and the outcome is a
   shared decision (``agreement``), so all ranks leave a group a timeout broke, together.
2. **reduce**: fold the window to logical experts and sum it across ranks on that group. The
   collective is issued whatever failed locally (with zeros then), so a peer never waits out a
   timeout on a healthy group.
3. **observe, plan**: record the window in the planner's history, then run the policy locally
   (identical inputs on every rank, so identical plans).
4. **agree**: every rank votes ok and a digest of its plan; the coordinator commits only if all
   planned the same placement.
5. **per chunk** of ``layers_per_step`` changed layers: plan the transfer (pure data, identical
   on every rank), acquire a staging block, pack the sources, exchange with peers, prepare the
   lookup tables; then **deliver** the chunk: on the worker thread (async mode) a fenced
   decision fixes the step at which every rank's main thread installs it; inline (sync mode) a
   decision says whether every rank installs it now.

Any error on any rank (policy, staging, exchange, timeout, a silent peer) makes that rank vote
abort, or miss the vote, which the coordinator treats as abort. Decisions are single values in
the rendezvous store, so every rank acts alike: layers already delivered stay committed; the
rest stay old on every rank.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from eplb_graph.control.planning import plan_window
from eplb_graph.control.window import WindowSnapshot, reduce_window
from eplb_graph.movement.commit import InstallNow, PublishAtAgreedStep, PublishedLayer
from eplb_graph.movement.planner import plan_transfer
from eplb_graph.movement.staging import StagingPool, stage_reads_
from eplb_graph.movement.transport import (
    Decision,
    GlooStagedCommunicator,
    StoreAgreement,
    TransferError,
    probe_group,
)
from eplb_graph.state import EplbState

if TYPE_CHECKING:  # the settings module imports the control plane's phases
    from eplb_graph.settings import RuntimeSettings

logger = logging.getLogger(__name__)

BALANCEDNESS_HISTORY = 64
"""Windows whose balancedness the stats keep (for monitoring; older ones are dropped)."""


@dataclass(frozen=True)
class PlanJob:
    """Move to an explicit placement ``phy2log [L, P]`` (every rank submits the same one, at the
    same serving ``step``)."""

    phy2log: torch.Tensor
    step: int = 0


Job = WindowSnapshot | PlanJob
"""What the pipeline runs: a closed window (rebalance from its load) or an explicit plan."""

FaultHook = Callable[[str, int], None]
"""Test hook called at named points ("plan", "stage", "exchange", "agree") with the layer (-1
when not per layer); it may raise or sleep to inject a fault."""


@dataclass(frozen=True)
class Outcome:
    """How one rearrangement ended on this rank (identical on every rank: decisions are)."""

    ok: bool
    error: str | None
    layers_delivered: int


@dataclass
class RebalanceStats:
    """Counters of the pipeline on this rank (plain values, for metrics)."""

    rearrangements_started: int = 0
    jobs_delivered: int = 0  # every changed layer delivered (installed, in sync mode)
    rearrangements_aborted: int = 0
    rearrangements_noop: int = 0  # the plan equalled the committed placement
    layers_delivered: int = 0  # handed to the main thread (async) or installed (sync)
    bytes_received: int = 0
    policy_seconds: float = 0.0
    plans_recorded: int = 0  # record mode: plans written to the expert map, not applied
    record_failures: int = 0  # record mode: agreed plans that could not be written
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)
    last_hotness: dict | None = None  # committed vs planned peak-to-mean at the last window
    last_window_balancedness: float | None = None  # committed placement, last window's load
    window_balancedness: list[float] = field(default_factory=list)  # the last HISTORY windows


def views_per_layer(state: EplbState, views: Sequence) -> list:
    """``views`` as a list, checked to hold one weight view per layer of ``state`` (a runtime
    checks it before it allocates anything; the pipeline, which can be built alone, again)."""
    if len(views) != state.num_layers:
        raise ValueError(f"need one weight view per layer ({state.num_layers}), got {len(views)}")
    return list(views)


class RebalancePipeline:
    """Runs rearrangements for one rank (see the module docstring for the steps).

    Args:
        state: this rank's EPLB state (read here: the committed placement and ``prepare_layer``).
        views: the live weight view of every MoE layer, in layer order.
        pool: staging blocks (sized once).
        groups: the gloo group ring (``GroupRing``): called for the current group; ``poison()``
            moves every rank to the next one after a transport failure.
        rank: this rank's index in those groups.
        agreement: the store-decided votes all ranks act on.
        delivery: :class:`PublishAtAgreedStep` (async) or :class:`InstallNow` (sync).
        planner: ``WindowLoad -> phy2log | None`` for window jobs.
        settings: chunking, timeouts, the time buckets the window is folded into for the
            policy (``time_samples``), and record mode (``record_map_path``: write each agreed
            plan to that expert-map JSON (rank 0) and never move weights or change the
            placement).
        fault_hook: test-only fault injection.
    """

    def __init__(
        self,
        state: EplbState,
        views: Sequence,
        pool: StagingPool,
        groups: Callable[[], object],
        rank: int,
        agreement: StoreAgreement,
        delivery: PublishAtAgreedStep | InstallNow,
        *,
        planner: Callable | None,
        settings: RuntimeSettings,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.state = state
        self.views = views_per_layer(state, views)
        self.pool = pool
        self.groups = groups
        self.rank = rank
        self.agreement = agreement
        self.delivery = delivery
        self.planner = planner
        self.time_samples = settings.time_samples
        self.settings = settings
        self.fault_hook = fault_hook or (lambda point, layer: None)
        self.record_map_path = settings.record_map_path
        self.stats = RebalanceStats()
        self._generation = 0
        self.moves_started = 0
        """Jobs that got past planning with layers to move (written by the worker thread only;
        the main thread compares it with what the finished markers it consumed reported, to
        tell a step that ran while weights moved from one that ran while a window was planned)."""

    def run(self, job: Job) -> Outcome:
        """One rearrangement. Every rank must run the same jobs in the same order."""
        self._generation += 1
        self.stats.rearrangements_started += 1
        attempt = _Attempt(self._generation)
        try:
            group = self._healthy_group(attempt)
        except Exception as failure:
            group = None
            attempt.fail(f"no movement group: {type(failure).__name__}: {failure}")
        # Earlier layers must be installed first: their sources are read from the live
        # weights, and the placement they leave is this job's starting point.
        if not self.pool.wait_all_free(self.settings.install_wait_s):
            attempt.fail("earlier layers were not installed by the main thread in time")
        _, old = self.state.committed_snapshot()
        new = self._plan(attempt, job, group, old)
        decision = attempt.decide(
            self.agreement, "plan", digest=placement_digest(new) if attempt.ok else 0
        )
        if not decision.commit:
            # Only plan decisions choose whether to leave the group: nobody can veto them, so
            # the transport flag in them is the same on every rank.
            return self._abort(
                attempt.error or f"plan rejected: {decision.reason}",
                leave_group=decision.transport_failed,
            )
        if self.record_map_path is not None:
            return self._record_plan(new)
        changed = [layer for layer in range(len(new)) if not torch.equal(old[layer], new[layer])]
        if not changed:
            self.stats.rearrangements_noop += 1
            return self._finish(0)
        return self._move(attempt, group, old, new, changed)

    # -- steps ---------------------------------------------------------------------------------
    def _healthy_group(self, attempt: _Attempt):
        """The current gloo group if every rank can still use it, else the next healthy one.

        An earlier timeout may have closed the current group's connections on some rank. Each
        rank probes it and the probe outcome is a shared decision, so all ranks leave a broken
        group together (and keep a healthy one, e.g. after a mere veto).
        """
        for probe in itertools.count():
            group = self.groups()
            healthy = probe_group(group, self.settings.agree_timeout_s)
            decision = self.agreement.decide(f"{attempt.generation}/probe/{probe}", ok=healthy)
            if decision.commit:
                return group
            logger.warning("EPLB: movement group unhealthy (%s); moving on", decision.reason)
            poison = getattr(self.groups, "poison", None)
            if poison is None:
                raise RuntimeError(f"the movement group is unhealthy: {decision.reason}")
            poison()
        raise AssertionError("unreachable")

    def _plan(self, attempt: _Attempt, job: Job, group, old: torch.Tensor) -> torch.Tensor:
        """The placement this job moves to (``old`` when planning failed or kept it)."""
        if isinstance(job, PlanJob):
            return job.phy2log if attempt.ok else old
        # Before anything else: the snapshot's buffer is reused two window closes later.
        rows = job.host_rows if job.host_rows is not None else job.copy_rows()
        if rows is None:
            attempt.fail("window snapshot was overwritten before the worker read it (worker late)")
        if group is None:
            return old
        # The reduction is issued whatever failed locally (zeros then): a rank that skipped it
        # would leave its peers waiting out a timeout on a healthy group.
        plan = attempt.ok
        if rows is None:
            rows = torch.zeros(job.rows.shape, dtype=torch.int64)
        try:
            load = reduce_window(
                rows,
                job,
                old,
                self._reducer(group),
                self.state.num_logical,
                self.time_samples,
                self.state.num_ranks,
            )
        except Exception as failure:
            attempt.transport_failed = True
            attempt.fail(f"window reduction failed: {type(failure).__name__}: {failure}")
            return old
        # Every rank reduced the same window: record it in the planner's history before anything
        # below can fail, so the histories stay equal on every rank whatever happens next.
        observe = getattr(self.planner, "observe", None)
        if observe is not None:
            observe(load)
        if not plan:
            return old
        try:
            self.fault_hook("plan", -1)
            window_plan = plan_window(load, self.planner, self.state.num_ranks)
        except Exception as failure:
            attempt.fail(f"policy failed: {type(failure).__name__}: {failure}")
            return old
        self.stats.policy_seconds += window_plan.seconds
        self.stats.last_hotness = window_plan.hotness
        self.stats.last_window_balancedness = window_plan.balancedness
        history = self.stats.window_balancedness
        history.append(window_plan.balancedness)
        del history[:-BALANCEDNESS_HISTORY]
        return old if window_plan.new_phy2log is None else window_plan.new_phy2log

    def _reducer(self, group):
        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.wait(timedelta(seconds=self.settings.agree_timeout_s))
            return tensor

        return reduce

    def _move(self, attempt: _Attempt, group, old, new, changed: list[int]) -> Outcome:
        self.moves_started += 1
        communicator = GlooStagedCommunicator(
            group,
            self.rank,
            max_batch_ops=self.settings.max_batch_ops,
            timeout_s=self.settings.exchange_timeout_s,
        )
        delivered = 0
        chunk_size = self.settings.layers_per_step
        for index, start in enumerate(range(0, len(changed), chunk_size)):
            chunk = changed[start : start + chunk_size]
            staged: list[PublishedLayer] = []
            error = None
            try:
                for layer in chunk:
                    staged.append(self._stage_layer(communicator, layer, old[layer], new[layer]))
                self.fault_hook("agree", chunk[0])
            except Exception as failure:
                for item in staged:
                    self.pool.release(item.block)
                staged = []
                error = f"layers {chunk}: {type(failure).__name__}: {failure}"
                attempt.transport_failed |= isinstance(failure, TransferError)
            received = sum(item.bytes_received for item in staged)
            decision = self.delivery.deliver(
                self.agreement,
                f"{attempt.generation}/commit/{index}",
                staged,
                ok=error is None,
                transport_failed=attempt.transport_failed,
            )
            if not decision.commit:
                # The next job's probe finds out whether this group survived.
                return self._abort(error or f"commit rejected: {decision.reason}", False, delivered)
            delivered += len(chunk)
            self.stats.layers_delivered += len(chunk)
            self.stats.bytes_received += received
        self.stats.jobs_delivered += 1
        return self._finish(delivered)

    def _stage_layer(self, communicator, layer: int, old_row, new_row) -> PublishedLayer:
        plan = plan_transfer(old_row, new_row, self.state.num_ranks)
        rank_plan = plan.ranks[self.rank]
        prepared = self.state.prepare_layer(layer, new_row)
        block = self.pool.acquire(layer, timeout=self.settings.install_wait_s)
        if block is None:
            raise TimeoutError("no staging block was released by the main thread in time")
        try:
            self.fault_hook("stage", layer)
            stage_reads_(self.views[layer], rank_plan, block)
            self.fault_hook("exchange", layer)
            received = communicator.bytes_received
            communicator.exchange(plan, block, layer=layer)
            received = communicator.bytes_received - received
        except BaseException:
            self.pool.release(block)
            raise
        return PublishedLayer(layer, -1, rank_plan, block, prepared, received)

    def _record_plan(self, new: torch.Tensor) -> Outcome:
        """Record mode: the agreed plan is written as an expert map, never applied.

        Every rank checks that the plan can be written (the same check of the same agreed
        plan, so the counters agree on every rank); rank 0 then writes it atomically (temp file
        + rename: a crash never leaves half a file). A plan that cannot be written is reported
        (log, ``record_failures``, ``last_error``), never counted as recorded.
        """
        from eplb_graph.expert_map import ExpertMapError, expert_map_document, parse_expert_map
        from eplb_graph.placement import Placement

        try:
            document = expert_map_document(new, self.state.num_ranks)
            parse_expert_map(document, num_logical=self.state.num_logical)
            if self.rank == 0:
                placement = Placement(new, self.state.num_logical, self.state.num_ranks)
                placement.save_expert_map(self.record_map_path)
        except (ExpertMapError, OSError) as failure:
            error = f"record mode: the plan was not recorded: {failure}"
            self.stats.record_failures += 1
            self.stats.last_error = error
            self.stats.errors.append(error)
            logger.error("EPLB rearrangement %d on rank %d: %s", self._generation, self.rank, error)
            return Outcome(False, error, 0)
        self.stats.plans_recorded += 1
        if self.rank == 0:
            logger.info("EPLB record mode: wrote the agreed plan to %s", self.record_map_path)
        return self._finish(0)

    # -- endings -------------------------------------------------------------------------------
    def _abort(self, error: str, leave_group: bool, delivered: int = 0) -> Outcome:
        """Every rank reaches this for the same attempt (the decision was shared)."""
        self.stats.rearrangements_aborted += 1
        self.stats.last_error = error
        self.stats.errors.append(error)
        logger.error(
            "EPLB rearrangement %d aborted on rank %d: %s", self._generation, self.rank, error
        )
        poison = getattr(self.groups, "poison", None)
        # gloo closes pairs on timeouts: leave a group a transport failure touched. The flag
        # comes from a shared plan decision, so every rank moves to the next group together; a
        # veto or a policy error leaves the group healthy and in use.
        if poison is not None and leave_group:
            poison()
        return Outcome(False, error, delivered)

    def record_failure(self, error: str) -> Outcome:
        """An unexpected exception escaped :meth:`run` (a bug): count and report it."""
        self.stats.rearrangements_aborted += 1
        self.stats.last_error = error
        self.stats.errors.append(error)
        return Outcome(False, error, 0)

    def _finish(self, delivered: int) -> Outcome:
        return Outcome(True, None, delivered)


class _Attempt:
    """The local state of one rearrangement attempt: its generation, first error, transport."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.error: str | None = None
        self.transport_failed = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, error: str) -> None:
        self.error = self.error or error

    def decide(self, agreement: StoreAgreement, phase: str, **vote) -> Decision:
        return agreement.decide(
            f"{self.generation}/{phase}",
            ok=self.ok,
            transport_failed=self.transport_failed,
            **vote,
        )


def placement_digest(phy2log: torch.Tensor) -> int:
    """A 62-bit digest of a placement, equal on every rank that planned the same thing."""
    data = phy2log.to(torch.int64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2

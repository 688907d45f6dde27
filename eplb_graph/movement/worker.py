"""The asynchronous movement worker: one thread per rank, off the serving path.

Jobs (a closed window in async mode, or an explicit plan) are processed in FIFO order; every
rank hands its worker the same jobs in the same order. For each job:

1. wait until earlier jobs' layers are installed (their sources are read from live weights);
2. pick a healthy gloo group: every rank probes the current one and the probe outcome is a
   shared decision (``agreement``), so all ranks leave a group a timeout broke, together;
3. with a window: fold it to logical experts, all-reduce it on that group (always issued, with
   zeros if the local fold failed), run the planner (the policy) locally;
4. "plan" decision: every rank votes ok and a digest of its plan; the coordinator commits only if
   all planned the same placement;
5. layer by layer, in chunks of ``layers_per_step``: plan the transfer (pure data, identical on
   every rank), acquire a staging block, pack the sources, exchange with peers, prepare the
   layer's lookup tables; then a "commit" decision behind the clock's fence fixes the commit step
   (or the main thread vetoes it if serving reaches the fence first); publish the chunk.

Any error on any rank — policy, staging, exchange, timeout, a peer that stopped responding —
makes that rank vote abort (or miss the vote, which the coordinator treats as abort). Decisions
are single values in the rendezvous store, so every rank acts alike: layers already published
stay committed; the rest stay old on every rank. Serving waits only for its own worker's
hand-over of a committed chunk, never for a peer.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from eplb_graph.control.controller import WindowSnapshot, hotness_snapshot, reduce_window
from eplb_graph.errors import EplbError
from eplb_graph.movement.agreement import StoreAgreement, default_store
from eplb_graph.movement.clock import StepClock
from eplb_graph.movement.communicator import (
    GlooStagedCommunicator,
    TransferError,
    stage_reads_,
)
from eplb_graph.movement.planner import plan_transfer
from eplb_graph.movement.settings import MovementSettings
from eplb_graph.movement.staging import StagingBlock, StagingPool
from eplb_graph.state import EplbState

logger = logging.getLogger(__name__)

GroupFactory = Callable[[], object]
FaultHook = Callable[[str, int], None]
"""Test hook called at named points ("plan", "stage", "exchange", "agree") with the layer (-1
when not per layer); it may raise or sleep to inject a fault."""


@dataclass
class PublishedLayer:
    """A staged layer and the step at which every rank installs it (main thread)."""

    generation: int
    layer: int
    commit_step: int
    rank_plan: object
    block: StagingBlock
    prepared: tuple  # EplbState.prepare_layer output
    bytes_received: int


@dataclass
class RearrangementFinished:
    """End marker of one job (processed by the main thread as soon as it is reached)."""

    generation: int
    ok: bool
    error: str | None


@dataclass
class WorkerStats:
    rearrangements_started: int = 0
    rearrangements_completed: int = 0
    rearrangements_aborted: int = 0
    rearrangements_noop: int = 0
    layers_published: int = 0
    bytes_received: int = 0
    policy_seconds: float = 0.0
    last_error: str | None = None
    errors: list[str] = field(default_factory=list)
    last_hotness: dict | None = None  # current vs planned peak-to-mean at the last window
    plans_recorded: int = 0  # record mode: plans written to the expert map, not applied


class MovementWorker:
    """Runs policy and weight movement for one rank on a background thread.

    Args:
        state: this rank's EPLB state (read-only here: only ``prepare_layer`` and metadata).
        views: the layer's ``ExpertWeightView`` for every MoE layer, in layer order.
        clock: the main thread's step clock.
        pool: staging blocks (sized once).
        group_factory: builds a fresh gloo group over all EP ranks (called once per attempt by
            every rank's worker, in the same order).
        rank: this rank's index in those groups.
        planner: ``WindowLoad -> phy2log | None`` (async mode); unused for explicit plans.
        settings: chunking, margins, timeouts.
        fault_hook: test-only fault injection.
        record_only_path: record mode: write each agreed plan to this expert-map JSON (rank 0)
            and never move weights or change the placement.
    """

    def __init__(
        self,
        state: EplbState,
        views: Sequence,
        clock: StepClock,
        pool: StagingPool,
        group_factory: GroupFactory,
        rank: int,
        *,
        planner: Callable | None = None,
        settings: MovementSettings | None = None,
        time_samples: int = 8,
        fault_hook: FaultHook | None = None,
        agreement: StoreAgreement | None = None,
        record_only_path: str | None = None,
    ) -> None:
        if len(views) != state.num_layers:
            raise ValueError(
                f"need one weight view per layer: {state.num_layers}, got {len(views)}"
            )
        self.state = state
        self.views = list(views)
        self.clock = clock
        self.pool = pool
        self.group_factory = group_factory
        self.rank = rank
        self.planner = planner
        self.settings = settings or MovementSettings()
        self.time_samples = time_samples
        self.fault_hook = fault_hook or (lambda point, layer: None)
        self.record_only_path = record_only_path
        lag = self.settings.exchange_timeout_s + self.settings.agree_timeout_s
        self.agreement = agreement or StoreAgreement(
            default_store(),
            rank,
            state.num_ranks,
            vote_timeout_s=lag,
            decision_timeout_s=2 * lag + 5.0,
        )
        self.stats = WorkerStats()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._generation = 0
        self._thread = threading.Thread(target=self._run, name=f"eplb-movement-{rank}", daemon=True)
        self._thread.start()

    # -- main thread API -----------------------------------------------------------------------
    def submit_window(self, snapshot: WindowSnapshot) -> None:
        self._inbox.put(("window", snapshot))

    def submit_plan(self, new_phy2log: torch.Tensor) -> None:
        """Queue a move to ``new_phy2log [L, P]`` (planned against the placement committed when
        the job starts, after every earlier job's layers are installed)."""
        self._inbox.put(("plan", new_phy2log.clone()))

    def poll(self) -> list:
        """Everything published since the last poll (PublishedLayer / RearrangementFinished)."""
        items = []
        while True:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                return items

    def stop(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            kind, payload = self._inbox.get()
            if kind == "stop":
                return
            self._generation += 1
            self.stats.rearrangements_started += 1
            try:
                self._rearrange(kind, payload)
            except Exception:  # never let the thread die: report and wait for the next window
                error = traceback.format_exc(limit=3)
                logger.error("EPLB movement worker failed unexpectedly:\n%s", error)
                self.stats.rearrangements_aborted += 1
                self.stats.last_error = error
                self.stats.errors.append(error)
                self._outbox.put(RearrangementFinished(self._generation, False, error))

    def _decide(self, phase: str, **vote):
        """The coordinator's decision for this attempt's ``phase`` (see ``agreement``)."""
        return self.agreement.decide(f"{self._generation}/{phase}", **vote)

    def _rearrange(self, kind: str, payload) -> None:
        """One attempt. Data moves over the gloo group; every go/no-go and every commit step
        is a coordinator decision (``agreement``), so all ranks act alike whatever failed."""
        error: str | None = None
        group = None
        self._transport_failed = False
        try:
            group = self._healthy_group()
        except Exception as failure:
            error = f"no movement group: {type(failure).__name__}: {failure}"
        # Earlier jobs' layers must be installed first: their sources are read from the live
        # weights, and the placement they leave is this job's starting point.
        if not self.pool.wait_all_free(self.settings.exchange_timeout_s):
            error = error or "earlier layers were not installed by the main thread in time"
        _, old = self.state.committed_snapshot()
        new = old
        if kind == "window":
            rows = _copy_snapshot(payload)  # before anything else: the buffer is reused
            if rows is None:
                error = error or (
                    "window snapshot was overwritten before the worker read it (worker late)"
                )
            if group is not None:
                # The reduction is issued whatever failed locally (zeros then): a rank that
                # skipped it would leave its peers waiting out a timeout on a healthy group.
                new, failure = self._plan_from_window(group, payload, rows, old, error is None)
                error = error or failure
        elif error is None:
            new = payload
        digest = _placement_digest(new) if error is None else 0
        decision = self._decide(
            "plan", ok=error is None, digest=digest, transport_failed=self._transport_failed
        )
        if not decision.commit:
            # Only plan decisions choose whether to leave the group: nobody can veto them, so
            # the transport flag in them is the same on every rank.
            self._abort(error or f"plan rejected: {decision.reason}", decision.transport_failed)
            return
        if self.record_only_path is not None:
            self._record_plan(new)
            self._finish(ok=True, error=None)
            return
        changed = [layer for layer in range(len(new)) if not torch.equal(old[layer], new[layer])]
        if not changed:
            self.stats.rearrangements_noop += 1
            self._finish(ok=True, error=None)
            return
        communicator = GlooStagedCommunicator(
            group,
            self.rank,
            max_batch_ops=self.settings.max_batch_ops,
            timeout_s=self.settings.exchange_timeout_s,
        )
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
                error = f"layers {chunk}: {type(failure).__name__}: {failure}"
                self._transport_failed |= isinstance(failure, TransferError)
            round_key = f"{self._generation}/commit/{index}"
            fence = self.clock.raise_fence(self.settings.commit_margin_steps, round_key)
            try:
                decision = self.agreement.decide(
                    round_key,
                    ok=error is None,
                    proposal=fence,
                    transport_failed=self._transport_failed,
                )
            except Exception:
                self.clock.lower_fence()
                for item in staged:
                    self.pool.release(item.block)
                raise
            if not decision.commit:
                for item in staged:
                    self.pool.release(item.block)
                self.clock.lower_fence()
                # The next attempt's probe finds out whether this group survived.
                self._abort(error or f"commit rejected: {decision.reason}", False)
                return
            for item in staged:
                item.commit_step = decision.step
                self.pool.publish(item.block)
                self._outbox.put(item)
                self.stats.layers_published += 1
                self.stats.bytes_received += item.bytes_received
            self.clock.lower_fence()
        self.stats.rearrangements_completed += 1
        self._finish(ok=True, error=None)

    def _plan_from_window(
        self, group, snapshot: WindowSnapshot, rows: torch.Tensor | None, old, plan: bool
    ):
        """Reduce the window (one collective, always issued) then plan locally from ``old``.

        ``rows`` None (the snapshot was lost) or ``plan`` False (an earlier local failure):
        take part in the reduction with zeros and do not plan.
        Returns ``(new, error)``; on a local failure ``new`` is ``old`` and ``error`` says why
        (the caller votes abort).
        """
        if rows is None:
            rows = torch.zeros(snapshot.rows.shape, dtype=torch.int64)

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            work.wait(timedelta_s(self.settings.agree_timeout_s))
            return tensor

        try:
            load = reduce_window(
                dataclasses.replace(snapshot, rows=rows, committed=old),
                reduce,
                self.state.num_logical,
                self.time_samples,
            )
        except Exception as failure:
            self._transport_failed = True
            return old, f"window reduction failed: {type(failure).__name__}: {failure}"
        # Every rank reduced the same window: record it in the planner's history now, so that a
        # local failure below (or no planning at all) leaves the histories equal on all ranks.
        observe = getattr(self.planner, "observe", None)
        if observe is not None:
            observe(load)
        if not plan:
            return old, None
        try:
            self.fault_hook("plan", -1)
            started = time.perf_counter()
            new = self.planner(load) if self.planner is not None else None
            self.stats.policy_seconds += time.perf_counter() - started
            self.stats.last_hotness = hotness_snapshot(load, new, self.state.num_ranks)
        except Exception as failure:
            return old, f"policy failed: {type(failure).__name__}: {failure}"
        return (old if new is None else new), None

    def _stage_layer(self, communicator, layer: int, old_row, new_row) -> PublishedLayer:
        plan = plan_transfer(old_row, new_row, self.state.num_ranks)
        rank_plan = plan.ranks[self.rank]
        prepared = self.state.prepare_layer(layer, new_row)
        block = self.pool.acquire(layer, timeout=self.settings.exchange_timeout_s)
        if block is None:
            raise TimeoutError("no staging block was released by the main thread in time")
        try:
            self.fault_hook("stage", layer)
            stage_reads_(self.views[layer], rank_plan, block)
            self.fault_hook("exchange", layer)
            received = communicator.bytes_received
            communicator.exchange(plan, block, tag_base=layer * 1_000_003 % (1 << 30))
            received = communicator.bytes_received - received
        except BaseException:
            self.pool.release(block)
            raise
        return PublishedLayer(self._generation, layer, -1, rank_plan, block, prepared, received)

    def _record_plan(self, new: torch.Tensor) -> None:
        """Record mode (legacy ``expert_map_record_path``): the plan is written, never applied.

        Rank 0 writes the map atomically (temp file + rename), so a crash never leaves a
        half-written file.
        """
        from eplb_graph.placement import Placement

        self.stats.plans_recorded += 1
        if self.rank == 0:
            placement = Placement(new, self.state.num_logical, self.state.num_ranks)
            placement.save_expert_map(self.record_only_path)
            logger.info(
                "EPLB record mode: wrote the planned expert map to %s", self.record_only_path
            )

    def _healthy_group(self):
        """The current gloo group if every rank can still use it, else the next healthy one.

        An earlier timeout may have closed the current group's connections on some rank. Each
        rank probes it and the probe outcome is a shared decision, so all ranks leave a broken
        group together (and keep a healthy one, e.g. after a mere veto).
        """
        for attempt in itertools.count():
            group = self.group_factory()
            decision = self._decide(f"probe/{attempt}", ok=self._probe(group))
            if decision.commit:
                return group
            logger.warning("EPLB: movement group unhealthy (%s); moving on", decision.reason)
            poison = getattr(self.group_factory, "poison", None)
            if poison is None:
                raise RuntimeError(f"the movement group is unhealthy: {decision.reason}")
            poison()
        raise AssertionError("unreachable")

    def _probe(self, group) -> bool:
        """A one-element all-reduce: does this group still connect every rank?"""
        try:
            probe = torch.ones(1)
            work = dist.all_reduce(probe, group=group, async_op=True)
            work.wait(timedelta_s(self.settings.agree_timeout_s))
            return True
        except Exception as failure:
            logger.warning("EPLB movement group probe failed on rank %d: %s", self.rank, failure)
            return False

    def _abort(self, error: str, leave_group: bool) -> None:
        """Every rank reaches this for the same attempt (the decision was shared)."""
        self.stats.rearrangements_aborted += 1
        self.stats.last_error = error
        self.stats.errors.append(error)
        logger.error(
            "EPLB rearrangement %d aborted on rank %d: %s", self._generation, self.rank, error
        )
        poison = getattr(self.group_factory, "poison", None)
        # gloo closes pairs on timeouts: leave a group a transport failure touched. The flag
        # comes from a shared plan decision, so every rank moves to the next group together; a
        # veto or a policy error leaves the group healthy and in use.
        if poison is not None and leave_group:
            poison()
        self._finish(ok=False, error=error)

    def _finish(self, *, ok: bool, error: str | None) -> None:
        """Tell the main thread this job is over (it only tracks 'busy' locally: every rank
        processes every job in the same order, so nothing about it needs agreeing)."""
        self._outbox.put(RearrangementFinished(self._generation, ok, error))


def timedelta_s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class GroupRing:
    """Gloo groups created up front, on the main thread, collectively on every rank.

    The worker uses the current group until an abort poisons it (gloo closes connections on a
    timeout), then moves to the next. Creating groups from the worker thread instead would race
    with the main thread's use of torch.distributed's global registry. When the ring is
    exhausted EPLB movement stops, loudly (``GroupsExhausted``), instead of stalling silently.
    """

    def __init__(self, size: int = 4, *, timeout_s: float = 60.0, ranks=None) -> None:
        if size < 1:
            raise ValueError(f"group ring size must be >= 1, got {size}")
        self._groups = [
            dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta_s(timeout_s))
            for _ in range(size)
        ]
        self._index = 0

    def __call__(self):
        if self._index >= len(self._groups):
            raise GroupsExhausted(
                f"all {len(self._groups)} EPLB movement groups were poisoned by failures; "
                "movement is disabled until restart"
            )
        return self._groups[self._index]

    def poison(self) -> None:
        self._index += 1


class GroupsExhausted(EplbError, RuntimeError):
    """Every pre-created movement group was poisoned by an abort."""


def _placement_digest(phy2log: torch.Tensor) -> int:
    """A 62-bit digest of a placement, equal on every rank that planned the same thing."""
    import hashlib

    data = phy2log.to(torch.int64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _copy_snapshot(snapshot: WindowSnapshot) -> torch.Tensor | None:
    """Copy the snapshot rows to the host; ``None`` if the controller reused the buffer meanwhile
    (a seqlock: the version is checked after the copy)."""
    if snapshot.ready is not None:
        snapshot.ready.synchronize()  # device copy into the buffer finished (CUDA/NPU event)
    rows = snapshot.rows.to("cpu", copy=True)
    return rows if snapshot.still_valid() else None

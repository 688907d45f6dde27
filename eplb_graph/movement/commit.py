"""The asynchronous commit protocol: staged layers reach every rank's lookup at one step.

All ranks must switch a layer's routing at the same serving step, and a token routed by a new
lookup must find the new weights on every peer. Four steps, each between graph replays on the
main thread or on the movement worker, never inside a forward:

1. **publish at an agreed step** (:class:`PublishAtAgreedStep`, worker): the worker raises the
   clock's fence at ``F = current step + margin`` and votes with ``F``; the decided commit step
   is ``S = max(F over ranks)``, so no rank's main thread has passed it. It then hands the
   staged layers (:class:`PublishedLayer`) to the main thread for step ``S`` and lowers the
   fence. Synchronous mode (:class:`InstallNow`) installs at once after the same decision.
2. **fence** (:class:`StepClock`, main thread): when serving reaches ``F`` with the fence still
   up, the main thread resolves the decision itself: it writes a veto unless a decision
   already exists (first writer wins in the store). If the decision that stands is "commit",
   its own worker is about to publish, and the main thread waits for that local hand-over
   only: it never runs past ``S`` without the layers, and never waits on a slow peer.
3. **install** (:class:`CommitScheduler`, main thread, at the start of step ``S``): weights,
   then the layer's lookup, in place (``LayerInstaller``).
4. **acknowledge**: installing releases the layer's staging block to the worker, which reuses
   it only then (invariant 6); the job's end marker (:class:`RearrangementFinished`) follows its
   layers through the same queue, so when the scheduler reaches it, every layer is installed.

Nothing crosses threads but the queue's items and the staging blocks they carry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from eplb_graph.movement.planner import RankPlan
from eplb_graph.movement.staging import LayerInstaller, StagingBlock, StagingPool
from eplb_graph.movement.transport import Decision, StoreAgreement
from eplb_graph.state import PreparedLayer

__all__ = [
    "CommitScheduler",
    "InstallNow",
    "PublishAtAgreedStep",
    "PublishedLayer",
    "RearrangementFinished",
    "StepClock",
]

logger = logging.getLogger(__name__)


class Worker(Protocol):
    """The movement worker as the scheduler sees it (``MovementWorker``): its inbox and its
    outbox, where published items wait for the main thread."""

    def submit(self, job: Any) -> None: ...

    def poll(self) -> list[PublishedLayer | RearrangementFinished]: ...


# -- what travels from the worker to the main thread ---------------------------------------------


@dataclass
class PublishedLayer:
    """A staged layer and the step at which every rank installs it (main thread)."""

    layer: int
    commit_step: int
    rank_plan: RankPlan
    block: StagingBlock
    prepared: PreparedLayer
    bytes_received: int


@dataclass(frozen=True)
class RearrangementFinished:
    """End marker of one rearrangement (processed by the main thread as soon as it is reached).

    ``layers_delivered`` counts the layers this rearrangement handed over; they are ahead of this
    marker in the queue, so when the scheduler reaches it, every one of them is installed.
    ``items_consumed`` counts the submitted windows (or the plan) this job took, several when a
    backlog of windows was coalesced into one job. ``moves_started``: the pipeline's count of jobs
    that started moving weights, this one included, when it finished.
    """

    ok: bool
    error: str | None
    layers_delivered: int = 0
    items_consumed: int = 1
    moves_started: int = 0


# -- the step clock and its fence -----------------------------------------------------------


class StepClock:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._step = 0
        self._fence: int | None = None
        self._fence_key: str | None = None
        self._resolved = False
        self.fence_waits = 0
        self.fence_wait_seconds = 0.0
        self.vetoes = 0

    @property
    def step(self) -> int:
        return self._step

    # -- main thread ---------------------------------------------------------------------------
    def enter_step(self, resolve: Callable[[str], object], timeout_s: float) -> bool:
        """Before serving the current step. Returns False only if a *committed* decision's local
        hand-over did not arrive within ``timeout_s`` (the worker thread is broken)."""
        with self._condition:
            if self._fence is None or self._step < self._fence or self._resolved:
                return True
            key = self._fence_key
        decision = resolve(key)  # a store round trip, only on this rare path
        with self._condition:
            if self._fence_key != key:
                return True  # the worker published (or aborted) meanwhile
            if not decision.commit:
                self._resolved = True  # aborted (perhaps by our veto): the worker will release
                self.vetoes += 1
                return True
            self.fence_waits += 1
            started = time.perf_counter()
            handed_over = self._condition.wait_for(
                lambda: self._fence_key != key, timeout=timeout_s
            )
            self.fence_wait_seconds += time.perf_counter() - started
            return handed_over

    def advance(self) -> None:
        with self._condition:
            self._step += 1

    # -- worker --------------------------------------------------------------------------------
    def raise_fence(self, margin: int, key: str) -> int:
        """Fence the main thread at ``current step + margin`` for decision ``key``."""
        if margin < 1:
            raise ValueError(f"commit margin must be >= 1 step, got {margin}")
        with self._condition:
            self._fence = self._step + margin
            self._fence_key = key
            self._resolved = False
            return self._fence

    def lower_fence(self) -> None:
        with self._condition:
            self._fence = None
            self._fence_key = None
            self._resolved = False
            self._condition.notify_all()


# -- publishing a staged chunk at an agreed step (or installing it now) ------------------------


class PublishAtAgreedStep:
    """Async delivery: a fenced decision fixes the step every rank's main thread installs at.

    The worker raises the clock's fence at ``now + margin`` and votes with it; the decided step
    is the largest fence, so no rank's main thread has passed it. If serving reaches the fence
    first, the main thread vetoes instead of waiting for a peer.

    The margin adapts: a veto means a decision took longer than ``margin`` serving steps (steps
    much shorter than a store round trip, a loaded host), and the same margin would be vetoed
    again and again, so it doubles (up to ``MAX_MARGIN_FACTOR`` times the configured one); each
    commit shrinks it back by an eighth, never below the configured ``commit_margin_steps``.
    Every rank sees the same decisions, so every rank's margin follows the same path.
    """

    MAX_MARGIN_FACTOR = 64

    def __init__(
        self,
        clock: StepClock,
        pool: StagingPool,
        publish: Callable[[PublishedLayer], None],
        commit_margin_steps: int,
    ) -> None:
        self.clock = clock
        self.pool = pool
        self.publish = publish
        self.commit_margin_steps = commit_margin_steps
        self.margin = commit_margin_steps
        self._last_commit_step = 0

    def deliver(
        self,
        agreement: StoreAgreement,
        round_key: str,
        staged: list[PublishedLayer],
        ok: bool,
        transport_failed: bool,
    ) -> Decision:
        # Commit steps never go backwards, or a layer would queue behind an earlier-published
        # one whose step is later, and its own step would pass before the scheduler reached it.
        margin = max(self.margin, self._last_commit_step - self.clock.step)
        fence = self.clock.raise_fence(margin, round_key)
        try:
            decision = agreement.decide(
                round_key, ok=ok, proposal=fence, transport_failed=transport_failed
            )
            self._adapt_margin(decision)
            if decision.commit:
                self._last_commit_step = decision.step
                for item in staged:
                    item.commit_step = decision.step
                    self.pool.publish(item.block)
                    self.publish(item)
                staged = []
            return decision
        finally:
            for item in staged:
                self.pool.release(item.block)
            self.clock.lower_fence()

    def _adapt_margin(self, decision: Decision) -> None:
        if decision.vetoed:
            ceiling = self.commit_margin_steps * self.MAX_MARGIN_FACTOR
            self.margin = min(2 * self.margin, ceiling)
        elif decision.commit:
            self.margin = max(self.commit_margin_steps, self.margin - max(1, self.margin // 8))


class InstallNow:
    """Sync delivery: every rank is inside the same call, so a decision is all it takes; the
    chunk is installed on the calling (main) thread before the decision call returns."""

    def __init__(self, installer: LayerInstaller) -> None:
        self.installer = installer

    def deliver(
        self,
        agreement: StoreAgreement,
        round_key: str,
        staged: list[PublishedLayer],
        ok: bool,
        transport_failed: bool,
    ) -> Decision:
        pending = list(staged)
        try:
            decision = agreement.decide(round_key, ok=ok, transport_failed=transport_failed)
            if decision.commit:
                while pending:
                    item = pending[0]
                    self.installer.install_(item.layer, item.rank_plan, item.block, item.prepared)
                    pending.pop(0)  # installed, and its block released by the installer
            return decision
        finally:
            for item in pending:
                self.installer.pool.release(item.block)


# -- installing on the main thread ------------------------------------------------------------


@dataclass
class SchedulerStats:
    late_items: int = 0  # must stay 0: an item whose agreed step had passed (never committed)
    fence_timeouts: int = 0
    rearrangements_finished: int = 0
    rearrangements_failed: int = 0
    rearrangements_completed: int = 0  # ended ok with layers, every one of them installed
    windows_committed: int = 0  # items (windows, plans) consumed by jobs that committed layers


class CommitScheduler:
    """Installs what the worker published, at the agreed step, on the main thread.

    Args:
        worker: the movement worker (its inbox and outbox).
        installer: writes weights and lookup, then frees the staging block.
        clock: the step clock shared with the worker.
        veto: resolves a fenced decision from the main thread (``StoreAgreement.veto``).
        fence_timeout_s: longest the main thread waits at a raised fence.
    """

    def __init__(
        self,
        worker: Worker,
        installer: LayerInstaller,
        clock: StepClock,
        veto: Callable[[str], Decision],
        *,
        fence_timeout_s: float = 60.0,
    ) -> None:
        self.worker = worker
        self.installer = installer
        self.clock = clock
        self.veto = veto
        self.fence_timeout_s = fence_timeout_s
        self.stats = SchedulerStats()
        self.jobs_in_flight = 0  # items handed to the worker and not consumed by a finished job
        self.moves_settled = 0  # moving jobs whose finished marker was consumed (all installed)
        self._pending: deque[PublishedLayer | RearrangementFinished] = deque()

    def begin_step(self) -> list[int]:
        """Call before the forward of the current step; returns the layers committed now."""
        if not self.clock.enter_step(self.veto, self.fence_timeout_s):
            self.stats.fence_timeouts += 1
            logger.critical(
                "EPLB: a committed layer was not handed over by the local worker within %.0f s; "
                "this rank may now disagree with its peers (the worker thread is broken)",
                self.fence_timeout_s,
            )
        self._pending.extend(self.worker.poll())
        step = self.clock.step
        committed: list[int] = []
        while self._pending:
            item = self._pending[0]
            if isinstance(item, RearrangementFinished):  # job over: nothing to install
                self._pending.popleft()
                self._finish(item)
                continue
            if item.commit_step > step:
                break
            self._pending.popleft()
            if item.commit_step < step:
                # Unreachable while the fence protocol holds; never install late (the peers
                # switched at item.commit_step), just report loudly.
                self.stats.late_items += 1
                logger.error(
                    "EPLB: layer %d published for past step %d (now %d); dropped",
                    item.layer,
                    item.commit_step,
                    step,
                )
                self.installer.pool.release(item.block)
                continue
            self.installer.install_(item.layer, item.rank_plan, item.block, item.prepared)
            committed.append(item.layer)
        return committed

    def end_step(self) -> None:
        self.clock.advance()

    @property
    def busy(self) -> bool:
        return self.jobs_in_flight > 0

    def submit(self, job: Any) -> None:
        """Hand a job (a closed window or an explicit plan) to the worker: the controller's
        sink at every window close, and ``rearrange_to``'s. Busy until its end marker is
        consumed."""
        self.jobs_in_flight += 1
        self.worker.submit(job)

    def _finish(self, item: RearrangementFinished) -> None:
        self.jobs_in_flight -= item.items_consumed
        self.moves_settled = max(self.moves_settled, item.moves_started)
        self.stats.rearrangements_finished += 1
        # The job's layers were ahead of this marker in the queue: all are installed now.
        if item.layers_delivered:  # its windows led to committed layers, even if it aborted later
            self.stats.windows_committed += item.items_consumed
        if not item.ok:
            self.stats.rearrangements_failed += 1
        elif item.layers_delivered:
            self.stats.rearrangements_completed += 1

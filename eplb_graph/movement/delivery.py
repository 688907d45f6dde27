"""Delivering a staged chunk of layers: when and where every rank installs it.

Two ways, one interface (``deliver(agreement, round_key, staged, ok, transport_failed)``): the
worker thread publishes to the main thread for an agreed serving step (async mode), or the
calling main thread installs at once after a decision (sync mode). Either way every rank acts
on the same store decision, so a chunk is installed on all ranks or on none.
"""

from __future__ import annotations

from collections.abc import Callable

from eplb_graph.movement.agreement import Decision, StoreAgreement
from eplb_graph.movement.clock import StepClock
from eplb_graph.movement.messages import PublishedLayer
from eplb_graph.movement.staging import LayerInstaller, StagingPool


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

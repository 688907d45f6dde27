"""The commit scheduler: the main thread's side of async movement, run between graph replays.

At the start of every step it (1) waits if the worker's fence covers this step (bounded; almost
never), (2) installs every published layer whose agreed commit step has come (weights, then the
layer's lookup, then the staging block goes back to the worker: ``LayerInstaller``). All ranks
do this at the same agreed step, so a token routed by a new lookup finds new weights on every
peer. With nothing pending this costs a queue poll and a lock: no collective, no host sync.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from eplb_graph.movement.agreement import Decision
from eplb_graph.movement.clock import StepClock
from eplb_graph.movement.messages import PublishedLayer, RearrangementFinished
from eplb_graph.movement.staging import LayerInstaller
from eplb_graph.movement.worker import MovementWorker

logger = logging.getLogger(__name__)


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
        worker: the movement worker (its outbox).
        installer: writes weights and lookup, then frees the staging block.
        clock: the step clock shared with the worker.
        veto: resolves a fenced decision from the main thread (``StoreAgreement.veto``).
        fence_timeout_s: longest the main thread waits at a raised fence.
    """

    def __init__(
        self,
        worker: MovementWorker,
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

    def mark_busy(self) -> None:
        self.jobs_in_flight += 1

    def _finish(self, item: RearrangementFinished) -> None:
        self.jobs_in_flight -= item.items_consumed
        self.moves_settled = max(self.moves_settled, item.moves_started)
        self.stats.rearrangements_finished += 1
        # The job's layers were ahead of this marker in the queue: all are installed now.
        if item.layers_published:  # its windows led to committed layers, even if it aborted later
            self.stats.windows_committed += item.items_consumed
        if not item.ok:
            self.stats.rearrangements_failed += 1
        elif item.layers_published:
            self.stats.rearrangements_completed += 1

"""The commit scheduler: the main thread's side of movement, run between graph replays.

At the start of every step it (1) waits if the worker's fence covers this step (bounded; almost
never), (2) installs every published layer whose agreed commit step has come: writes the staged
payloads into the live weight views, commits the layer's placement into the EPLB state (lookup
refreshed in place), and only then (3) releases the staging block to the worker (invariant 6).
All ranks do this at the same agreed step, so a token routed by a new lookup finds new weights on
every peer. With nothing pending this costs a queue poll and a lock: no collective, no host sync.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from eplb_graph.movement.clock import StepClock
from eplb_graph.movement.communicator import install_layer_
from eplb_graph.movement.staging import StagingPool
from eplb_graph.movement.worker import MovementWorker, PublishedLayer, RearrangementFinished
from eplb_graph.state import EplbState

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    layers_committed: int = 0
    slots_written: int = 0
    bytes_installed: int = 0
    commit_seconds: list[float] = field(default_factory=list)  # per layer, main thread
    late_items: int = 0  # must stay 0: an item whose agreed step had passed (never committed)
    fence_timeouts: int = 0
    rearrangements_finished: int = 0
    rearrangements_failed: int = 0


class CommitScheduler:
    """Installs what the worker published, at the agreed step, on the main thread.

    Args:
        state: the EPLB state whose lookup is refreshed in place.
        views: live weight views per layer (what the fused kernel reads).
        worker: the movement worker (its outbox).
        pool: the staging pool shared with the worker.
        clock: the step clock shared with the worker.
        fence_timeout_s: longest the main thread waits at a raised fence.
    """

    def __init__(
        self,
        state: EplbState,
        views,
        worker: MovementWorker,
        pool: StagingPool,
        clock: StepClock,
        *,
        fence_timeout_s: float = 60.0,
    ) -> None:
        self.state = state
        self.views = list(views)
        self.worker = worker
        self.pool = pool
        self.clock = clock
        self.fence_timeout_s = fence_timeout_s
        self.stats = SchedulerStats()
        self.jobs_in_flight = 0  # handed to the worker and not finished yet (local only)
        self._pending: deque = deque()

    def begin_step(self) -> list[int]:
        """Call before the forward of the current step; returns the layers committed now."""
        if not self.clock.enter_step(self.worker.agreement.veto, self.fence_timeout_s):
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
                self.pool.release(item.block)
                continue
            self._commit(item)
            committed.append(item.layer)
        return committed

    def end_step(self) -> None:
        self.clock.advance()

    def _commit(self, item: PublishedLayer) -> None:
        started = time.perf_counter()
        written = install_layer_(self.views[item.layer], item.rank_plan, item.block)
        self.state.commit_prepared_(item.layer, item.prepared)
        self.pool.release(item.block)  # only now may the worker reuse this memory
        self.stats.commit_seconds.append(time.perf_counter() - started)
        self.stats.layers_committed += 1
        self.stats.slots_written += written
        self.stats.bytes_installed += written * self.views[item.layer].slot_nbytes

    @property
    def busy(self) -> bool:
        return self.jobs_in_flight > 0

    def _finish(self, item: RearrangementFinished) -> None:
        self.jobs_in_flight -= 1
        self.stats.rearrangements_finished += 1
        if not item.ok:
            self.stats.rearrangements_failed += 1

    def mark_busy(self) -> None:
        self.jobs_in_flight += 1

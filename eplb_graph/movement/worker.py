"""The movement worker: one thread per rank that runs rearrangements off the serving path.

It is only a job loop. Jobs (closed windows, explicit plans) arrive in FIFO order, and every rank
hands its worker the same jobs in the same order; the worker runs each through the rebalance
pipeline (``rebalance``), whose asynchronous delivery publishes staged layers into this
worker's outbox, and then puts the job's end marker behind them. The main thread's commit
scheduler drains the outbox between graph replays.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback

from eplb_graph.movement.messages import PublishedLayer, RearrangementFinished
from eplb_graph.movement.rebalance import Job, RebalancePipeline

logger = logging.getLogger(__name__)


class MovementWorker:
    """Runs ``pipeline`` for every submitted job on a daemon thread.

    Create it, build the pipeline with :meth:`publish` as its delivery's sink, then
    :meth:`start` it.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, pipeline: RebalancePipeline) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(pipeline,), name=f"eplb-movement-{self.rank}", daemon=True
        )
        self._thread.start()

    # -- main thread -----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._inbox.put(job)

    def poll(self) -> list[PublishedLayer | RearrangementFinished]:
        """Everything published since the last poll, in order."""
        items = []
        while True:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                return items

    def stop(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- worker thread -----------------------------------------------------------------------
    def publish(self, item: PublishedLayer) -> None:
        """The pipeline's delivery hands a committed layer to the main thread."""
        self._outbox.put(item)

    def _run(self, pipeline: RebalancePipeline) -> None:
        generation = 0
        while True:
            job = self._inbox.get()
            if job is None:
                return
            generation += 1
            try:
                outcome = pipeline.run(job)
            except Exception:  # never let the thread die: report and wait for the next job
                error = traceback.format_exc(limit=3)
                logger.error("EPLB movement worker failed unexpectedly:\n%s", error)
                outcome = pipeline.record_failure(error)
            self._outbox.put(
                RearrangementFinished(
                    generation, outcome.ok, outcome.error, outcome.layers_delivered
                )
            )

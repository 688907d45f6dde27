"""The movement worker: one thread per rank that runs rearrangements off the serving path.

It is the job loop. Closed windows and explicit plans arrive in order (every rank's main thread
submits the same sequence, each item stamped with the serving step it was submitted at), and the
worker runs them through the rebalance pipeline (``rebalance``), whose asynchronous delivery
publishes staged layers into this worker's outbox, followed by the job's end marker. The main
thread's commit scheduler drains the outbox between graph replays.

**Coalescing.** A rearrangement can take longer than a window interval (it commits layer by
layer at agreed steps), so windows can pile up. An old window is worth nothing once a newer one
exists (the newer one holds the most recent load), so a backlog of windows is one job: the newest
window. Which windows a job consumes must be the same on every rank (the job counter names every
store decision and every collective), and ranks need not be at the same step when they ask. So
each job starts with a decision ``job/<k>``: every rank proposes the step of the newest window it
holds (or, when an explicit plan is next, that plan's step), the coordinator decides the
*largest* window step ``D``, and every rank plans on window ``D`` and consumes every window up to
it. A rank that does not hold window ``D`` yet waits for its main thread to close it (every rank
closes the same windows, in the same order); a rank that holds it copies its rows before it
votes, so the window's buffer, reused two closes later, cannot be torn while slower ranks catch
up. Every rank thus reduces the same window, and the planners' histories stay equal. Explicit
plans are never coalesced.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import deque
from dataclasses import replace

import torch

from eplb_graph.control.window import WindowSnapshot
from eplb_graph.movement.commit import PublishedLayer, RearrangementFinished
from eplb_graph.movement.rebalance import Job, PlanJob, RebalancePipeline
from eplb_graph.movement.transport import StoreAgreement

logger = logging.getLogger(__name__)

_WINDOW, _PLAN = 0, 1  # job kinds, as voted


class MovementWorker:
    """Runs ``pipeline`` for every agreed job on a daemon thread.

    Create it, build the pipeline with :meth:`publish` as its delivery's sink, then
    :meth:`start` it.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.windows_coalesced = 0  # windows consumed by a job that planned on a newer one
        self.job_rounds_failed = 0  # job decisions that did not agree (retried)
        self.windows_stood_in = 0  # this rank's share came from a newer window (see below)
        self._stop_requested = False

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
        pending: deque[Job] = deque()
        job_round = 0
        while True:
            if not self._receive(pending):
                return
            job_round += 1
            try:
                taken = self._agree_next_job(pipeline.agreement, pending, job_round)
            except Exception as failure:  # no decision (a silent coordinator): ask again
                self.job_rounds_failed += 1
                logger.warning("EPLB job round %d: %s", job_round, failure)
                continue
            if taken is None:
                continue
            job, consumed = taken
            try:
                outcome = pipeline.run(job)
            except Exception:  # never let the thread die: report and wait for the next job
                error = traceback.format_exc(limit=3)
                logger.error("EPLB movement worker failed unexpectedly:\n%s", error)
                outcome = pipeline.record_failure(error)
            self._outbox.put(
                RearrangementFinished(
                    outcome.ok,
                    outcome.error,
                    outcome.layers_delivered,
                    consumed,
                    pipeline.moves_started,
                )
            )

    def _receive(self, pending: deque[Job]) -> bool:
        """Wait for at least one job, then take everything queued; False when stopped."""
        if self._stop_requested:
            return False
        if not pending:
            item = self._inbox.get()
            if item is None:
                return False
            pending.append(item)
        return self._take_queued(pending)

    def _take_queued(self, pending: deque[Job]) -> bool:
        """Move every queued item to ``pending`` without waiting; False when stopped."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                self._stop_requested = True
                return False
            pending.append(item)

    def _agree_next_job(
        self, agreement: StoreAgreement, pending: deque[Job], job_round: int
    ) -> tuple[Job, int] | None:
        """Decide with every rank which items the next job consumes (see the module docstring);
        returns ``(job, items consumed)``, or ``None`` to ask again (or when stopping)."""
        head = pending[0]
        rows = None
        if isinstance(head, PlanJob):
            kind, step = _PLAN, head.step
        else:
            newest = _leading_windows(pending)[-1]
            rows = newest.copy_rows()  # before voting: see the module docstring
            kind, step = _WINDOW, newest.step
        decision = agreement.decide(f"job/{job_round}", ok=True, proposal=step, digest=kind)
        if not decision.commit:
            self.job_rounds_failed += 1
            logger.warning("EPLB job round %d not agreed: %s", job_round, decision.reason)
            return None
        if kind == _PLAN:
            return pending.popleft(), 1
        target = self._await_window(pending, decision.step)
        if target is None:
            return None
        if target.step != step:  # it arrived after the vote: it is this rank's newest
            rows = target.copy_rows()
        if rows is None:
            taken = self._newer_stand_in(pending, target)
            if taken is None:
                return None
            target, rows = taken
        consumed = 0
        while pending and isinstance(pending[0], WindowSnapshot):
            if pending[0].step > decision.step:
                break
            pending.popleft()
            consumed += 1
        self.windows_coalesced += consumed - 1
        return replace(target, host_rows=rows), consumed

    def _newer_stand_in(
        self, pending: deque[Job], target: WindowSnapshot
    ) -> tuple[WindowSnapshot, torch.Tensor | None] | None:
        """This rank's share of window ``target`` was overwritten (its buffer is reused two
        closes later, and this thread was descheduled that long): stand in this rank's newest
        window for it, labelled with ``target``'s step.

        The reduction sums every rank's share, so all ranks still plan on one identical load
        (this rank's part of it is just more recent) and the planners' histories stay equal;
        aborting instead would throw away the whole job, and under windows that close every
        step would abort every job. The stand-in must have as many rows as the target (only
        the first windows of a run, before the ring is full, differ): the collective's size
        depends on it. ``(target, None)``: no stand-in, the job fails as "worker late";
        ``None``: stopping.
        """
        while True:
            if not self._take_queued(pending):
                return None
            newest = _leading_windows(pending)[-1]
            rows = newest.copy_rows()
            if rows is None:
                continue  # overwritten again while copying: newer windows are queued
            if rows.shape[0] != target.rows.shape[0]:
                return target, None
            self.windows_stood_in += 1
            return replace(newest, step=target.step), rows

    def _await_window(self, pending: deque[Job], step: int) -> WindowSnapshot | None:
        """Wait until the window closed at ``step`` is queued; ``None`` when stopping."""
        while True:
            for job in _leading_windows(pending):
                if job.step == step:
                    return job
            if not any(isinstance(job, PlanJob) for job in pending):
                item = self._inbox.get()
                if item is None:
                    self._stop_requested = True
                    return None
                pending.append(item)
                if not self._take_queued(pending):
                    return None
                continue
            raise RuntimeError(
                f"window {step} was agreed but this rank queued an explicit plan before it: "
                "the ranks submitted different jobs"
            )


def _leading_windows(pending: deque[Job]) -> list[WindowSnapshot]:
    """The windows queued before the first explicit plan, oldest first."""
    windows = []
    for job in pending:
        if not isinstance(job, WindowSnapshot):
            break
        windows.append(job)
    return windows

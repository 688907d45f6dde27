"""The main thread's step counter, shared with the movement worker, and the commit fence.

All ranks must switch a layer's routing at the same step. The worker agrees on that step with
its peers (an all-reduce of proposals) while the main thread keeps serving. The fence makes the
agreement safe under every interleaving without a collective on the main thread:

1. the worker, under the clock's lock, raises a fence at ``F = current step + margin``;
2. it all-reduces (MAX) its fence with the peers' fences: the agreed step ``S >= F``;
3. it publishes the layers with commit step ``S`` and lowers the fence.

The main thread may not *start* step ``F`` while the fence is up (it waits, bounded), so it can
never run past ``S`` without having the published layers in hand. With a margin of a few steps
the wait never happens in practice: agreement is one small all-reduce.
"""

from __future__ import annotations

import threading
import time


class StepClock:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._step = 0
        self._fence: int | None = None
        self.fence_waits = 0
        self.fence_wait_seconds = 0.0

    @property
    def step(self) -> int:
        return self._step

    # -- main thread ---------------------------------------------------------------------------
    def enter_step(self, timeout_s: float) -> bool:
        """Before serving the current step: wait while a raised fence covers it.

        Returns False if the fence was not lowered within ``timeout_s`` (the caller then treats
        the rearrangement as failed on this rank and reports it).
        """
        with self._condition:
            if self._fence is None or self._step < self._fence:
                return True
            self.fence_waits += 1
            started = time.perf_counter()
            lowered = self._condition.wait_for(
                lambda: self._fence is None or self._step < self._fence, timeout=timeout_s
            )
            self.fence_wait_seconds += time.perf_counter() - started
            return lowered

    def advance(self) -> None:
        with self._condition:
            self._step += 1

    # -- worker --------------------------------------------------------------------------------
    def raise_fence(self, margin: int) -> int:
        """Fence the main thread at ``current step + margin``; returns the fence step."""
        if margin < 1:
            raise ValueError(f"commit margin must be >= 1 step, got {margin}")
        with self._condition:
            self._fence = self._step + margin
            return self._fence

    def lower_fence(self) -> None:
        with self._condition:
            self._fence = None
            self._condition.notify_all()

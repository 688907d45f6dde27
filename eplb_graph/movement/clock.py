"""The main thread's step counter, shared with the movement worker, and the commit fence.

All ranks must switch a layer's routing at the same step. The worker proposes a step and the
ranks' decision (``agreement``) fixes it while the main thread keeps serving:

1. the worker, under the clock's lock, raises a fence at ``F = current step + margin`` tagged
   with the decision's key, and votes with ``F`` as its proposal;
2. the decided commit step is ``S = max(F over ranks) >= F``;
3. the worker publishes the layers for step ``S`` and lowers the fence.

When serving reaches ``F`` with the fence still up, the main thread resolves the decision itself
instead of waiting for peers: it writes a veto unless a decision already exists (first writer
wins in the store). If the decision that stands is "commit", its own worker is about to publish
(it reads the same key), and the main thread waits for that local hand-over only. So the main
thread never runs past ``S`` without the layers, and never waits on a slow or stuck peer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


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

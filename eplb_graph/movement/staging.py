"""Staging memory for weight movement, and the two ends of it: packing sources, installing.

Staging memory is allocated once and handed between threads by ownership.

A :class:`StagingBlock` holds one layer's traffic on this rank: the packed payloads of every
local slot that must be read before anything is written (sources of sends and local copies), and
the payloads received from peers. Blocks are sized once, at start-up, for the worst case of one
layer (``slots_per_rank`` reads and ``slots_per_rank`` receives), so rearrangements never
allocate and the memory bound is known up front.

Ownership is explicit (invariant 6): the worker acquires a FREE block, fills it (STAGING),
publishes it (PUBLISHED); only the main thread's commit scheduler, after it has installed the
weights and refreshed the lookup, releases it back to FREE. The worker can therefore never
overwrite memory the main thread has not consumed yet.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

import torch

from eplb_graph.errors import EplbError
from eplb_graph.movement.planner import RankPlan
from eplb_graph.state import EplbState, PreparedLayer


class BlockState(enum.Enum):
    FREE = "free"
    STAGING = "staging"
    PUBLISHED = "published"


class StagingOwnershipError(EplbError, RuntimeError):
    """A block was used out of order (a bug: would break invariant 6)."""


class StagingBudgetError(EplbError, ValueError):
    """The staging blocks would take more memory than ``RuntimeSettings.staging_budget_bytes``.

    Raised at start-up, before anything is allocated. ``needed`` and ``budget`` are bytes;
    ``blocks``, ``slots_per_rank`` and ``slot_nbytes`` say where ``needed`` comes from, so an
    integration can reword the fix in its own setting names.
    """

    def __init__(
        self, needed: int, budget: int, blocks: int, slots_per_rank: int, slot_nbytes: int
    ) -> None:
        super().__init__(
            f"staging_budget_bytes: the staging memory needs {needed} bytes "
            f"({blocks} blocks x 2 x {slots_per_rank} slots x {slot_nbytes} bytes per expert), "
            f"more than the budget of {budget} bytes; lower layers_per_step or staging_blocks, "
            f"or raise staging_budget_bytes to at least {needed}"
        )
        self.needed = needed
        self.budget = budget
        self.blocks = blocks
        self.slots_per_rank = slots_per_rank
        self.slot_nbytes = slot_nbytes

    def __reduce__(self):
        return type(self), (
            self.needed,
            self.budget,
            self.blocks,
            self.slots_per_rank,
            self.slot_nbytes,
        )


def check_staging_budget(
    num_blocks: int, slots_per_rank: int, slot_nbytes: int, budget: int
) -> int:
    """The bytes ``num_blocks`` blocks take (reads + receives of every local slot per block).

    Raises:
        StagingBudgetError: when that is more than ``budget`` bytes.
    """
    needed = num_blocks * 2 * slots_per_rank * slot_nbytes
    if needed > budget:
        raise StagingBudgetError(needed, budget, num_blocks, slots_per_rank, slot_nbytes)
    return needed


class StagingBlock:
    """One layer's staging buffers (CPU, pinned when a CUDA device exists)."""

    def __init__(self, index: int, slots: int, slot_nbytes: int, pin: bool) -> None:
        self.index = index
        self.reads = torch.empty(slots, slot_nbytes, dtype=torch.uint8, pin_memory=pin)
        self.receives = torch.empty(slots, slot_nbytes, dtype=torch.uint8, pin_memory=pin)
        self.state = BlockState.FREE
        self.layer: int | None = None
        self.read_rows: dict[int, int] = {}  # local slot -> row of ``reads``

    @property
    def nbytes(self) -> int:
        return self.reads.numel() + self.receives.numel()


class StagingPool:
    """A fixed set of :class:`StagingBlock` passed from the worker to the main thread and back.

    Args:
        num_blocks: layers that may be staged ahead of their commit (>= layers committed per
            step; one more lets the worker stage the next layer while the main thread commits).
        slots_per_rank: local slots of one layer (worst-case reads and receives).
        slot_nbytes: packed payload size of one expert (all coupled tensors).
        pin: pin the buffers (only meaningful with a CUDA/NPU device to copy to).
    """

    def __init__(
        self, num_blocks: int, slots_per_rank: int, slot_nbytes: int, *, pin: bool | None = None
    ) -> None:
        if num_blocks < 1 or slots_per_rank < 1 or slot_nbytes < 1:
            raise ValueError(
                "staging needs num_blocks, slots_per_rank and slot_nbytes >= 1, got "
                f"{num_blocks}, {slots_per_rank}, {slot_nbytes}"
            )
        if pin is None:
            pin = torch.cuda.is_available()
        self.blocks = [StagingBlock(i, slots_per_rank, slot_nbytes, pin) for i in range(num_blocks)]
        self._condition = threading.Condition()
        self._closed = False

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)

    def acquire(self, layer: int, timeout: float | None = None) -> StagingBlock | None:
        """Worker: take a FREE block for ``layer``; waits for the main thread to release one.

        Returns ``None`` on timeout (the caller decides whether that aborts the rearrangement).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while True:
                for block in self.blocks:
                    if block.state is BlockState.FREE:
                        block.state = BlockState.STAGING
                        block.layer = layer
                        block.read_rows = {}
                        return block
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    return None
                self._condition.wait(remaining)

    def publish(self, block: StagingBlock) -> None:
        """Worker: the block's data is complete; from now on only the main thread touches it."""
        with self._condition:
            if block.state is not BlockState.STAGING:
                raise StagingOwnershipError(f"publish of block {block.index} in {block.state}")
            block.state = BlockState.PUBLISHED

    def release(self, block: StagingBlock) -> None:
        """Main thread (after commit + lookup refresh), or the worker on abort of its own block."""
        with self._condition:
            if block.state is BlockState.FREE:
                raise StagingOwnershipError(f"double release of block {block.index}")
            block.state = BlockState.FREE
            block.layer = None
            self._condition.notify_all()

    def wait_all_free(self, timeout: float | None = None) -> bool:
        """Worker: wait until the main thread has installed and released every block (``False``
        on timeout, or at once when the pool is closed: no main thread will install any more)."""

        def free() -> bool:
            return all(block.state is BlockState.FREE for block in self.blocks)

        with self._condition:
            self._condition.wait_for(lambda: free() or self._closed, timeout)
            return free()

    def close(self) -> None:
        """Main thread, at shutdown: serving has stopped, so nothing published will be installed
        again; a worker waiting for a block or for installs gives up now (its job aborts) instead
        of waiting out its timeout, and the worker thread can stop."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def states(self) -> list[BlockState]:
        with self._condition:
            return [block.state for block in self.blocks]


def stage_reads_(view, rank_plan: RankPlan, block: StagingBlock) -> None:
    """Pack every slot this rank must read (send and local-copy sources) into ``block.reads``.

    Runs before any destination is written (the main thread writes only at commit), so swaps and
    cycles inside a rank read their old values.
    """
    block.read_rows = {}
    for row, slot in enumerate(rank_plan.staged_reads):
        view.pack_slot(slot, block.reads[row])
        block.read_rows[slot] = row


def install_layer_(view, rank_plan: RankPlan, block: StagingBlock) -> int:
    """At commit: write received and locally copied payloads into the live storage.

    Returns the number of slots written. Unchanged slots are never touched.
    """
    written = 0
    for row, receive in enumerate(rank_plan.receives):
        for slot in receive.dst_slots:
            view.unpack_slot_(slot, block.receives[row])
            written += 1
    for copy in rank_plan.local_copies:
        source = block.reads[block.read_rows[copy.src_slot]]
        for slot in copy.dst_slots:
            view.unpack_slot_(slot, source)
            written += 1
    return written


@dataclass
class InstallStats:
    """What the main thread installed (plain values, for metrics)."""

    layers_committed: int = 0
    slots_written: int = 0
    bytes_installed: int = 0
    commit_seconds: list[float] = field(default_factory=list)  # per layer, main thread


class LayerInstaller:
    """Main thread: installs a staged layer, commits its placement, then frees its block.

    The order is the point (invariant 6): weights first, then the layer's lookup (so a token
    routed by the new lookup finds the new weights), and only then is the staging block released
    to the worker, which may refill it.
    """

    def __init__(self, state: EplbState, views, pool: StagingPool) -> None:
        self.state = state
        self.views = list(views)
        self.pool = pool
        self.stats = InstallStats()

    def install_(
        self, layer: int, rank_plan: RankPlan, block: StagingBlock, prepared: PreparedLayer
    ) -> None:
        started = time.perf_counter()
        written = install_layer_(self.views[layer], rank_plan, block)
        self.state.commit_prepared_(layer, prepared)
        self.pool.release(block)  # only now may the worker reuse this memory
        self.stats.commit_seconds.append(time.perf_counter() - started)
        self.stats.layers_committed += 1
        self.stats.slots_written += written
        self.stats.bytes_installed += written * self.views[layer].slot_nbytes

"""How the ranks reach each other for a rearrangement: decisions through the rendezvous store,
payloads through the gloo groups EPLB owns.

## Decisions every rank acts on identically

Why not an all-reduce on the gloo group: a failure on one rank (a timeout, a local exception)
can leave ranks at different points of the collective sequence. Two ranks then pair different
collectives on the same group: with equal sizes they silently mix up meanings, with different
sizes gloo aborts the process. And "every rank saw all votes" is not itself agreed: a rank whose
wait times out a moment before a late vote arrives would abort while its peers commit.

So each decision is made once, by a coordinator, and read by everyone:

1. every rank writes its vote (``ok``, a proposed step, a digest of its plan) to the store;
2. the coordinator (rank 0) waits for all votes (bounded by ``vote_timeout``) and proposes
   ONE decision: commit at step ``max(proposals)`` iff every vote arrived, said ok and carried
   the same digest; otherwise abort;
3. every rank waits for the decision key and acts on it.

The decision key is written with ``compare_set``: the first writer wins and everyone reads the
winner. Besides the coordinator, a rank's *main thread* may write it: when serving reaches the
rank's fenced step and no decision exists yet (a slow or stuck peer), it writes a veto (abort)
instead of waiting, so serving never blocks on a peer. Whoever wins, every rank acts on the same
value: a rank never decides by itself. Keys are namespaced per runtime instance and per
(generation, phase, chunk), which every rank walks in the same order.

## Payloads: the gloo groups and the point-to-point exchange

Why gloo, through CPU memory: the serving group's device communicator (HCCL/NCCL) is busy with
the forward's all-to-alls and its buffers are sized for them; sharing it risks hangs and memory
spikes (seen upstream). A separate gloo group moves bytes on the host while serving continues.

Deadlock freedom: every rank derives the same global list of transfers from the (global)
:class:`~eplb_graph.movement.planner.TransferPlan`, sorted by ``(expert, dst_rank, src_rank)``,
and cuts it into batches of at most ``max_batch_ops`` transfers. Within a batch each rank posts
all its receives, then all its sends, then waits for them; a batch's sends are always matched by
receives of the same batch, so no rank waits for a peer that waits for it. Bounded batches keep
hundreds of outstanding operations from piling up on one pair.

Failure: a wait that exceeds ``timeout_s`` raises :class:`TransferError`. Gloo closes the pair
on a timeout, so every peer's next operation on this group fails fast too: the group is treated
as suspect: the next job probes it, and all ranks move to the next pre-built group together if
any rank finds it broken (see ``rebalance``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from eplb_graph.errors import EplbError
from eplb_graph.movement.staging import StagingBlock

logger = logging.getLogger(__name__)


# -- decisions through the store ------------------------------------------------------------------
_INSTANCES = itertools.count()


class DecisionTimeout(EplbError, RuntimeError):
    """The coordinator's decision did not arrive in time (the attempt is abandoned)."""


VETO_REASON = "vetoed: fence reached"  # a main thread reached the fence before the decision


@dataclass(frozen=True)
class Decision:
    commit: bool
    step: int  # max proposed step (valid when commit)
    reason: str
    transport_failed: bool = False  # some rank's data group may be broken: all move on alike

    @property
    def vetoed(self) -> bool:
        """Aborted because serving reached the fence before the ranks decided."""
        return not self.commit and self.reason.endswith(VETO_REASON)


def default_store():
    """The store of the default process group (the job's rendezvous store)."""
    return dist.distributed_c10d._get_default_store()


class StoreAgreement:
    """Coordinator-decided votes over a ``torch.distributed`` store.

    Args:
        store: the rendezvous store shared by all ranks.
        rank, world_size: this rank and the number of ranks voting.
        vote_timeout_s: how long the coordinator waits for all votes.
        decision_timeout_s: how long a rank waits for the coordinator's decision.
        namespace: distinguishes runtimes in one job; all ranks must create their agreements in
            the same order (the default counter does that when they construct runtimes alike).
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        *,
        vote_timeout_s: float,
        decision_timeout_s: float,
        namespace: str | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.vote_timeout = timedelta(seconds=vote_timeout_s)
        self.decision_timeout = timedelta(seconds=decision_timeout_s)
        name = namespace if namespace is not None else f"eplb-graph/{next(_INSTANCES)}"
        self.store = dist.PrefixStore(name, store)

    def decide(
        self,
        round_key: str,
        *,
        ok: bool,
        proposal: int = 0,
        digest: int = 0,
        transport_failed: bool = False,
    ) -> Decision:
        """Vote in round ``round_key`` and return the decision for it (identical on all ranks).

        ``transport_failed``: this rank saw its data group fail (a timeout, a closed pair); the
        decision then tells every rank to leave that group, so all ranks switch together.
        """
        vote = f"{int(ok)},{proposal},{digest},{int(transport_failed)}"
        self.store.set(f"{round_key}/vote/{self.rank}", vote)
        if self.rank == 0:
            self._propose(round_key, self._coordinate(round_key))
        try:
            self.store.wait([f"{round_key}/decision"], self.decision_timeout)
        except Exception as error:
            raise DecisionTimeout(
                f"no EPLB decision for {round_key} within {self.decision_timeout}: {error}"
            ) from error
        return _parse(self.store.get(f"{round_key}/decision"))

    def veto(self, round_key: str) -> Decision:
        """Main thread at its fence: abort the round unless a decision already exists; returns
        the decision that stands (the veto, or the earlier commit/abort)."""
        return _parse(self._propose(round_key, f"0,-1,0,rank {self.rank} {VETO_REASON}"))

    def _propose(self, round_key: str, value: str) -> bytes:
        return self.store.compare_set(f"{round_key}/decision", "", value)

    def _coordinate(self, round_key: str) -> str:
        keys = [f"{round_key}/vote/{rank}" for rank in range(self.world_size)]
        try:
            self.store.wait(keys, self.vote_timeout)
        except Exception:
            missing = [k.rsplit("/", 1)[1] for k in keys if not self.store.check([k])]
            # A silent rank may be stuck mid-exchange: treat its group as broken.
            return f"0,-1,1,ranks {missing} did not vote within {self.vote_timeout}"
        votes = [self.store.get(key).decode().split(",") for key in keys]
        transport = int(any(vote[3] == "1" for vote in votes))
        failed = [rank for rank, vote in enumerate(votes) if vote[0] != "1"]
        if failed:
            return f"0,-1,{transport},ranks {failed} voted abort"
        if len({vote[2] for vote in votes}) != 1:
            return f"0,-1,{transport},ranks planned different placements"
        return f"1,{max(int(vote[1]) for vote in votes)},{transport},ok"


def _parse(raw: bytes) -> Decision:
    commit, step, transport, reason = raw.decode().split(",", 3)
    return Decision(commit == "1", int(step), reason, transport == "1")


# -- payloads through gloo -------------------------------------------------------------------------
class TransferError(EplbError, RuntimeError):
    """A point-to-point exchange failed or timed out (the rearrangement must abort)."""


@dataclass(frozen=True)
class Transfer:
    """One expert copy crossing ranks: ``src_rank`` sends, ``dst_rank`` receives."""

    expert: int
    src_rank: int
    dst_rank: int


def global_transfers(plan) -> list[Transfer]:
    """All cross-rank copies of ``plan`` in the order every rank agrees on."""
    transfers = [
        Transfer(send.expert, rank_plan.rank, send.dst_rank)
        for rank_plan in plan.ranks
        for send in rank_plan.sends
    ]
    return sorted(transfers, key=lambda t: (t.expert, t.dst_rank, t.src_rank))


def exchange_tag(layer: int) -> int:
    """The first point-to-point tag of ``layer``'s exchange: distinct layers use far-apart tag
    ranges, so a straggling message of one layer can never match a receive of another."""
    return layer * 1_000_003 % (1 << 30)


def probe_group(group, timeout_s: float) -> bool:
    """A one-element all-reduce: does ``group`` still connect every rank?"""
    try:
        probe = torch.ones(1)
        work = dist.all_reduce(probe, group=group, async_op=True)
        work.wait(timedelta(seconds=timeout_s))
        return True
    except Exception as failure:
        logger.warning("EPLB movement group probe failed: %s", failure)
        return False


class GlooStagedCommunicator:
    """Exchanges one layer's payloads between this rank's staging block and its peers'.

    Args:
        group: the dedicated gloo process group (never the serving group).
        rank: this rank's index in ``group``.
        max_batch_ops: transfers per batch across the whole group (bounded outstanding ops).
        timeout_s: per-batch wait limit; exceeding it raises :class:`TransferError`.
    """

    def __init__(self, group, rank: int, *, max_batch_ops: int = 32, timeout_s: float = 30.0):
        if max_batch_ops < 1:
            raise ValueError(f"max_batch_ops must be >= 1, got {max_batch_ops}")
        self.group = group
        self.rank = rank
        self.max_batch_ops = max_batch_ops
        self.timeout = timedelta(seconds=timeout_s)
        self.bytes_sent = 0
        self.bytes_received = 0

    def exchange(self, plan, block: StagingBlock, *, layer: int) -> None:
        """Send ``layer``'s staged sources to peers and receive into ``block.receives`` (row =
        receive index in ``plan.ranks[rank].receives``)."""
        tag_base = exchange_tag(layer)
        rank_plan = plan.ranks[self.rank]
        receive_row = {(r.src_rank, r.expert): row for row, r in enumerate(rank_plan.receives)}
        send_slot = {(s.dst_rank, s.expert): s.src_slot for s in rank_plan.sends}
        transfers = global_transfers(plan)
        for start in range(0, len(transfers), self.max_batch_ops):
            batch = transfers[start : start + self.max_batch_ops]
            works = []
            try:
                for index, transfer in enumerate(batch, start):
                    if transfer.dst_rank == self.rank:
                        row = receive_row[(transfer.src_rank, transfer.expert)]
                        works.append(
                            dist.irecv(
                                block.receives[row],
                                src=transfer.src_rank,
                                group=self.group,
                                tag=tag_base + index,
                            )
                        )
                        self.bytes_received += block.receives[row].numel()
                for index, transfer in enumerate(batch, start):
                    if transfer.src_rank == self.rank:
                        slot = send_slot[(transfer.dst_rank, transfer.expert)]
                        payload = block.reads[block.read_rows[slot]]
                        works.append(
                            dist.isend(
                                payload,
                                dst=transfer.dst_rank,
                                group=self.group,
                                tag=tag_base + index,
                            )
                        )
                        self.bytes_sent += payload.numel()
                for work in works:
                    work.wait(self.timeout)
            except Exception as error:
                # Never hand a buffer back while an operation may still write into it: wait for
                # every outstanding op to complete or fail (gloo bounds this by its timeout).
                for work in works:
                    with contextlib.suppress(Exception):
                        work.wait(self.timeout)
                raise TransferError(
                    f"rank {self.rank}: exchange batch {start // self.max_batch_ops} failed: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                ) from error


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
            dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
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

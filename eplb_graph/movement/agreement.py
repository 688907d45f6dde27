"""Decisions every rank acts on identically, through the rendezvous store, not the data group.

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
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from eplb_graph.errors import EplbError

logger = logging.getLogger(__name__)

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

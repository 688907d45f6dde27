"""Hazard-free transfer plans: which expert copies cross ranks, which are local, in what order.

A plan is pure data computed from one layer's old and new ``phy2log`` rows. Every rank computes
the same plan from the same inputs (no randomness, no rank-local state), so all ranks agree on
every send, receive and its order without exchanging anything.

Rules (each pinned by ``tests/test_movement_planner.py``):

- A slot whose expert does not change is never read for itself and never written.
- An expert the destination rank already holds in the OLD placement is copied locally
  (:class:`LocalCopy`, source = its first old slot on that rank), never received.
- A remote expert is received ONCE per destination rank; every slot of that rank that needs it is
  served from that one payload (``Receive.dst_slots``; the first gets the wire bytes).
- Sender choice: ``(expert, destination rank)`` copies are assigned most constrained first (fewest
  holders, then ascending ``(expert, rank)``), each to the rank holding the expert in the old
  placement with the fewest sends assigned so far in this layer; ties are broken round-robin,
  starting at holder index
  ``(expert + destination) % len(holders)``. Sends carry equal bytes within a layer, so this
  balances egress over the holders instead of draining the first replica. The source slot on the
  sender is its first old slot holding the expert.
- Order: sends sorted by ``(expert, dst_rank)``, receives by ``(expert, src_rank)``, local copies
  by ``expert``. Between any two ranks the sender's sends to the receiver and the receiver's
  receives from the sender list the same experts in the same order.
- Hazards: every source slot (of a send or a local copy) is read into staging before ANY
  destination slot on its rank is written (``RankPlan.staged_reads``), so swaps and cycles of
  slots inside a rank, and slots that are both a source and a destination, are safe. This is the
  SGLang lesson (temporary buffers so a swap never overwrites a source) made a property of the
  plan rather than of the executor.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from eplb_graph.errors import EplbError
from eplb_graph.tables import check_slots_per_rank

logger = logging.getLogger(__name__)


class TransferPlanError(EplbError, ValueError):
    """Inputs of :func:`plan_transfer` (or :meth:`TransferPlan.execute_local`) are malformed."""


@dataclass(frozen=True)
class Receive:
    """This rank receives ``expert`` from ``src_rank`` once, for local slots ``dst_slots``.

    ``dst_slots`` is ascending; the first gets the bytes from the wire, the others are local
    copies of the same payload after it arrived.
    """

    src_rank: int
    expert: int
    dst_slots: tuple[int, ...]


@dataclass(frozen=True)
class Send:
    """This rank sends ``expert`` (read from its local slot ``src_slot``) to ``dst_rank``."""

    dst_rank: int
    expert: int
    src_slot: int


@dataclass(frozen=True)
class LocalCopy:
    """``expert`` is already on this rank (old slot ``src_slot``); copy it into ``dst_slots``."""

    expert: int
    src_slot: int
    dst_slots: tuple[int, ...]


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a :class:`TransferPlan`; slots are local indices on this rank."""

    rank: int
    sends: tuple[Send, ...]
    receives: tuple[Receive, ...]
    local_copies: tuple[LocalCopy, ...]

    @property
    def staged_reads(self) -> tuple[int, ...]:
        """Local slots to read into staging before ANY write on this rank (ascending)."""
        sources = {send.src_slot for send in self.sends}
        sources.update(copy.src_slot for copy in self.local_copies)
        return tuple(sorted(sources))

    @property
    def written_slots(self) -> tuple[int, ...]:
        """Local slots this rank writes (ascending): exactly its changed slots."""
        slots = [slot for receive in self.receives for slot in receive.dst_slots]
        slots += [slot for copy in self.local_copies for slot in copy.dst_slots]
        return tuple(sorted(slots))


@dataclass(frozen=True)
class TraceEvent:
    """One step of :meth:`TransferPlan.execute_local`, reported to its ``trace`` callback.

    ``kind``: ``"read"`` (a live source slot copied into staging), ``"send"`` (a staged payload
    put on the wire), ``"recv"`` (a payload taken off the wire), ``"write"`` (a live destination
    slot overwritten). ``slot`` is the local live slot read or written, the staged source slot of
    a send, or the first destination slot of a receive; ``peer`` is the other rank of a send or
    receive (``None`` otherwise).
    """

    kind: str
    rank: int
    slot: int
    expert: int
    peer: int | None = None


Trace = Callable[[TraceEvent], None]


@dataclass(frozen=True)
class TransferPlan:
    """The movement of one MoE layer from ``old`` to ``new`` placement, for every rank.

    Attributes:
        num_ranks: EP ranks; global slot ``p`` is local slot ``p % slots_per_rank`` of rank
            ``p // slots_per_rank``.
        slots_per_rank: local slots per rank.
        old: ``[P]`` old ``phy2log`` row; new: ``[P]`` new ``phy2log`` row.
        ranks: one :class:`RankPlan` per rank, indexed by rank.
    """

    num_ranks: int
    slots_per_rank: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    ranks: tuple[RankPlan, ...]

    @property
    def num_receives(self) -> int:
        """Expert copies that cross ranks (one per ``(expert, destination rank)`` pair)."""
        return sum(len(rank.receives) for rank in self.ranks)

    @property
    def num_local_copies(self) -> int:
        """``(expert, rank)`` pairs served from an old slot on the same rank."""
        return sum(len(rank.local_copies) for rank in self.ranks)

    @property
    def is_noop(self) -> bool:
        """True when no slot changes expert (nothing to stage, send or write)."""
        return self.old == self.new

    def changed_slots(self) -> list[int]:
        """Global slots whose expert changes, ascending."""
        return [
            slot
            for slot, (old, new) in enumerate(zip(self.old, self.new, strict=True))
            if old != new
        ]

    def execute_local(
        self, weights_per_rank: Sequence[torch.Tensor], trace: Trace | None = None
    ) -> None:
        """Apply the plan in-process to ``weights_per_rank`` (one ``[slots_per_rank, ...]`` tensor
        per rank, same trailing shape and dtype), exactly as the distributed path does.

        Phase 1: every rank reads each of its ``staged_reads`` slots into scratch. Phase 2: each
        send's scratch payload is delivered to the matching receive (pairing is checked). Phase
        3: every destination slot is written (``copy_``, in place) from its receive payload or
        local-copy scratch. Unchanged slots are never written; no slot is written before all
        reads of its rank. ``trace`` (optional) receives a :class:`TraceEvent` per step.

        Raises:
            TransferPlanError: before anything is read or written, if the tensors do not fit.
        """
        self._check_weights(weights_per_rank)
        emit = trace if trace is not None else _no_trace
        scratch: list[dict[int, torch.Tensor]] = []
        with torch.no_grad():
            for rank_plan in self.ranks:  # phase 1: stage every source before any write
                staged = {}
                for slot in rank_plan.staged_reads:
                    staged[slot] = weights_per_rank[rank_plan.rank][slot].clone()
                    emit(
                        TraceEvent("read", rank_plan.rank, slot, self._old_expert(rank_plan, slot))
                    )
                scratch.append(staged)
            wire: dict[tuple[int, int, int], torch.Tensor] = {}
            for rank_plan in self.ranks:  # phase 2: exchange
                for send in rank_plan.sends:
                    wire[(rank_plan.rank, send.dst_rank, send.expert)] = scratch[rank_plan.rank][
                        send.src_slot
                    ]
                    emit(
                        TraceEvent(
                            "send", rank_plan.rank, send.src_slot, send.expert, send.dst_rank
                        )
                    )
            inbox: list[list[tuple[Receive, torch.Tensor]]] = []
            for rank_plan in self.ranks:
                arrived = []
                for receive in rank_plan.receives:
                    key = (receive.src_rank, rank_plan.rank, receive.expert)
                    if key not in wire:
                        raise RuntimeError(f"plan is inconsistent: no send matches {receive}")
                    arrived.append((receive, wire.pop(key)))
                    emit(
                        TraceEvent(
                            "recv",
                            rank_plan.rank,
                            receive.dst_slots[0],
                            receive.expert,
                            receive.src_rank,
                        )
                    )
                inbox.append(arrived)
            if wire:
                raise RuntimeError(f"plan is inconsistent: unreceived sends {sorted(wire)}")
            for rank_plan in self.ranks:  # phase 3: write destinations in place
                live = weights_per_rank[rank_plan.rank]
                for receive, payload in inbox[rank_plan.rank]:
                    for slot in receive.dst_slots:
                        live[slot].copy_(payload)
                        emit(TraceEvent("write", rank_plan.rank, slot, receive.expert))
                for copy in rank_plan.local_copies:
                    for slot in copy.dst_slots:
                        live[slot].copy_(scratch[rank_plan.rank][copy.src_slot])
                        emit(TraceEvent("write", rank_plan.rank, slot, copy.expert))

    def _old_expert(self, rank_plan: RankPlan, slot: int) -> int:
        return self.old[rank_plan.rank * self.slots_per_rank + slot]

    def _check_weights(self, weights_per_rank: Sequence[torch.Tensor]) -> None:
        if isinstance(weights_per_rank, torch.Tensor) or not isinstance(weights_per_rank, Sequence):
            raise TransferPlanError(
                "weights_per_rank must be a list with one tensor per rank, got "
                f"{type(weights_per_rank).__name__}"
            )
        if len(weights_per_rank) != self.num_ranks:
            raise TransferPlanError(
                f"weights_per_rank has {len(weights_per_rank)} tensors for {self.num_ranks} ranks"
            )
        first = None
        for rank, weights in enumerate(weights_per_rank):
            if not isinstance(weights, torch.Tensor):
                raise TransferPlanError(f"rank {rank}: expected a tensor, got {type(weights)}")
            if weights.dim() < 1 or weights.shape[0] != self.slots_per_rank:
                raise TransferPlanError(
                    f"rank {rank}: weights must be [slots_per_rank={self.slots_per_rank}, ...], "
                    f"got shape {tuple(weights.shape)}"
                )
            if first is None:
                first = weights
            elif weights.shape != first.shape or weights.dtype != first.dtype:
                raise TransferPlanError(
                    f"rank {rank}: weights {tuple(weights.shape)} {weights.dtype} differ from "
                    f"rank 0's {tuple(first.shape)} {first.dtype}; a slot payload has one size"
                )


def _no_trace(event: TraceEvent) -> None:
    return None


def _as_row(name: str, row: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    """A 1-D non-empty integer row as a tuple of Python ints (never flattened from 2-D)."""
    try:
        tensor = torch.as_tensor(row).detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TransferPlanError(f"{name} is not an integer array: {error}") from error
    if tensor.dim() != 1:
        raise TransferPlanError(f"{name} must be 1-D [P], got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise TransferPlanError(f"{name} is empty: a layer has at least one slot")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TransferPlanError(f"{name} must hold integer expert ids, got dtype {tensor.dtype}")
    values = tuple(int(value) for value in tensor.cpu().tolist())
    negative = next((slot for slot, value in enumerate(values) if value < 0), None)
    if negative is not None:
        raise TransferPlanError(
            f"{name}: slot {negative} holds expert id {values[negative]}; ids must be >= 0"
        )
    return values


def plan_transfer(
    old_phy2log_row: torch.Tensor | Sequence[int],
    new_phy2log_row: torch.Tensor | Sequence[int],
    num_ranks: int,
) -> TransferPlan:
    """Plan the movement of one layer from ``old_phy2log_row [P]`` to ``new_phy2log_row [P]``.

    Args:
        old_phy2log_row: ``[P]`` integer expert id per global slot, currently installed.
        new_phy2log_row: ``[P]`` integer expert id per global slot, to install.
        num_ranks: EP ranks; ``P % num_ranks == 0``.

    Returns:
        The same :class:`TransferPlan` on every rank (see the module docstring for the rules).

    Raises:
        TransferPlanError: rows not 1-D integer, of different lengths, ``P`` not divisible by
            ``num_ranks``, negative ids, or an expert of the new row absent from the old row
            (nothing to copy it from).
    """
    old = _as_row("old_phy2log_row", old_phy2log_row)
    new = _as_row("new_phy2log_row", new_phy2log_row)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise TransferPlanError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if len(old) != len(new):
        raise TransferPlanError(
            f"old row has {len(old)} slots but new row has {len(new)}; the slot count is fixed"
        )
    slots_per_rank = check_slots_per_rank(len(old), num_ranks, error=TransferPlanError)

    first_old_slot: dict[tuple[int, int], int] = {}  # (rank, expert) -> first local slot
    for slot, expert in enumerate(old):
        first_old_slot.setdefault((slot // slots_per_rank, expert), slot % slots_per_rank)
    holders: dict[int, list[int]] = defaultdict(list)  # expert -> ascending ranks holding it
    for rank, expert in first_old_slot:
        holders[expert].append(rank)

    needs: dict[tuple[int, int], list[int]] = defaultdict(list)  # (expert, rank) -> dst slots
    for slot, (was, becomes) in enumerate(zip(old, new, strict=True)):
        if was != becomes:
            if becomes not in holders:
                raise TransferPlanError(
                    f"new row puts expert {becomes} in slot {slot}, but no slot holds it in the "
                    "old row: there is no source to copy its weights from"
                )
            needs[(becomes, slot // slots_per_rank)].append(slot % slots_per_rank)

    sends: list[list[Send]] = [[] for _ in range(num_ranks)]
    receives: list[list[Receive]] = [[] for _ in range(num_ranks)]
    local_copies: list[list[LocalCopy]] = [[] for _ in range(num_ranks)]
    sends_assigned = [0] * num_ranks
    remote: list[tuple[int, int]] = []
    for expert, rank in sorted(needs):
        dst_slots = tuple(needs[(expert, rank)])
        local_source = first_old_slot.get((rank, expert))
        if local_source is not None:
            local_copies[rank].append(LocalCopy(expert, local_source, dst_slots))
        else:
            remote.append((expert, rank))
    # Most constrained first: a copy that only one rank can send is assigned before copies with
    # a choice, so the choices can steer around the forced senders (lower busiest-sender load).
    remote.sort(key=lambda need: (len(holders[need[0]]), need))
    for expert, rank in remote:
        dst_slots = tuple(needs[(expert, rank)])
        sender = _choose_sender(holders[expert], expert, rank, sends_assigned)
        sends_assigned[sender] += 1
        sends[sender].append(Send(rank, expert, first_old_slot[(sender, expert)]))
        receives[rank].append(Receive(sender, expert, dst_slots))

    plan = TransferPlan(
        num_ranks=num_ranks,
        slots_per_rank=slots_per_rank,
        old=old,
        new=new,
        ranks=tuple(
            RankPlan(
                rank=rank,
                sends=tuple(sorted(sends[rank], key=lambda s: (s.expert, s.dst_rank))),
                receives=tuple(sorted(receives[rank], key=lambda r: (r.expert, r.src_rank))),
                local_copies=tuple(sorted(local_copies[rank], key=lambda c: c.expert)),
            )
            for rank in range(num_ranks)
        ),
    )
    logger.debug(
        "transfer plan: %d changed slots, %d receives, %d local copies over %d ranks",
        len(plan.changed_slots()),
        plan.num_receives,
        plan.num_local_copies,
        num_ranks,
    )
    return plan


def _choose_sender(holders: list[int], expert: int, dst_rank: int, assigned: list[int]) -> int:
    """Least-loaded holder; ties round-robin from ``(expert + dst_rank) % len(holders)``."""
    start = (expert + dst_rank) % len(holders)
    rotated = holders[start:] + holders[:start]
    return min(rotated, key=lambda rank: assigned[rank])

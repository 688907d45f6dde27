"""Transfer planner: property tests over random placements, run by the in-process executor.

Every placement pair is executed by ``TransferPlan.execute_local`` on per-rank tensors whose rows
say which expert they hold (``expert * 1000 + column``) and, in a last column, which global slot
the data was copied from. A write into an unchanged slot would change that tag even when it
writes the same expert, so "unchanged slots are never written" is checked on data, and again on
the trace.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb_graph.movement import TransferPlanError, plan_transfer
from eplb_graph.movement.planner import LocalCopy, Receive, Send, TraceEvent

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COLUMNS = 3  # data columns per row; one more column carries the source slot tag


# -- placements ---------------------------------------------------------------------------------


def _covering_row(draw, num_experts: int, num_slots: int) -> list[int]:
    """A row of ``num_slots`` ids where every expert in ``[0, num_experts)`` has >= 1 slot."""
    extra = draw(
        st.lists(
            st.integers(0, num_experts - 1),
            min_size=num_slots - num_experts,
            max_size=num_slots - num_experts,
        )
    )
    return draw(st.permutations(list(range(num_experts)) + extra))


@st.composite
def placements(draw):
    """``(old, new, num_ranks)``: 1-8 ranks, every expert placed in both rows.

    ``new`` is either independent of ``old`` or derived from it by a permutation of slots
    (cycles across and inside ranks), swaps inside one rank and duplicates added on one rank.
    """
    num_ranks = draw(st.integers(1, 8))
    slots_per_rank = draw(st.integers(1, 5))
    num_slots = num_ranks * slots_per_rank
    num_experts = draw(st.integers(1, num_slots))
    old = _covering_row(draw, num_experts, num_slots)
    if draw(st.booleans()):
        new = _covering_row(draw, num_experts, num_slots)
    else:
        order = draw(st.permutations(range(num_slots)))  # permutation cycles over all slots
        new = [old[p] for p in order]
        for _ in range(draw(st.integers(0, 3))):  # swaps inside one rank
            rank = draw(st.integers(0, num_ranks - 1))
            a, b = (rank * slots_per_rank + draw(st.integers(0, slots_per_rank - 1)) for _ in "ab")
            new[a], new[b] = new[b], new[a]
        for _ in range(draw(st.integers(0, 3))):  # duplicates on one rank, coverage kept
            rank = draw(st.integers(0, num_ranks - 1))
            base = rank * slots_per_rank
            src, dst = (base + draw(st.integers(0, slots_per_rank - 1)) for _ in "sd")
            if Counter(new)[new[dst]] > 1:
                new[dst] = new[src]
    return old, new, num_ranks


def _weights(old: list[int], num_ranks: int) -> list[torch.Tensor]:
    """Per-rank ``[slots_per_rank, COLUMNS + 1]`` int64: expert data, then the global slot tag."""
    slots_per_rank = len(old) // num_ranks
    rows = [[e * 1000 + c for c in range(COLUMNS)] + [slot] for slot, e in enumerate(old)]
    table = torch.tensor(rows, dtype=torch.int64)
    return [t.clone() for t in table.split(slots_per_rank)]


def _run(old, new, num_ranks):
    plan = plan_transfer(old, new, num_ranks)
    weights = _weights(old, num_ranks)
    before = [w.clone() for w in weights]
    events: list[TraceEvent] = []
    plan.execute_local(weights, trace=events.append)
    return plan, before, torch.cat(weights), events


# -- properties ---------------------------------------------------------------------------------


@HYPOTHESIS
@given(placements())
def test_every_slot_ends_with_its_new_expert_and_unchanged_slots_are_untouched(case):
    old, new, num_ranks = case
    plan, before, after, _ = _run(old, new, num_ranks)
    before = torch.cat(before)
    for slot, (was, becomes) in enumerate(zip(old, new, strict=True)):
        data, tag = after[slot, :COLUMNS].tolist(), int(after[slot, COLUMNS])
        assert data == [becomes * 1000 + c for c in range(COLUMNS)], (slot, old, new)
        if was == becomes:
            assert torch.equal(after[slot], before[slot]), f"unchanged slot {slot} was written"
        else:
            assert old[tag] == becomes, f"slot {slot} copied from slot {tag} that held {old[tag]}"
    assert plan.changed_slots() == [p for p in range(len(old)) if old[p] != new[p]]
    assert plan.is_noop == (old == new)


@HYPOTHESIS
@given(placements())
def test_no_source_is_written_before_it_is_read_and_only_changed_slots_are_written(case):
    old, new, num_ranks = case
    plan, _, _, events = _run(old, new, num_ranks)
    spr = plan.slots_per_rank
    changed = set(plan.changed_slots())
    writes = [(e.rank, e.slot) for e in events if e.kind == "write"]
    assert len(writes) == len(set(writes)), "a slot was written twice"
    assert {r * spr + s for r, s in writes} == changed
    for rank in range(num_ranks):
        kinds = [(i, e) for i, e in enumerate(events) if e.rank == rank]
        reads = [i for i, e in kinds if e.kind == "read"]
        first_write = min((i for i, e in kinds if e.kind == "write"), default=len(events))
        assert all(i < first_write for i in reads), f"rank {rank} wrote before it read"
        read_slots = {e.slot for _, e in kinds if e.kind == "read"}
        assert read_slots == set(plan.ranks[rank].staged_reads)
        # every source a send or local copy uses was staged
        sources = {s.src_slot for s in plan.ranks[rank].sends}
        sources |= {c.src_slot for c in plan.ranks[rank].local_copies}
        assert sources <= read_slots
        for _, e in kinds:
            if e.kind == "read":
                assert old[rank * spr + e.slot] == e.expert


@HYPOTHESIS
@given(placements())
def test_receives_once_per_expert_and_rank_and_pairs_with_sends(case):
    old, new, num_ranks = case
    plan = plan_transfer(old, new, num_ranks)
    spr = plan.slots_per_rank
    old_pairs = {(e, p // spr) for p, e in enumerate(old)}
    new_pairs = {(e, p // spr) for p, e in enumerate(new)}
    received = [(r.expert, rp.rank) for rp in plan.ranks for r in rp.receives]
    assert len(received) == len(set(received)), "an (expert, rank) was received twice"
    assert set(received) == new_pairs - old_pairs
    assert plan.num_receives == len(new_pairs - old_pairs)
    for rank_plan in plan.ranks:
        assert list(rank_plan.sends) == sorted(
            rank_plan.sends, key=lambda s: (s.expert, s.dst_rank)
        )
        assert list(rank_plan.receives) == sorted(
            rank_plan.receives, key=lambda r: (r.expert, r.src_rank)
        )
        for send in rank_plan.sends:
            assert old[rank_plan.rank * spr + send.src_slot] == send.expert
            assert send.dst_rank != rank_plan.rank
        for copy in rank_plan.local_copies:  # source = first old slot of the expert on the rank
            local_old = old[rank_plan.rank * spr : (rank_plan.rank + 1) * spr]
            assert copy.src_slot == local_old.index(copy.expert)
    for a in range(num_ranks):
        for b in range(num_ranks):
            sent = [s.expert for s in plan.ranks[a].sends if s.dst_rank == b]
            got = [r.expert for r in plan.ranks[b].receives if r.src_rank == a]
            assert sent == got, f"sends {a}->{b} {sent} do not pair with receives {got}"


@HYPOTHESIS
@given(placements())
def test_plan_is_deterministic_and_written_slots_are_the_changed_ones(case):
    old, new, num_ranks = case
    plan = plan_transfer(old, new, num_ranks)
    assert plan == plan_transfer(torch.tensor(old), torch.tensor(new, dtype=torch.int32), num_ranks)
    spr = plan.slots_per_rank
    written = [r.rank * spr + s for r in plan.ranks for s in r.written_slots]
    assert sorted(written) == plan.changed_slots()
    for rank_plan in plan.ranks:
        for receive in rank_plan.receives:
            assert list(receive.dst_slots) == sorted(receive.dst_slots)


# -- examples -----------------------------------------------------------------------------------


def test_swap_across_ranks_matches_the_article_example():
    """Rank 0 [A, B] -> [A, C] and rank 1 [C, D] -> [B, D]: one send each way, A and D untouched."""
    plan = plan_transfer([0, 1, 2, 3], [0, 2, 1, 3], num_ranks=2)
    assert plan.ranks[0].sends == (Send(dst_rank=1, expert=1, src_slot=1),)
    assert plan.ranks[0].receives == (Receive(src_rank=1, expert=2, dst_slots=(1,)),)
    assert plan.ranks[1].sends == (Send(dst_rank=0, expert=2, src_slot=0),)
    assert plan.ranks[1].receives == (Receive(src_rank=0, expert=1, dst_slots=(0,)),)
    assert plan.changed_slots() == [1, 2]


def test_swap_inside_a_rank_is_two_local_copies_from_staging():
    plan = plan_transfer([0, 1], [1, 0], num_ranks=1)
    (rank,) = plan.ranks
    assert rank.local_copies == (LocalCopy(0, 0, (1,)), LocalCopy(1, 1, (0,)))
    assert rank.staged_reads == (0, 1) and plan.num_receives == 0
    weights = [torch.tensor([[10], [20]])]
    plan.execute_local(weights)
    assert weights[0].flatten().tolist() == [20, 10]


def test_duplicates_on_a_rank_are_received_once():
    plan = plan_transfer([0, 1, 2, 2], [2, 2, 0, 1], num_ranks=2)
    assert plan.ranks[0].receives == (Receive(src_rank=1, expert=2, dst_slots=(0, 1)),)
    assert plan.num_receives == 3  # 2 -> rank 0 once; 0 and 1 -> rank 1


def test_senders_are_spread_over_the_ranks_that_hold_the_expert():
    # expert 0 is on ranks 0 and 1; ranks 2 and 3 both need it: one send from each holder
    plan = plan_transfer([0, 1, 0, 2, 3, 4, 5, 6], [0, 1, 0, 2, 0, 4, 0, 6], num_ranks=4)
    senders = sorted(rp.rank for rp in plan.ranks for _ in rp.sends)
    assert senders == [0, 1]


def test_sender_choice_prefers_the_least_loaded_holder():
    # experts 0 and 1 are both on ranks 0 and 1; rank 2 needs 0, rank 3 needs 1. Round-robin
    # alone would start both at rank 0; least-loaded moves the second send to rank 1.
    plan = plan_transfer([0, 1, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 4, 1, 5], num_ranks=4)
    senders = {s.expert: rp.rank for rp in plan.ranks for s in rp.sends if s.expert in (0, 1)}
    assert senders == {0: 0, 1: 1}


def test_noop_plan_touches_nothing():
    plan = plan_transfer([3, 1, 2, 0], [3, 1, 2, 0], num_ranks=2)
    assert plan.is_noop and plan.num_receives == 0 and plan.changed_slots() == []
    events = []
    plan.execute_local([torch.zeros(2, 1), torch.zeros(2, 1)], trace=events.append)
    assert events == []


@pytest.mark.parametrize(
    ("old", "new", "num_ranks", "message"),
    [
        ([0, 1, 2], [0, 1], 1, "slots"),
        ([0, 1, 2], [2, 1, 0], 2, "divisible"),
        ([0, -1], [0, 1], 1, ">= 0"),
        ([0, 1], [0, -3], 1, ">= 0"),
        ([0, 1], [0, 2], 1, "no source"),
        ([[0, 1]], [[0, 1]], 1, "1-D"),
        ([0.0, 1.0], [0, 1], 1, "integer"),
        ([], [], 1, "empty"),
        ([0, 1], [1, 0], 0, "num_ranks"),
        ([0, 1], [1, 0], True, "num_ranks"),
        ("ab", [1, 0], 1, "integer array"),
    ],
)
def test_bad_inputs_raise_a_clear_error(old, new, num_ranks, message):
    with pytest.raises(TransferPlanError, match=message):
        plan_transfer(old, new, num_ranks)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (torch.zeros(2, 2, 1), "list"),
        ([torch.zeros(2, 1)], "2 ranks"),
        ([torch.zeros(2, 1), torch.zeros(3, 1)], "slots_per_rank"),
        ([torch.zeros(2, 1), torch.zeros(2, 2)], "differ"),
        ([torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int64)], "differ"),
        ([torch.zeros(2, 1), [0, 1]], "tensor"),
    ],
)
def test_execute_local_rejects_bad_tensors_before_writing(weights, message):
    plan = plan_transfer([0, 1, 2, 3], [2, 1, 0, 3], num_ranks=2)
    snapshot = [w.clone() for w in weights if isinstance(w, torch.Tensor)]
    with pytest.raises(TransferPlanError, match=message):
        plan.execute_local(weights)
    assert all(
        torch.equal(a, b)
        for a, b in zip(snapshot, [w for w in weights if isinstance(w, torch.Tensor)], strict=True)
    )

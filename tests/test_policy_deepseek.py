"""DeepSeek EPLB policy: upstream vectors and cases, validity, and equality with the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph import Placement
from eplb_graph.policy import (
    deepseek,
    get_policy,
    policy_names,
    preserve_slots,
    rebalance,
    rebalance_experts,
    reference_deepseek,
)
from eplb_graph.policy.reference_deepseek import reference_rebalance_experts
from eplb_graph.tables import derive_log2phy

UPSTREAM_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def check_valid(weight, phy2log, log2phy, logcnt, num_replicas, num_ranks):
    """Shapes, a valid Placement, consistent counts and the ascending-slot log2phy."""
    weight = torch.as_tensor(weight)
    num_layers, num_logical = weight.shape
    width = num_replicas - num_logical + 1
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert phy2log.shape == (num_layers, num_replicas)
    assert log2phy.shape == (num_layers, num_logical, width)
    assert logcnt.shape == (num_layers, num_logical)
    placement = Placement(phy2log, num_logical, num_ranks)  # raises if invalid
    assert torch.equal(logcnt.sum(dim=1), torch.full((num_layers,), num_replicas))
    assert torch.equal(placement.replica_count(), logcnt)
    assert torch.equal(placement.log2phy(width), log2phy)
    return placement


def test_upstream_hierarchical_vector():
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor(UPSTREAM_WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [
        [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
        [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
    ]
    check_valid(UPSTREAM_WEIGHT, phy2log, log2phy, logcnt, 16, 8)
    # log2phy lists slots in ascending order (this project's convention), e.g. expert 1 of
    # layer 0 sits in slots 13 and 15.
    assert log2phy[0, 1].tolist() == [13, 15, -1, -1, -1]


def test_upstream_replica_ranks():
    """Upstream's replica-rank order (its log2phy column) is reproduced too."""
    _, replica_rank, _ = deepseek.rebalance_experts_with_replica_rank(
        np.array(UPSTREAM_WEIGHT, dtype=np.float64), 16, 4, 2, 8
    )
    assert replica_rank.tolist() == [
        [0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0],
    ]
    ref = reference_deepseek.reference_replica_rank(torch.tensor(UPSTREAM_WEIGHT), 16, 4, 2, 8)
    assert torch.equal(ref, torch.from_numpy(replica_rank))


def test_global_fallback_vector():
    """num_groups % num_nodes != 0 -> global (hierarchical with one group on one node)."""
    weight = torch.tensor([[10, 20, 30, 40]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 8, 3, 2, 4)
    assert phy2log.tolist() == [[2, 1, 2, 1, 3, 3, 3, 0]]
    assert logcnt.tolist() == [[1, 2, 2, 3]]
    check_valid(weight, phy2log, log2phy, logcnt, 8, 4)
    forced = rebalance_experts(weight, 8, 1, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(forced, (phy2log, log2phy, logcnt), strict=True))


def test_single_rank():
    weight = torch.tensor([[10, 20, 30, 40]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 4, 1, 1, 1)
    check_valid(weight, phy2log, log2phy, logcnt, 4, 1)
    assert sorted(phy2log[0].tolist()) == [0, 1, 2, 3]
    assert logcnt.tolist() == [[1, 1, 1, 1]]


def test_equal_weights():
    weight = torch.full((1, 8), 100)
    phy2log, log2phy, logcnt = rebalance_experts(weight, 8, 2, 1, 4)
    check_valid(weight, phy2log, log2phy, logcnt, 8, 4)
    assert logcnt.tolist() == [[1] * 8]
    assert sorted(phy2log[0].tolist()) == list(range(8))


def test_extreme_imbalance_one_hot_expert():
    weight = torch.tensor([[1000, 1, 1, 1, 1, 1, 1, 1]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 12, 2, 1, 4)
    check_valid(weight, phy2log, log2phy, logcnt, 12, 4)
    assert logcnt[0, 0] == 5  # every extra slot goes to the hot expert
    assert int(logcnt[0, 0]) == int(logcnt[0].max())
    # Its replicas are spread over ranks: no rank holds two copies (5 copies, 4 ranks -> at
    # most 2 on one rank, and the greedy never stacks while a rank is lighter).
    ranks = (log2phy[0, 0][log2phy[0, 0] >= 0] // 3).tolist()
    assert max(ranks.count(r) for r in set(ranks)) <= 2


def test_multiple_layers():
    weight = torch.tensor(
        [[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25, 25, 25, 25, 25, 25]]
    )
    phy2log, log2phy, logcnt = rebalance_experts(weight, 8, 2, 1, 4)
    check_valid(weight, phy2log, log2phy, logcnt, 8, 4)
    # Layers are independent: each equals the single-layer result.
    for layer in range(3):
        alone = rebalance_experts(weight[layer : layer + 1], 8, 2, 1, 4)
        assert torch.equal(alone[0][0], phy2log[layer])
    # The hottest expert of each skewed layer gets a replica.
    assert logcnt[0, 5] == 2 and logcnt[1, 0] == 2


def test_small_hierarchical():
    weight = torch.tensor([[50, 100, 75, 120, 90, 60, 80, 110]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 12, 4, 2, 4)
    check_valid(weight, phy2log, log2phy, logcnt, 12, 4)
    # Hierarchical: each node's 6 slots hold only that node's 2 whole groups of 2 experts.
    groups_by_node = [{e // 2 for e in phy2log[0, n * 6 : (n + 1) * 6].tolist()} for n in (0, 1)]
    assert all(len(g) == 2 for g in groups_by_node)
    assert not groups_by_node[0] & groups_by_node[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((7, 1, 1, 4), "not divisible by num_ranks"),
        ((2, 1, 1, 2), "smaller than the number of experts"),
        ((8, 3, 1, 4), "N % num_groups"),
        ((9, 2, 2, 3), "num_ranks % num_nodes"),
        ((8, 1, 1, 0), "num_ranks must be >= 1"),
    ],
)
def test_rejects_bad_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.tensor([[10, 20, 30, 40]]), *args)


@pytest.mark.parametrize("weight", [[[1.0, -1.0]], [[float("nan"), 1.0]], [1.0, 2.0]])
def test_rejects_bad_weights(weight):
    with pytest.raises(ValueError):
        rebalance_experts(torch.tensor(weight), 2, 1, 1, 1)


def test_accepts_any_real_dtype():
    expected = rebalance_experts(torch.tensor(UPSTREAM_WEIGHT), 16, 4, 2, 8)
    for dtype in (torch.bfloat16, torch.float32, torch.int32):
        got = rebalance_experts(torch.tensor(UPSTREAM_WEIGHT, dtype=dtype), 16, 4, 2, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_log2phy_matches_placement_derivation():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 50, (5, 16), generator=generator)
    phy2log, log2phy, _ = rebalance_experts(weight, 24, 4, 2, 4)
    assert torch.equal(log2phy, derive_log2phy(phy2log, 16, 9))


@st.composite
def problems(draw, hierarchical: bool):
    """Random (weight [L, N], P, groups, nodes, ranks) with small integer loads (many ties)."""
    num_nodes = draw(st.integers(1, 3))
    ranks = num_nodes * draw(st.integers(1, 3))
    if hierarchical:
        groups = num_nodes * draw(st.integers(1, 3))
    else:  # forces the global fallback (groups % nodes != 0), needs nodes >= 2
        num_nodes = max(num_nodes, 2)
        ranks = num_nodes * draw(st.integers(1, 3))
        groups = num_nodes * draw(st.integers(1, 2)) + 1
    group_size = draw(st.integers(1, 3))
    num_logical = groups * group_size
    min_per_rank = -(-num_logical // ranks)
    num_replicas = ranks * draw(st.integers(min_per_rank, min_per_rank + 3))
    num_layers = draw(st.integers(1, 4))
    high = draw(st.sampled_from([0, 1, 3, 1000]))
    weight = draw(
        st.lists(
            st.lists(st.integers(0, high), min_size=num_logical, max_size=num_logical),
            min_size=num_layers,
            max_size=num_layers,
        )
    )
    return torch.tensor(weight, dtype=torch.float64), num_replicas, groups, num_nodes, ranks


def assert_matches_reference(problem):
    weight, num_replicas, groups, nodes, ranks = problem
    fast = rebalance_experts(weight, num_replicas, groups, nodes, ranks)
    slow = reference_rebalance_experts(weight, num_replicas, groups, nodes, ranks)
    for got, expected in zip(fast, slow, strict=True):
        assert torch.equal(got, expected)
    check_valid(weight, *fast, num_replicas, ranks)


@settings(max_examples=150, deadline=None)
@given(problems(hierarchical=True))
def test_hierarchical_equals_reference(problem):
    assert_matches_reference(problem)


@settings(max_examples=100, deadline=None)
@given(problems(hierarchical=False))
def test_global_equals_reference(problem):
    assert_matches_reference(problem)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0, 2, 1000]),
)
def test_packing_and_replication_equal_reference(rows, packs, per_pack, seed, high):
    """The two building blocks, row by row, including all-zero and tied rows."""
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, high + 1, (rows, packs * per_pack)).astype(np.float64)
    if high == 1000:
        weight = weight / 7.0  # non-integer loads: identical float arithmetic required
    pack, rank_in_pack = deepseek.balanced_packing(weight, packs)
    slots = packs * per_pack + int(rng.integers(0, 5))
    slot2expert, replica_rank, count = deepseek.replicate_experts(weight, slots)
    for row in range(rows):
        ref_pack, ref_rank = reference_deepseek.balanced_packing(weight[row].tolist(), packs)
        assert pack[row].tolist() == ref_pack and rank_in_pack[row].tolist() == ref_rank
        ref = reference_deepseek.replicate_experts(weight[row].tolist(), slots)
        assert (slot2expert[row].tolist(), replica_rank[row].tolist(), count[row].tolist()) == ref


def test_non_integer_loads_equal_reference():
    rng = np.random.default_rng(7)
    weight = torch.from_numpy(rng.gamma(0.5, 100.0, (6, 32)))
    for args in ((48, 4, 2, 8), (48, 4, 3, 8)):
        fast = rebalance_experts(weight, *args)
        slow = reference_rebalance_experts(weight, *args)
        assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))


def test_registered_default_policy():
    assert {"default", "random"} <= set(policy_names())
    samples = torch.tensor([UPSTREAM_WEIGHT, UPSTREAM_WEIGHT]) / 2  # [S=2, L, N] sums to upstream
    phy2log = rebalance("default", samples, 16, 4, 2, 8)
    assert torch.equal(phy2log, rebalance_experts(torch.tensor(UPSTREAM_WEIGHT), 16, 4, 2, 8)[0])
    assert torch.equal(rebalance("default", torch.tensor(UPSTREAM_WEIGHT), 16, 4, 2, 8), phy2log)


def test_default_policy_preserves_slots_of_old_placement():
    weight = torch.tensor(UPSTREAM_WEIGHT)
    old = Placement.default(2, 12, 4, 8).phy2log
    fresh = rebalance_experts(weight, 16, 4, 2, 8)[0]
    kept = rebalance("default", weight, 16, 4, 2, 8, old_phy2log=old)
    assert torch.equal(kept, preserve_slots(old, fresh, 8))
    plain = rebalance("default", weight, 16, 4, 2, 8, old_phy2log=old, keep_slots=False)
    assert torch.equal(plain, fresh)
    with pytest.raises(TypeError):
        rebalance("default", weight, 16, 4, 2, 8, no_such_option=1)


def test_random_policy_is_valid_and_seeded():
    weight = torch.zeros(3, 10)
    first = rebalance("random", weight, 16, 1, 1, 4, seed=5)
    Placement(first, 10, 4)
    assert torch.equal(first, rebalance("random", weight, 16, 1, 1, 4, seed=5))
    assert not torch.equal(first, rebalance("random", weight, 16, 1, 1, 4, seed=6))
    assert get_policy("random") is not get_policy("default")

"""Policy "churn_aware": budgeted, gated, deterministic incremental rebalancing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph.placement import Placement
from eplb_graph.policy import (
    balancedness,
    rank_load,
    rebalance,
    rebalance_experts,
    transfers_needed,
)
from eplb_graph.policy.churn_aware import local_search, predict_load, transfer_budget


def zipf_load(layers: int, experts: int, seed: int) -> torch.Tensor:
    """``[L, N]`` zipf(1.0)-shaped loads with a random expert order per layer."""
    rng = np.random.default_rng(seed)
    shape = 1000.0 / np.arange(1, experts + 1)
    return torch.from_numpy(np.stack([shape[rng.permutation(experts)] for _ in range(layers)]))


def drifted(load: torch.Tensor, seed: int, sigma: float) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return load * torch.from_numpy(rng.lognormal(0.0, sigma, size=tuple(load.shape)))


def assert_valid(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> None:
    assert phy2log.dtype == torch.int64
    Placement(phy2log, num_logical, num_ranks)
    counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert bool((counts >= 1).all()), "an expert lost its last slot"


def layer_balancedness(phy2log: torch.Tensor, load: torch.Tensor, ranks: int) -> torch.Tensor:
    loads = rank_load(phy2log, load, ranks)
    return loads.mean(dim=1) / loads.max(dim=1).values


@pytest.fixture(scope="module")
def drift_case():
    """(old placement, good for the previous load; the drifted load; N, P, ranks)."""
    layers, experts, slots, ranks = 6, 64, 80, 16
    previous = zipf_load(layers, experts, seed=11)
    old, _, _ = rebalance_experts(previous, slots, 1, 1, ranks)
    return old, drifted(previous, seed=12, sigma=0.3), experts, slots, ranks


@pytest.mark.parametrize("fraction", [0.0, 0.03, 0.1, 0.25])
def test_transfer_budget_is_respected_per_layer(drift_case, fraction):
    old, load, experts, slots, ranks = drift_case
    new = rebalance(
        "churn_aware",
        load,
        slots,
        1,
        1,
        ranks,
        old,
        max_transfer_fraction=fraction,
        min_gain=0.0,
        min_total_gain=0.0,
    )
    assert_valid(new, experts, ranks)
    budget = math.floor(fraction * slots)
    assert bool((transfers_needed(old, new, ranks) <= budget).all())
    if budget == 0:
        assert torch.equal(new, old)


def test_default_budget_is_fifteen_percent_of_slots_per_layer(drift_case):
    old, load, experts, slots, ranks = drift_case
    new = rebalance("churn_aware", load, slots, 1, 1, ranks, old, min_gain=0.0, min_total_gain=0.0)
    assert_valid(new, experts, ranks)
    moved = transfers_needed(old, new, ranks)
    assert bool((moved <= math.floor(0.15 * slots)).all())
    # The drift is large enough that some layer uses more than the former 10% default.
    assert bool((moved > math.floor(0.10 * slots)).any())


def test_byte_budget_caps_the_whole_rebalance(drift_case):
    old, load, _, slots, ranks = drift_case
    expert_bytes = 3 << 20
    for transfers in (0, 5, 17):
        new = rebalance(
            "churn_aware",
            load,
            slots,
            1,
            1,
            ranks,
            old,
            max_transfer_fraction=0.5,
            max_bytes=transfers * expert_bytes + expert_bytes - 1,
            expert_bytes=expert_bytes,
            min_gain=0.0,
            min_total_gain=0.0,
        )
        assert int(transfers_needed(old, new, ranks).sum()) <= transfers
    with pytest.raises(ValueError, match="expert_bytes"):
        rebalance("churn_aware", load, slots, 1, 1, ranks, old, max_bytes=10)


def test_improves_balance_on_a_skewed_case(drift_case):
    old, load, _, slots, ranks = drift_case
    before = balancedness(rank_load(old, load, ranks))
    new = rebalance("churn_aware", load, slots, 1, 1, ranks, old)
    after = balancedness(rank_load(new, load, ranks))
    assert after > before + 0.05, (before, after)
    # Far fewer transfers than a fresh DeepSeek plan, which reshuffles nearly everything.
    fresh = rebalance("default", load, slots, 1, 1, ranks, old)
    assert int(transfers_needed(old, new, ranks).sum()) < 0.5 * int(
        transfers_needed(old, fresh, ranks).sum()
    )


def test_layers_below_min_gain_keep_their_old_row(drift_case):
    old, load, _, slots, ranks = drift_case
    # Layer 0 gets the load its placement was planned for (nothing to gain), the others drift.
    planned_for = load.clone()
    balanced, _, _ = rebalance_experts(load[:1], slots, 1, 1, ranks)
    mixed_old = old.clone()
    mixed_old[0] = balanced[0]
    new = rebalance("churn_aware", planned_for, slots, 1, 1, ranks, mixed_old, min_gain=0.02)
    gain = layer_balancedness(new, load, ranks) - layer_balancedness(mixed_old, load, ranks)
    unchanged = (new == mixed_old).all(dim=1)
    assert bool(unchanged[0])
    assert bool((gain[~unchanged] >= 0.02 - 1e-12).all())
    assert bool((~unchanged[1:]).any()), "the drifted layers should be rebalanced"
    # A min_gain no layer can reach leaves everything as it was.
    assert torch.equal(rebalance("churn_aware", load, slots, 1, 1, ranks, old, min_gain=1.0), old)


def test_whole_rebalance_skipped_when_it_does_not_pay(drift_case):
    old, load, _, slots, ranks = drift_case
    assert torch.equal(
        rebalance("churn_aware", load, slots, 1, 1, ranks, old, min_total_gain=0.9), old
    )
    # A perfectly balanced placement: nothing to gain, nothing moves.
    uniform = torch.ones(3, slots, dtype=torch.float64)
    balanced = Placement.default(3, slots, 0, ranks).phy2log
    assert torch.equal(rebalance("churn_aware", uniform, slots, 1, 1, ranks, balanced), balanced)


def test_deterministic(drift_case):
    old, load, _, slots, ranks = drift_case
    first = rebalance("churn_aware", load, slots, 1, 1, ranks, old)
    assert torch.equal(first, rebalance("churn_aware", load, slots, 1, 1, ranks, old.clone()))


def test_first_placement_is_deepseek_on_the_predicted_load():
    load = zipf_load(3, 16, seed=5)
    expected, _, _ = rebalance_experts(load, 24, 2, 2, 4)
    assert torch.equal(rebalance("churn_aware", load, 24, 2, 2, 4, None), expected)


def test_predictor_weights_recent_samples():
    older, newer = np.full((1, 2, 3), 1.0), np.full((1, 2, 3), 4.0)
    samples = np.concatenate([older, newer])
    assert np.allclose(predict_load(samples, 0.5), (0.5 * 1.0 + 4.0) / 1.5)
    assert np.allclose(predict_load(samples, 1.0), 2.5)
    assert np.allclose(predict_load(newer, 0.5), 4.0)
    with pytest.raises(ValueError, match="recency_decay"):
        predict_load(samples, 0.0)


def test_transfer_budget_options():
    assert transfer_budget(320, 0.10, None, None) == (32, None)
    assert transfer_budget(144, 0.15, None, None) == (21, None)
    assert transfer_budget(144, 0.1, 10 * 7 + 3, 7) == (14, 10)
    with pytest.raises(ValueError, match="max_transfer_fraction"):
        transfer_budget(144, 1.5, None, None)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ranks=st.sampled_from([2, 3, 4]),
    per_rank=st.integers(2, 4),
    spare=st.integers(0, 4),
    budget=st.integers(0, 6),
    slack=st.sampled_from([None, 0.0, 0.3]),
)
def test_local_search_never_raises_a_peak_and_keeps_every_expert(
    seed, ranks, per_rank, spare, budget, slack
):
    slots = ranks * per_rank
    spare = min(spare, slots - 1)
    experts = slots - spare
    rng = np.random.default_rng(seed)
    old = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, spare)]))
            for _ in range(3)
        ]
    )
    load = rng.lognormal(0.0, 1.0, size=(3, experts))
    cap = None if slack is None else np.full(3, np.inf)
    new = local_search(load, old, ranks, budget, replica_cap=cap)
    new_t, old_t, load_t = torch.from_numpy(new), torch.from_numpy(old), torch.from_numpy(load)
    assert_valid(new_t, experts, ranks)
    assert bool((transfers_needed(old_t, new_t, ranks) <= budget).all())
    peak_new = rank_load(new_t, load_t, ranks).max(dim=1).values
    peak_old = rank_load(old_t, load_t, ranks).max(dim=1).values
    assert bool((peak_new <= peak_old * (1 + 1e-9)).all())

    # No edit adds a second copy of an expert to a rank that holds it.
    def duplicates(table: np.ndarray) -> list[int]:
        return [len(b) - len(set(b.tolist())) for b in table.reshape(-1, per_rank)]

    assert all(n <= o for n, o in zip(duplicates(new), duplicates(old), strict=True))


@pytest.mark.parametrize("samples", [None, 4])
def test_rebalance_accepts_both_weight_shapes(samples):
    layers, experts, slots, ranks = 3, 16, 24, 4
    load = zipf_load(layers, experts, seed=8)
    weight = load if samples is None else torch.stack([drifted(load, s, 0.2) for s in range(4)])
    old = Placement.default(layers, experts, slots - experts, ranks).phy2log
    for previous in (None, old):
        new = rebalance("churn_aware", weight, slots, 1, 1, ranks, previous)
        assert new.shape == (layers, slots)
        assert_valid(new, experts, ranks)

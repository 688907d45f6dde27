"""Policies "swift_balance" (legacy type 2) and "flash_lb" (legacy type 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph.placement import Placement
from eplb_graph.policy import (
    get_policy,
    rank_load,
    rebalance,
    rebalance_experts,
    slots_changed,
    transfers_needed,
)
from eplb_graph.policy.flash_lb import lpt_place, risk_weight
from eplb_graph.policy.registry import PolicyProblem, normalize_weight
from eplb_graph.policy.swift_balance import movable_slots, swift_balance_search


def zipf_load(layers: int, experts: int, seed: int, samples: int | None = None) -> torch.Tensor:
    """``[L, N]`` (or ``[S, L, N]``) zipf(1.0)-shaped loads, a random expert order per layer."""
    rng = np.random.default_rng(seed)
    shape = 1000.0 / np.arange(1, experts + 1)
    base = np.stack([shape[rng.permutation(experts)] for _ in range(layers)])
    if samples is None:
        return torch.from_numpy(base)
    noise = rng.lognormal(0.0, 0.3, size=(samples, layers, experts))
    return torch.from_numpy(base[None] * noise)


def drifted(load: torch.Tensor, seed: int, sigma: float = 0.3) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return load * torch.from_numpy(rng.lognormal(0.0, sigma, size=tuple(load.shape)))


def assert_valid(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> None:
    assert phy2log.dtype == torch.int64
    Placement(phy2log, num_logical, num_ranks)  # raises on a malformed placement
    counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert bool((counts >= 1).all()), "an expert lost its last slot"


def swift_plan(load, slots, ranks, old, **options) -> torch.Tensor:
    """swift_balance's own plan, before ``rebalance``'s duplicate post-pass (its contract:
    bounded moves from ``old``; the post-pass is pinned in test_policy_spread.py)."""
    return get_policy("swift_balance")(
        PolicyProblem(normalize_weight(load), slots, 1, 1, ranks, old), **options
    )


def peaks(phy2log: torch.Tensor, load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    return rank_load(phy2log, load, num_ranks).max(dim=1).values


# ---------------------------------------------------------------------------------------------
# swift_balance


@pytest.fixture(scope="module")
def skewed_case():
    """(old placement planned for the old load, new drifted load, N, P, ranks)."""
    layers, experts, slots, ranks = 6, 32, 48, 8
    old_load = zipf_load(layers, experts, seed=1)
    old, _, _ = rebalance_experts(old_load, slots, 1, 1, ranks)
    return old, drifted(old_load, seed=2, sigma=0.5), experts, slots, ranks


def test_swift_balance_valid_and_only_moves_redundant_replicas(skewed_case):
    old, load, experts, slots, ranks = skewed_case
    new = swift_plan(load, slots, ranks, old)
    assert_valid(new, experts, ranks)
    fixed = ~torch.from_numpy(movable_slots(old.numpy(), experts))
    assert bool(fixed.any())
    assert torch.equal(new[fixed], old[fixed]), "a single-copy expert's slot changed"
    assert float(slots_changed(old, new).sum()) > 0, "the skewed case should trigger moves"


@pytest.mark.parametrize(("max_swaps", "pair_cap"), [(8, 2), (3, 1), (1, 5), (0, 2), (8, 0)])
def test_swift_balance_respects_move_and_rank_pair_bounds(skewed_case, max_swaps, pair_cap):
    old, load, _, slots, ranks = skewed_case
    moves = swift_balance_search(load.numpy(), old.numpy(), ranks, max_swaps, pair_cap)
    assert int(moves.moves.max()) <= max_swaps
    assert int(moves.sent.max()) <= pair_cap
    # Every (expert, rank) pair that is new must have been sent to that rank.
    new = torch.from_numpy(moves.phy2log)
    received = torch.from_numpy(moves.sent.sum(axis=1))  # [L, dst]
    assert bool((transfers_needed(old, new, ranks) <= received.sum(dim=1)).all())
    # A move changes at most two slots.
    assert bool((slots_changed(old, new) * slots <= 2 * torch.from_numpy(moves.moves)).all())
    policy = swift_plan(
        load, slots, ranks, old, max_swaps=max_swaps, max_transfers_per_rank_pair=pair_cap
    )
    assert bool((transfers_needed(old, policy, ranks) <= 2 * max_swaps).all())
    if max_swaps == 0 or pair_cap == 0:
        assert torch.equal(policy, old)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ranks=st.sampled_from([2, 4]),
    per_rank=st.integers(2, 4),
    spare=st.integers(0, 4),
)
def test_swift_balance_never_worsens_imbalance(seed, ranks, per_rank, spare):
    slots = ranks * per_rank
    spare = min(spare, slots - 1)
    experts = slots - spare
    rng = np.random.default_rng(seed)
    old = torch.from_numpy(
        np.stack(
            [
                rng.permutation(
                    np.concatenate([np.arange(experts), rng.integers(0, experts, spare)])
                )
                for _ in range(3)
            ]
        )
    )
    load = torch.from_numpy(rng.lognormal(0.0, 1.0, size=(3, experts)))
    new = swift_plan(load, slots, ranks, old)
    assert_valid(new, experts, ranks)
    assert bool((peaks(new, load, ranks) <= peaks(old, load, ranks) + 1e-9).all())
    changed = slots_changed(old, new) > 0
    assert bool((peaks(new, load, ranks)[changed] < peaks(old, load, ranks)[changed]).all())


def test_swift_balance_improves_and_falls_back_without_old_placement(skewed_case):
    old, load, _, slots, ranks = skewed_case
    new = rebalance("swift_balance", load, slots, 1, 1, ranks, old)
    assert float(peaks(new, load, ranks).sum()) < float(peaks(old, load, ranks).sum())
    fresh = rebalance("swift_balance", load, slots, 1, 1, ranks, None)
    assert torch.equal(fresh, rebalance("default", load, slots, 1, 1, ranks, None))


# ---------------------------------------------------------------------------------------------
# flash_lb


def test_flash_lb_gives_the_bursty_expert_more_replicas():
    # Experts 0 and 1 have the same mean load per sample; expert 1 comes in bursts.
    steady, bursty = [10.0, 10.0, 10.0, 10.0], [0.0, 20.0, 0.0, 20.0]
    samples = torch.tensor([[[s, b, 1.0, 1.0]] for s, b in zip(steady, bursty, strict=True)])
    # samples: [S=4, L=1, N=4]
    assert torch.allclose(samples[:, 0, 0].mean(), samples[:, 0, 1].mean())
    phy2log = rebalance("flash_lb", samples, 5, 1, 1, 5)
    counts = torch.bincount(phy2log[0], minlength=4)
    assert counts[1] == 2 and counts[0] == 1, counts
    # On the mean alone (z = 0) the two tie, and the tie goes to the lower expert id.
    counts = torch.bincount(rebalance("flash_lb", samples, 5, 1, 1, 5, z=0.0)[0], minlength=4)
    assert counts[0] == 2 and counts[1] == 1, counts


def test_flash_lb_bursty_experts_get_more_replicas_at_scale():
    rng = np.random.default_rng(7)
    layers, experts, samples = 4, 32, 16
    mean = np.full((layers, experts), 100.0)
    bursty = rng.permutation(experts)[:8]
    series = np.broadcast_to(mean, (samples, layers, experts)).copy()
    on = rng.random((samples, layers, bursty.size)) < 0.5
    series[:, :, bursty] = np.where(on, 180.0, 20.0)
    series[:, :, bursty] *= 100.0 / series[:, :, bursty].mean(axis=0, keepdims=True)
    phy2log = rebalance("flash_lb", torch.from_numpy(series), 48, 1, 1, 8)
    counts = np.stack([np.bincount(row, minlength=experts) for row in phy2log.numpy()])
    steady = np.setdiff1d(np.arange(experts), bursty)
    assert counts[:, bursty].mean() > counts[:, steady].mean() + 0.5


@pytest.mark.parametrize("samples", [None, 5])
def test_flash_lb_valid_balanced_and_idempotent(samples):
    layers, experts, slots, ranks = 5, 32, 40, 8
    weight = zipf_load(layers, experts, seed=3, samples=samples)
    fresh = rebalance("flash_lb", weight, slots, 1, 1, ranks)
    assert_valid(fresh, experts, ranks)
    for row in fresh.view(layers, ranks, -1):  # no rank holds an expert twice
        assert all(len(set(block.tolist())) == block.numel() for block in row)
    total = weight if samples is None else weight.sum(dim=0)
    deepseek, _, _ = rebalance_experts(total, slots, 1, 1, ranks)
    flash_peak = peaks(fresh, total, ranks).sum()
    assert float(flash_peak) <= 1.1 * float(peaks(deepseek, total, ranks).sum())
    # Re-planning the same window against its own plan changes nothing.
    again = rebalance("flash_lb", weight, slots, 1, 1, ranks, fresh)
    assert torch.equal(again, fresh)


def test_flash_lb_keeps_slots_and_ranks_of_the_old_placement():
    layers, experts, slots, ranks = 4, 32, 48, 8
    old_load = zipf_load(layers, experts, seed=4)
    old = rebalance("flash_lb", old_load, slots, 1, 1, ranks)
    load = drifted(old_load, seed=5, sigma=0.2)
    plain = rebalance("flash_lb", load, slots, 1, 1, ranks, old, keep_slots=False, relabel=False)
    kept = rebalance("flash_lb", load, slots, 1, 1, ranks, old)
    assert_valid(kept, experts, ranks)
    assert int(transfers_needed(old, kept, ranks).sum()) <= int(
        transfers_needed(old, plain, ranks).sum()
    )
    assert float(slots_changed(old, kept).mean()) <= float(slots_changed(old, plain).mean())
    # Relabelling and slot preservation keep every rank's load multiset.
    assert torch.allclose(
        rank_load(kept, load, ranks).sort(dim=1).values,
        rank_load(plain, load, ranks).sort(dim=1).values,
    )


def test_lpt_place_and_risk_weight_shapes():
    samples = np.abs(np.random.default_rng(0).normal(10, 3, size=(6, 2, 8)))
    mean, std, risk = risk_weight(samples, 0.674)
    assert mean.shape == std.shape == risk.shape == (2, 8)
    assert np.allclose(risk, mean + 0.674 * std)
    count = np.full((2, 8), 2)
    phy2log = lpt_place(count, mean, std, num_ranks=4, z=0.674)
    assert phy2log.shape == (2, 16)
    assert (np.stack([np.bincount(row, minlength=8) for row in phy2log]) == 2).all()


@pytest.mark.parametrize("name", ["swift_balance", "flash_lb"])
@pytest.mark.parametrize("samples", [None, 3])
def test_rebalance_accepts_both_weight_shapes(name, samples):
    layers, experts, slots, ranks = 3, 16, 24, 4
    weight = zipf_load(layers, experts, seed=6, samples=samples)
    old = Placement.default(layers, experts, slots - experts, ranks).phy2log
    for previous in (None, old):
        new = rebalance(name, weight, slots, 1, 1, ranks, previous)
        assert new.shape == (layers, slots)
        assert_valid(new, experts, ranks)
        assert torch.equal(new, rebalance(name, weight, slots, 1, 1, ranks, previous))

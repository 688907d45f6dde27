"""Balance metrics: balancedness, rank_load and the hotness report, checked by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from eplb_graph.placement import PlacementError
from eplb_graph.policy import balancedness, expert_hotness, rank_load, rebalance_experts
from eplb_graph.policy.metrics import (
    HotnessReport,
    balancedness_of_slots,
    fold_to_ranks,
    peak_to_mean,
    rank_load_numpy,
    replica_counts_numpy,
)


def test_balancedness_by_hand():
    # layer means 2 and 2, layer maxima 3 and 2: (2 + 2) / (3 + 2)
    assert balancedness(torch.tensor([[1, 3], [2, 2]])) == pytest.approx(0.8)
    assert balancedness(torch.tensor([[5.0, 5.0, 5.0]])) == 1.0
    # Load-weighted: an idle layer adds nothing; one rank carrying everything -> 1 / ranks.
    assert balancedness(torch.tensor([[0, 0], [0, 8]])) == pytest.approx(0.5)
    assert balancedness(torch.tensor([[4, 0, 0, 0]])) == pytest.approx(0.25)


@pytest.mark.parametrize("load", [torch.zeros(0, 4), torch.zeros(3, 0), torch.zeros(2, 4)])
def test_balancedness_zero_when_empty_or_idle(load):
    assert balancedness(load) == 0.0


def test_balancedness_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"\[L, ranks\]"):
        balancedness(torch.ones(4))


def test_rank_load_splits_replicated_experts_evenly():
    phy2log = torch.tensor([[0, 1, 0, 2], [2, 2, 1, 0]])
    load = torch.tensor([[10.0, 4.0, 6.0], [3.0, 5.0, 8.0]])
    result = rank_load(phy2log, load, 2)
    # layer 0: expert 0 twice (5 each): rank0 = 5 + 4, rank1 = 5 + 6
    # layer 1: expert 2 twice (4 each) on rank0, rank1 = 5 + 3
    assert result.tolist() == [[9.0, 11.0], [8.0, 8.0]]
    assert result.dtype == torch.float64
    assert torch.allclose(result.sum(dim=1), load.sum(dim=1).double())


def test_rank_load_validates_shapes():
    with pytest.raises(ValueError, match="cannot be split"):
        rank_load(torch.tensor([[0, 1, 2]]), torch.ones(1, 3), 2)
    with pytest.raises(ValueError, match="same L"):
        rank_load(torch.tensor([[0, 1]]), torch.ones(2, 2), 1)


def _slot_balancedness_as_first_written(physical: torch.Tensor, num_ranks: int) -> float:
    """The executed-load formula as the controller, simulator and demo each wrote it."""
    per_rank = physical.to(torch.float64).reshape(physical.shape[0], num_ranks, -1).sum(dim=2)
    peak = float(per_rank.max(dim=1).values.sum())
    return 0.0 if peak == 0.0 else float(per_rank.mean(dim=1).sum()) / peak


@pytest.mark.parametrize(("layers", "slots", "ranks"), [(1, 4, 2), (3, 20, 4), (58, 320, 64)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_balancedness_of_slots_is_bit_identical_to_the_formula(layers, slots, ranks, dtype):
    generator = torch.Generator().manual_seed(layers * 1000 + slots)
    for _ in range(20):
        physical = torch.randint(0, 50_000, (layers, slots), generator=generator).to(dtype)
        if dtype == torch.float64:
            physical = physical / 7.0
        expected = _slot_balancedness_as_first_written(physical, ranks)
        assert balancedness_of_slots(physical, ranks) == expected  # bit for bit
    assert balancedness_of_slots(torch.zeros(layers, slots, dtype=dtype), ranks) == 0.0


def test_fold_to_ranks_sums_each_rank_block():
    physical = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 1]])
    assert fold_to_ranks(physical, 3).tolist() == [[3.0, 7.0, 11.0], [0.0, 0.0, 8.0]]
    assert fold_to_ranks(physical, 3).dtype == torch.float64
    assert balancedness_of_slots(physical, 1) == 1.0
    with pytest.raises(PlacementError, match="cannot be split"):
        fold_to_ranks(physical, 4)
    with pytest.raises(ValueError, match=r"\[L, P\]"):
        fold_to_ranks(torch.ones(6), 3)


def test_numpy_rank_load_matches_torch():
    rng = np.random.default_rng(3)
    phy2log = np.stack([rng.permutation(np.arange(12) % 9) for _ in range(5)])
    load = rng.integers(0, 1000, size=(5, 9)).astype(np.float64)
    expected = rank_load(torch.from_numpy(phy2log), torch.from_numpy(load), 4).numpy()
    np.testing.assert_allclose(rank_load_numpy(phy2log, load, 4), expected, rtol=1e-15)
    counts = replica_counts_numpy(phy2log, 10)
    assert counts.dtype == np.int64 and counts.shape == (5, 10)
    assert (counts.sum(axis=1) == 12).all() and (counts[:, 9] == 0).all()


def test_peak_to_mean_idle_layer_is_one():
    assert peak_to_mean(torch.tensor([[1.0, 3.0], [0.0, 0.0]])).tolist() == [1.5, 1.0]


def test_expert_hotness_report():
    load = torch.tensor([[90.0, 10.0, 10.0, 10.0], [40.0, 40.0, 10.0, 10.0]])
    current = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])  # 2 ranks, 2 slots each
    updated = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 3]])
    report = expert_hotness(current, updated, load, 2)
    assert isinstance(report, HotnessReport)
    # current: layer0 ranks [100, 20] (p2m 100/60), layer1 [80, 20] (p2m 80/50)
    assert report.current_peak_to_mean_mean == pytest.approx((100 / 60 + 80 / 50) / 2)
    assert report.current_peak_to_mean_max == pytest.approx(100 / 60)
    assert report.current_balancedness == pytest.approx((60 + 50) / (100 + 80))
    # updated: layer0 unchanged, layer1 [50, 50]
    assert report.updated_peak_to_mean_mean == pytest.approx((100 / 60 + 1.0) / 2)
    assert report.updated_peak_to_mean_max == pytest.approx(100 / 60)
    assert report.updated_balancedness == pytest.approx((60 + 50) / (100 + 50))
    as_dict = report.as_dict()
    assert set(as_dict) == {f.name for f in dataclasses.fields(HotnessReport)}
    assert all(isinstance(value, float) for value in as_dict.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.updated_balancedness = 0.0  # type: ignore[misc]


def test_rebalance_improves_hotness_on_skewed_load():
    generator = torch.Generator().manual_seed(0)
    load = torch.rand(4, 32, generator=generator) ** 4 * 1000
    identity = torch.arange(40).remainder(32).expand(4, -1)
    planned = rebalance_experts(load, 40, 1, 1, 8)[0]
    report = expert_hotness(identity, planned, load, 8)
    assert report.updated_balancedness > report.current_balancedness
    assert report.updated_peak_to_mean_max <= report.current_peak_to_mean_max

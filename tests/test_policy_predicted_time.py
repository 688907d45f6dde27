"""The packer by predicted time packs every layer and budget at once: it must give exactly what
the rule it implements gives one layer and one budget at a time (ties included), and stay valid.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_graph.control.cost_model import ExpertCostModel
from eplb_graph.placement import Placement
from eplb_graph.policy.predicted_time import _budgets, pack_by_predicted_time


def _one_layer_reference(load, num_slots, num_ranks, cap, model) -> np.ndarray:
    """The rule written plainly for one layer: per budget, replicas to the most rows per copy,
    leftover slots to the coldest; slots longest first (ties by expert) to the least loaded open
    rank (ties by rank) that lacks the expert; the first budget that is fastest by 1e-9 µs."""
    best = None
    for budget in _budgets(num_slots - load.shape[0]):
        copies = np.ones(load.shape[0], dtype=np.int64)
        for _ in range(budget):
            per_copy = [load[e] / copies[e] if copies[e] < cap else -1.0 for e in range(len(load))]
            expert = int(np.argmax(per_copy))
            if per_copy[expert] < 0:
                break
            copies[expert] += 1
        coldest = sorted(range(len(load)), key=lambda e: (load[e], e))
        left = num_slots - int(copies.sum())
        while left:
            room = [e for e in coldest if copies[e] < cap] or coldest
            for expert in room[:left]:
                copies[expert] += 1
            left -= min(left, len(room))
        slots = [(e, load[e] / copies[e]) for e in range(len(load)) for _ in range(copies[e])]
        cost = {e: model.row_us * r + model.read_us * (1 - np.exp(-r)) for e, r in slots}
        slots.sort(key=lambda item: (-cost[item[0]], item[0]))
        per_rank = num_slots // num_ranks
        time, members = [0.0] * num_ranks, [[] for _ in range(num_ranks)]
        for expert, _ in slots:
            open_ranks = [r for r in range(num_ranks) if len(members[r]) < per_rank]
            allowed = [r for r in open_ranks if expert not in members[r]] or open_ranks
            rank = min(allowed, key=lambda r: (time[r], r))
            time[rank] += cost[expert]
            members[rank].append(expert)
        peak = max(time) + model.fixed_us
        if best is None or peak < best[0] - 1e-9:
            best = (peak, [e for rank in members for e in sorted(rank)])
    return np.array(best[1])


def _case(seed: int):
    rng = np.random.default_rng(seed)
    ranks = int(rng.choice([1, 2, 3, 4, 8]))
    logical = int(rng.integers(1, 40))
    slots = -(-(logical + int(rng.integers(0, 3 * ranks + 1))) // ranks) * ranks
    layers = int(rng.integers(1, 4))
    kind = seed % 4
    if kind == 0:
        load = rng.random((layers, logical)) * 10
    elif kind == 1:
        load = rng.zipf(1.5, (layers, logical)).astype(float)
    elif kind == 2:
        load = np.full((layers, logical), 2.0)  # every slot ties
    else:
        load = rng.integers(0, 3, (layers, logical)).astype(float)  # many ties
    model = ExpertCostModel(
        fixed_us=float(rng.random() * 100),
        row_us=float(rng.random() * 100),
        read_us=float(rng.random() * 300),
        samples=10,
        fit_error=0.1,
    )
    return load, slots, ranks, int(rng.integers(1, 6)), model


@pytest.mark.parametrize("seed", range(60))
def test_packing_all_layers_at_once_equals_the_rule_one_layer_at_a_time(seed):
    load, slots, ranks, cap, model = _case(seed)
    packed = pack_by_predicted_time(torch.tensor(load), slots, ranks, cap, model)
    Placement(packed, load.shape[1], ranks)  # valid: every expert placed, slots per rank equal
    for layer in range(load.shape[0]):
        expected = _one_layer_reference(load[layer], slots, ranks, min(cap, ranks), model)
        assert packed[layer].tolist() == expected.tolist()


def test_no_rank_holds_two_copies_of_an_expert_while_another_rank_has_room():
    load = torch.tensor([[50.0, 40.0, 1.0, 1.0]])
    model = ExpertCostModel(fixed_us=0.0, row_us=1.0, read_us=0.0, samples=1, fit_error=0.0)
    packed = pack_by_predicted_time(load, 8, 4, 4, model)
    for rank in range(4):
        local = packed[0, 2 * rank : 2 * rank + 2].tolist()
        assert len(set(local)) == 2, packed


def test_bad_shapes_are_refused_before_any_work():
    model = ExpertCostModel(fixed_us=0.0, row_us=1.0, read_us=1.0, samples=1, fit_error=0.0)
    with pytest.raises(ValueError, match="cannot hold"):
        pack_by_predicted_time(torch.ones(2, 8), 9, 2, 2, model)
    with pytest.raises(ValueError, match=r"\[L, N\]"):
        pack_by_predicted_time(torch.ones(8), 8, 2, 2, model)

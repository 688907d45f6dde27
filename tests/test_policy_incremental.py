"""The few priced moves from the committed placement (``improve_by_moves``).

What must hold: the result is a valid placement under the same rules as every policy (every
expert kept, at most ``cap`` copies, never two copies on one rank); it is never predicted slower
than the committed one and, when it moves anything, its saving over the horizon exceeds its
copies' cost; a horizon too short to repay one copy leaves the placement as it is; and where a
fresh packing reaches a fast placement by moving many slots, the moves reach it with fewer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_graph.control.cost_model import ExpertCostModel, predict_rank_us, predicted_step_us
from eplb_graph.placement import Placement
from eplb_graph.policy.incremental import improve_by_moves, reach_by_moves
from eplb_graph.policy.predicted_time import pack_by_predicted_time
from eplb_graph.policy.preserve import preserve_slots, relabel_ranks, transfers_needed

READS = ExpertCostModel(fixed_us=550.0, row_us=77.0, read_us=260.0, samples=100, fit_error=0.0)
ROWS = ExpertCostModel(fixed_us=50.0, row_us=20.0, read_us=1.0, samples=100, fit_error=0.0)
COPY_US = 31_000.0


def _hot_on_rank_zero(num_layers: int = 3, rows: float = 32.0) -> torch.Tensor:
    """Experts 8-15 take 8x the rows of the others; the default layout puts them on rank 0."""
    load = torch.full((num_layers, 32), 1.0, dtype=torch.float64)
    load[:, 8:16] = 8.0
    return load * rows / load[0].sum()


def _net_ms(committed, plan, per_step, ranks, model, horizon) -> float:
    saving = predicted_step_us(committed, per_step, ranks, model) - predicted_step_us(
        plan, per_step, ranks, model
    )
    copies = int(transfers_needed(committed, plan, ranks).sum())
    return (saving * horizon - copies * COPY_US) / 1e3


def _check_rules(plan: torch.Tensor, num_logical: int, ranks: int, cap: int) -> None:
    Placement(plan, num_logical, ranks)  # every expert has a slot
    table = plan.numpy()
    for row in table:
        assert np.bincount(row, minlength=num_logical).max() <= cap
        for block in row.reshape(ranks, -1):
            assert len(set(block.tolist())) == len(block), "two copies on one rank"


@pytest.mark.parametrize("model", [READS, ROWS], ids=["reads", "rows"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_moves_keep_the_rules_and_only_those_that_repay(model, ranks):
    generator = torch.Generator().manual_seed(ranks)
    for trial in range(12):
        slots = 32 + 8 * (trial % 2) if ranks == 2 else 40
        committed = Placement.default(3, 32, slots - 32, ranks).phy2log
        per_step = torch.rand(3, 32, generator=generator, dtype=torch.float64) ** 3
        per_step *= (8, 64, 512)[trial % 3] / per_step.sum(dim=1, keepdim=True)
        for horizon in (64, 3000):
            plan = improve_by_moves(committed, per_step, ranks, 3, model, COPY_US, horizon)
            _check_rules(plan, 32, ranks, min(3, ranks))
            net = _net_ms(committed, plan, per_step, ranks, model, horizon)
            if torch.equal(plan, committed):
                assert net == 0
            else:
                assert net > 0


def test_a_horizon_too_short_for_one_copy_moves_nothing():
    committed = Placement.default(3, 32, 8, 2).phy2log
    per_step = _hot_on_rank_zero()
    plan = improve_by_moves(committed, per_step, 2, 9, READS, COPY_US, 1)
    assert torch.equal(plan, committed)
    assert plan.data_ptr() != committed.data_ptr()  # a new table, the committed one untouched


def test_moves_reach_the_packers_speed_with_fewer_copies():
    committed = Placement.default(3, 32, 8, 2).phy2log
    per_step = _hot_on_rank_zero()
    packed = pack_by_predicted_time(per_step, 40, 2, 9, READS)
    packed = preserve_slots(committed, relabel_ranks(committed, packed, 2), 2)
    moved = improve_by_moves(committed, per_step, 2, 9, READS, COPY_US, 3000)
    pack_copies = int(transfers_needed(committed, packed, 2).sum())
    move_copies = int(transfers_needed(committed, moved, 2).sum())
    assert move_copies < pack_copies * 0.8
    assert predicted_step_us(moved, per_step, 2, READS) <= 1.01 * predicted_step_us(
        packed, per_step, 2, READS
    )
    # Both move the hot experts off rank 0: rank 0 keeps fewer of them than it had (8).
    assert int((moved[:, :20] >= 8).logical_and(moved[:, :20] < 16).sum(dim=1).max()) < 8


def test_two_tied_busiest_ranks_are_both_worked_down():
    """Ranks 0 and 1 carry the same hot load: one move cannot lower the maximum, two can."""
    ranks = 4
    committed = torch.arange(32).reshape(1, 32)  # 8 experts per rank, no spare copies
    per_step = torch.full((1, 32), 0.5, dtype=torch.float64)
    per_step[0, :4] = per_step[0, 8:12] = 6.0  # four hot experts on each of ranks 0 and 1
    plan = improve_by_moves(committed, per_step, ranks, 1, ROWS, 1.0, 1000)
    before = predicted_step_us(committed, per_step, ranks, ROWS)
    assert predicted_step_us(plan, per_step, ranks, ROWS) < 0.8 * before
    moved_from = [int((plan[0, 8 * r : 8 * r + 8] != committed[0, 8 * r : 8 * r + 8]).sum())
                  for r in range(ranks)]  # fmt: skip
    assert moved_from[0] > 0 and moved_from[1] > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"per_step": torch.ones(2, 32)}, "must be"),
        ({"num_ranks": 3}, "do not split"),
        ({"copy_us": 0.0}, "positive"),
        ({"horizon_steps": 0}, "positive"),
    ],
)
def test_bad_input_is_refused_before_any_search(change, message):
    arguments = {
        "committed": Placement.default(3, 32, 8, 2).phy2log,
        "per_step": _hot_on_rank_zero(),
        "num_ranks": 2,
        "max_replicas": 9,
        "model": READS,
        "copy_us": COPY_US,
        "horizon_steps": 64,
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        improve_by_moves(**arguments)


def _hot(*experts: range, num_layers: int = 3) -> torch.Tensor:
    """Rows per step: 0.5 per expert, 10 more spread over each hot set."""
    load = torch.full((num_layers, 32), 0.5, dtype=torch.float64)
    for hot in experts:
        load[:, list(hot)] += 10.0 / len(experts)
    return load


def _layer_peaks(plan: torch.Tensor, per_step: torch.Tensor, model) -> np.ndarray:
    return predict_rank_us(plan, per_step, 2, model).max(axis=1)


def test_reaching_the_starts_speed_takes_fewer_copies_than_going_back_to_it():
    """Tuned for one domain's hot experts, then the other's, then both at once (where the
    start is even): a few moves make every layer as fast as the start's; going back moves every
    slot the two domains tuned."""
    start = Placement.default(3, 32, 8, 2).phy2log
    code, chat, mixed = _hot(range(8, 16)), _hot(range(24, 32)), _hot(range(8, 16), range(24, 32))
    leftover = improve_by_moves(start, code, 2, 9, ROWS, 100.0, 3000)
    leftover = improve_by_moves(leftover, chat, 2, 9, ROWS, 100.0, 3000)
    assert (_layer_peaks(leftover, mixed, ROWS) > 1.05 * _layer_peaks(start, mixed, ROWS)).all()
    near = reach_by_moves(leftover, mixed, start, 2, 9, ROWS)
    _check_rules(near, 32, 2, 2)
    assert (_layer_peaks(near, mixed, ROWS) <= _layer_peaks(start, mixed, ROWS) + 1e-6).all()
    copies = int(transfers_needed(leftover, near, 2).sum())
    home = int(transfers_needed(leftover, start, 2).sum())
    assert 0 < copies <= home / 2


@pytest.mark.parametrize("model", [READS, ROWS], ids=["reads", "rows"])
def test_reaching_a_target_keeps_the_rules_and_each_layer_as_fast_as_the_targets(model):
    generator = torch.Generator().manual_seed(5)
    target = Placement.default(3, 32, 8, 2).phy2log
    for _ in range(12):
        tuned = torch.rand(3, 32, generator=generator, dtype=torch.float64) ** 3 * 20
        committed = improve_by_moves(target, tuned, 2, 2, model, 1.0, 10_000)
        committed[1] = target[1]  # a layer already there is left alone
        per_step = torch.rand(3, 32, generator=generator, dtype=torch.float64) ** 3 * 20
        near = reach_by_moves(committed, per_step, target, 2, 2, model)
        _check_rules(near, 32, 2, 2)
        assert torch.equal(near[1], target[1])
        peaks, goal = _layer_peaks(near, per_step, model), _layer_peaks(target, per_step, model)
        assert (peaks <= goal * (1 + 1e-9)).all()
        # A layer no slower than the target's already is not touched.
        already = _layer_peaks(committed, per_step, model) <= goal * (1 + 1e-9)
        assert torch.equal(near[torch.from_numpy(already)], committed[torch.from_numpy(already)])


def test_reaching_a_target_of_another_shape_is_refused():
    start = Placement.default(3, 32, 8, 2).phy2log
    with pytest.raises(ValueError, match="committed"):
        reach_by_moves(start, _hot(range(8, 16)), start[:2], 2, 9, ROWS)


def test_a_layer_the_moves_cannot_bring_there_takes_the_targets_row():
    """Expert 0 carries the layer. The target splits it over both ranks; from a placement
    holding it once, with one copy per expert allowed to the moves, only swaps are left, and
    a swap moves the hot expert's rows without splitting them."""
    committed = torch.tensor([[0, 1, 2, 3, 1, 2]])
    target = torch.tensor([[0, 1, 2, 3, 0, 2]])
    per_step = torch.tensor([[10.0, 0.1, 0.1, 0.1]], dtype=torch.float64)
    assert improve_by_moves(committed, per_step, 2, 1, ROWS, 1.0, 10**6).equal(committed)
    assert torch.equal(reach_by_moves(committed, per_step, target, 2, 1, ROWS), target)
    # Allowed a second copy, one move splits it: the rest of the layer stays where it was.
    near = reach_by_moves(committed, per_step, target, 2, 2, ROWS)
    assert int(transfers_needed(committed, near, 2).sum()) == 1

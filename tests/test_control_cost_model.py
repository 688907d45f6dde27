"""The expert cost model, the packer by predicted time, the serving feedback and the payback gate.

What must hold: the fit recovers a known kernel's coefficients and never goes negative; moments
summed over ranks fit the same model as the pooled calls (so every rank plans alike); a replica
that receives rows costs a weight read on its rank, one that receives none costs nothing; where
weight reads dominate, the placement by predicted time keeps fewer replicas than the count-based
plan and is predicted faster; a plan is applied only if it repays its move (going back and
following a load that changes: ``tests/test_control_gate.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_graph import RuntimeSettings
from eplb_graph.arguments import SettingsError
from eplb_graph.control.cost_model import (
    AGE_FROM,
    MIN_SAMPLES,
    CostMoments,
    ExpertCostModel,
    lower_bound_step_us,
    predict_rank_us,
    predicted_step_us,
)
from eplb_graph.control.feedback import (
    REFERENCE_STEPS,
    WARMUP_STEPS,
    ServingFeedback,
    WindowFeedback,
    feedback_size,
)
from eplb_graph.control.payback import PaybackGate
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.refusal import MAX_UNPRICED
from eplb_graph.control.window import WindowLoad
from eplb_graph.placement import Placement
from eplb_graph.policy import rebalance
from eplb_graph.policy.predicted_time import pack_by_predicted_time
from eplb_graph.policy.preserve import preserve_slots, relabel_ranks, transfers_needed
from tests.gate_inputs import RANKS, READS, ROWS, kernel_calls

_calls = kernel_calls


def test_fit_recovers_the_coefficients_of_a_known_kernel():
    moments = CostMoments()
    moments.add(*_calls(READS, 200))
    fitted = ExpertCostModel.fit(moments.values)
    assert fitted.fixed_us == pytest.approx(50.0, abs=1.0)
    assert fitted.row_us == pytest.approx(2.0, abs=0.01)
    assert fitted.read_us == pytest.approx(200.0, abs=0.1)
    assert fitted.fit_error < 0.01


def test_fit_never_returns_negative_coefficients_and_needs_enough_calls():
    moments = CostMoments()
    rows = np.arange(1, 40)
    moments.add(rows, np.ones_like(rows), 1000 - 10 * rows)  # time falls with rows: noise
    fitted = ExpertCostModel.fit(moments.values)
    assert min(fitted.fixed_us, fitted.row_us, fitted.read_us) >= 0.0
    few = CostMoments()
    few.add([1, 2], [1, 1], [10, 20])
    assert ExpertCostModel.fit(few.values) is None


def test_moments_summed_over_ranks_fit_the_pooled_calls():
    first, second, pooled = CostMoments(), CostMoments(), CostMoments()
    calls_a, calls_b = _calls(ROWS, 50, seed=1), _calls(ROWS, 70, seed=2)
    first.add(*calls_a)
    second.add(*calls_b)
    pooled.add(*(np.concatenate(pair) for pair in zip(calls_a, calls_b, strict=True)))
    assert torch.equal(first.values + second.values, pooled.values)
    assert ExpertCostModel.fit(first.values + second.values) == ExpertCostModel.fit(pooled.values)


def test_a_replica_costs_a_weight_read_only_where_rows_reach_it():
    # 4 experts, 6 slots on 2 ranks: expert 0 hot (8 rows/step), expert 3 never routed.
    per_step = torch.tensor([[8.0, 1.0, 1.0, 0.0]])
    hot_replica = torch.tensor([[0, 1, 3, 0, 2, 3]])  # rank 1: a copy of expert 0, and 2, 3
    idle_slots = torch.tensor([[0, 1, 3, 2, 3, 3]])  # rank 1: expert 2 and two idle slots of 3
    hot = predict_rank_us(hot_replica, per_step, RANKS, READS)
    idle = predict_rank_us(idle_slots, per_step, RANKS, READS)
    # Slots of a never-routed expert cost nothing: rank 1 is expert 2's one row and read.
    assert idle[0, 1] == pytest.approx(
        READS.fixed_us + READS.row_us + READS.read_us * (1 - np.exp(-1))
    )
    # The hot expert's replica takes 4 rows a step on rank 1: 4 rows and (almost always) a read.
    assert hot[0, 1] - idle[0, 1] == pytest.approx(
        4 * READS.row_us + READS.read_us * (1 - np.exp(-4))
    )


def _skewed(num_layers: int = 2, scale: float = 1.0) -> torch.Tensor:
    ranks = torch.arange(32, dtype=torch.float64)
    return (scale * (ranks + 1) ** -1.2).repeat(num_layers, 1)


@pytest.mark.parametrize("model", [READS, ROWS], ids=["reads_dominate", "rows_dominate"])
def test_packing_by_predicted_time_is_never_predicted_slower_than_the_count_plan(model):
    per_step = _skewed(scale=40.0)
    counts_plan = rebalance("default", per_step, 40, 1, 1, RANKS)
    packed = pack_by_predicted_time(per_step, 40, RANKS, 9, model)
    Placement(packed, 32, RANKS)  # a valid placement
    assert predicted_step_us(packed, per_step, RANKS, model) <= predicted_step_us(
        counts_plan, per_step, RANKS, model
    ) * (1 + 1e-9)


def test_where_weight_reads_dominate_the_packer_keeps_fewer_hot_replicas():
    per_step = _skewed(scale=4.0)  # a small decode batch: a few rows per expert per step
    packed = pack_by_predicted_time(per_step, 40, RANKS, 9, READS)
    counts_plan = rebalance("default", per_step, 40, 1, 1, RANKS)

    def hot_copies(table):
        return int((table[0] < 8).sum())

    assert hot_copies(packed) < hot_copies(counts_plan)
    assert predicted_step_us(packed, per_step, RANKS, READS) < predicted_step_us(
        counts_plan, per_step, RANKS, READS
    )


def _moments() -> torch.Tensor:
    moments = CostMoments()
    moments.add(*_calls(READS, 100))
    return moments.values


def _feedback(**changes) -> torch.Tensor:
    """A reduced feedback vector of 2 ranks with a fitted READS model (10 recorded steps)."""
    moments = CostMoments()
    moments.values += _moments()
    epoch = {"previous": [0, 0, 0], "current": [40, 40 * 10_000, 40 * 8]}
    epoch.update({k: v for k, v in changes.items() if k in epoch})
    for name, figures in epoch.items():  # Σ squares: every step at the mean unless given
        if len(figures) == 3:
            steps, micros = figures[0], figures[1]
            epoch[name] = [*figures, int(steps * (micros / steps / 10) ** 2) if steps else 0]
    head = [2, changes.get("recorded", 10), 1]
    tail = [
        2 * changes.get("epoch", 0),
        2 * changes.get("extra_us", 0),
        2 * changes.get("moved", 0),
        2 * changes.get("moved_all", changes.get("moved", 0)),
    ]
    window = [2 * changes.get("window_steps", 0), 0, *changes.get("expert_us", (0, 0))]
    return torch.tensor(
        head + moments.values.tolist() + epoch["previous"] + epoch["current"] + tail + window,
        dtype=torch.int64,
    )


def _load(committed: torch.Tensor, logical: torch.Tensor, vector: torch.Tensor) -> WindowLoad:
    return WindowLoad(
        step=100,
        logical=logical.round().to(torch.int64).unsqueeze(0),
        physical=torch.zeros(committed.shape, dtype=torch.int64),
        committed=committed,
        feedback=WindowFeedback.parse(vector),
    )


def test_feedback_vector_round_trip():
    parsed = WindowFeedback.parse(_feedback(epoch=3, extra_us=500, moved=4))
    assert len(_feedback()) == feedback_size(RANKS)
    assert (parsed.ranks, parsed.recorded_steps, parsed.steps_per_rank) == (2, 10, 10.0)
    assert (parsed.epoch_index, parsed.movement_extra_us, parsed.movement_steps) == (3, 500, 4)
    assert parsed.current.mean_step_us == 10_000 and parsed.current.mean_tokens == 8


def test_gate_applies_the_plan_that_repays_most_and_keeps_when_none_repays():
    committed = Placement.default(2, 32, 8, RANKS).phy2log
    per_step = _skewed(scale=40.0) * 4  # the default layout puts the hot experts on rank 0
    load = _load(committed, per_step * 10, _feedback())
    long = PaybackGate(RANKS, 40, 9, step_interval=100_000)
    plan = long.decide(load, None)
    assert plan is not None and not torch.equal(plan, committed)
    applied = long.decisions[-1]
    assert applied["action"] == "applied" and applied["saving_ms_per_step"] > 0
    assert applied["net_ms"] > 0
    # The fastest placement's own copies, and the horizon at which they no longer repay.
    packed = pack_by_predicted_time(per_step, 40, RANKS, 9, READS)
    packed = preserve_slots(committed, relabel_ranks(committed, packed, RANKS), RANKS)
    pack_copies = int(transfers_needed(committed, packed, RANKS).sum())
    pack_saving_ms = (
        predicted_step_us(committed, per_step, RANKS, READS)
        - predicted_step_us(packed, per_step, RANKS, READS)
    ) / 1e3
    copy_ms = applied["cost_ms"] / applied["copies"]
    horizon = int(pack_copies * copy_ms / pack_saving_ms)
    # There, a few of the moves still repay: the gate applies them, not nothing.
    short = PaybackGate(RANKS, 40, 9, step_interval=horizon)
    assert short.decide(load, None) is not None
    cheap = short.decisions[-1]
    assert cheap["candidate"] == "fewest_moves" and 0 < cheap["copies"] < pack_copies
    assert cheap["saving_ms_per_step"] * horizon > cheap["cost_ms"]
    # Shorter still, nothing repays its copies (though the floor says one copy might).
    shorter = PaybackGate(RANKS, 40, 9, step_interval=horizon // 8)
    assert shorter.decide(load, None) is None
    assert shorter.decisions[-1]["reason"] == "the saving does not repay the move"
    assert shorter.decisions[-1]["net_ms"] <= 0


def test_gate_keeps_without_planning_when_no_placement_can_repay_one_copy():
    committed = Placement.default(2, 32, 8, RANKS).phy2log
    per_step = _skewed(scale=40.0) * 4
    asked = []

    def policy_plan():
        asked.append(True)
        return rebalance("default", (per_step * 10).round().to(torch.int64), 40, 1, 1, RANKS)

    gate = PaybackGate(RANKS, 40, 9, step_interval=1)
    assert gate.decide(_load(committed, per_step * 10, _feedback()), policy_plan) is None
    kept = gate.decisions[-1]
    assert kept["reason"] == "no placement can repay a move" and not asked
    assert 0 < kept["saving_bound_ms_per_step"] < kept["copy_ms"]
    # With a horizon long enough, the same gate asks the policy and plans.
    gate = PaybackGate(RANKS, 40, 9, step_interval=100_000)
    assert gate.decide(_load(committed, per_step * 10, _feedback()), policy_plan) is not None
    assert asked == [True]


@pytest.mark.parametrize("model", [READS, ROWS], ids=["reads", "rows"])
def test_the_floor_is_below_every_placements_predicted_step(model):
    generator = torch.Generator().manual_seed(3)
    for trial in range(20):
        per_step = torch.rand(3, 32, generator=generator) ** 4 * (1 + trial)
        floor = lower_bound_step_us(per_step, RANKS, model, num_slots=40, max_replicas=9)
        assert floor >= lower_bound_step_us(per_step, RANKS, model)
        layouts = [
            Placement.default(3, 32, 8, RANKS).phy2log,
            pack_by_predicted_time(per_step, 40, RANKS, 9, model),
            rebalance("default", (per_step * 100).round().to(torch.int64), 40, 1, 1, RANKS),
        ]
        layouts += [torch.randint(0, 32, (3, 40), generator=generator) for _ in range(5)]
        for layout in layouts:
            layout[:, :32] = torch.stack([torch.randperm(32, generator=generator)] * 3)
            assert floor <= predicted_step_us(layout, per_step, RANKS, model) + 1e-6
    # A perfectly even layout reaches the floor: the bound is tight where nothing can be saved.
    even = torch.full((1, 32), 3.0)
    layout = torch.arange(32).unsqueeze(0)
    assert predicted_step_us(layout, even, RANKS, READS) == pytest.approx(
        lower_bound_step_us(even, RANKS, READS)
    )


def test_the_floor_counts_the_reads_of_the_copies_every_slot_forces():
    # A uniform load of 1 row per expert per step: 32 experts in 40 slots, so 8 slots hold
    # extra copies, whatever the placement. The floor from one copy per expert sits below every
    # such placement by those copies' reads; counting them, it is the best placement exactly
    # (the extra copies piled onto as few experts as the cap allows, alike on both ranks).
    even = torch.full((1, 32), 1.0)
    one_copy_floor = lower_bound_step_us(even, RANKS, READS)
    floor = lower_bound_step_us(even, RANKS, READS, num_slots=40, max_replicas=5)
    piled = [*range(16), 0, 0, 0, 0, *range(16, 32), 16, 16, 16, 16]
    best = predicted_step_us(torch.tensor([piled]), even, RANKS, READS)
    default = predicted_step_us(Placement.default(1, 32, 8, RANKS).phy2log, even, RANKS, READS)
    assert one_copy_floor < floor < default
    assert best == pytest.approx(floor)
    # A wider cap only lowers the floor (the chord to more copies is flatter), never above it.
    assert lower_bound_step_us(even, RANKS, READS, num_slots=40, max_replicas=9) <= floor
    with pytest.raises(ValueError, match="cannot hold"):
        lower_bound_step_us(even, RANKS, READS, num_slots=30)


def test_gate_does_not_plan_a_uniform_load_where_only_forced_copies_differ():
    # The default layout's 8 extra copies cost reads almost no placement avoids: the most any
    # placement could save per step, over the horizon, does not pay for one copy, so the policy
    # is never asked.
    committed = Placement.default(2, 32, 8, RANKS).phy2log
    asked = []
    gate = PaybackGate(RANKS, 40, 5, step_interval=16, copy_bytes=3 << 20)
    kept = gate.decide(
        _load(committed, torch.full((2, 32), 10.0), _feedback()), lambda: asked.append(1)
    )
    assert kept is None and not asked
    decision = gate.decisions[-1]
    assert decision["reason"] == "no placement can repay a move"
    assert 0 < decision["saving_bound_ms_per_step"] * 16 < decision["copy_ms"]


def _refusing_horizon(committed: torch.Tensor, load: WindowLoad) -> int:
    """The first horizon (powers of 2) at which the gate prices candidates and none repays."""
    for power in range(20):
        gate = PaybackGate(RANKS, 40, 9, step_interval=2**power)
        gate.decide(load, None)
        if gate.decisions[-1]["reason"] == "the saving does not repay the move":
            return 2**power
    raise AssertionError("no horizon refuses after pricing")


def _halve_copy_price(gate: PaybackGate) -> None:
    price = gate.ledger.copy_us
    gate.ledger.copy_us = lambda read_us: (price(read_us)[0] / 2, "measured")


def test_a_refused_window_is_priced_again_only_when_something_changed():
    committed = Placement.default(2, 32, 8, RANKS).phy2log
    per_step = _skewed(scale=40.0) * 4
    load = _load(committed, per_step * 10, _feedback())
    gate = PaybackGate(RANKS, 40, 9, step_interval=_refusing_horizon(committed, load))
    asked = []

    def policy_plan():
        asked.append(1)
        return None

    reasons = []
    for _ in range(MAX_UNPRICED + 2):
        assert gate.decide(load, policy_plan) is None
        reasons.append(gate.decisions[-1]["reason"])
    # Priced, then kept on that pricing's word MAX_UNPRICED times, then priced again.
    unpriced = "nothing repaid when last priced, and the saving bound has not grown"
    priced = "the saving does not repay the move"
    assert reasons == [priced] + [unpriced] * MAX_UNPRICED + [priced]
    assert len(asked) == 2 and gate.decisions[-2]["priced_at_step"] == load.step
    # The same skew 40 times heavier (its saving bound grown past REPRICE_GROWTH times the
    # refused one's): priced at once, and here a plan repays (and saves over 5% of the step).
    skewier = _load(committed, per_step * 400, _feedback())
    assert gate.decide(skewier, policy_plan) is not None and len(asked) == 3
    # Another committed placement, or a lower copy cost: priced again too.
    for changed in (
        lambda g: _load(committed.flip(1), per_step * 10, _feedback()),
        lambda g: (_halve_copy_price(g), load)[1],
    ):
        gate = PaybackGate(RANKS, 40, 9, step_interval=_refusing_horizon(committed, load))
        gate.decide(load, None)
        gate.decide(load, None)
        assert gate.decisions[-1]["reason"] == unpriced
        gate.decide(changed(gate), None)
        assert gate.decisions[-1]["reason"] != unpriced


def test_the_history_ages_at_each_close_only_once_it_holds_enough_calls_to_fit():
    """Ageing a short history every window kept it below what fits (a small eager engine timed
    a few calls a window): it grows until it can fit, then halves at each close."""
    moments = CostMoments()
    closes = 0
    while ExpertCostModel.fit(moments.values) is None:
        moments.add(*_calls(READS, 6, seed=closes))  # 6 calls a window
        moments.age_()
        closes += 1
        assert closes < 100, "a history of 6 calls a window never fitted"
    assert moments.count >= MIN_SAMPLES
    for seed in range(100):
        moments.add(*_calls(READS, 6, seed=seed))
        moments.age_()
    # Ageing bounds the history: old calls weigh less as new ones come.
    assert MIN_SAMPLES <= moments.count < AGE_FROM


def test_serving_feedback_rolls_epochs_and_measures_in_flight_cost():
    stats = torch.zeros(2, 3, dtype=torch.int64)
    feedback = ServingFeedback(stats)
    for _ in range(4):
        stats += torch.tensor([[10, 100_000, 2], [20, 200_000, 3]])
        feedback.step(step_us=1000, tokens=4, decode=True, in_flight=False, version=0)
    assert int(feedback.moments.values[0]) == 8  # 4 steps x 2 layers
    # The worker only planned (a window it then kept): no move's cost.
    feedback.step(step_us=9000, tokens=4, decode=True, in_flight=True, version=0)
    assert (feedback.movement_extra_us, feedback.movement_steps_all) == (0, 0)
    feedback.step(step_us=5000, tokens=4, decode=True, in_flight=True, moving=True, version=1)
    assert (feedback.movement_extra_us, feedback.movement_steps) == (4000, 1)
    # Moving steps whose idle time is unknown are counted, not priced.
    feedback.step(step_us=90_000, tokens=96, decode=False, in_flight=True, moving=True, version=1)
    feedback.step(step_us=9000, tokens=8, decode=True, in_flight=True, moving=True, version=1)
    assert (feedback.movement_extra_us, feedback.movement_steps) == (4000, 1)
    assert feedback.movement_steps_all == 3
    feedback.step(step_us=900, tokens=4, decode=True, in_flight=False, version=2)
    feedback.step(step_us=1, tokens=400, decode=False, in_flight=False, version=2)  # prefill
    calls = feedback.moments.count
    parsed = WindowFeedback.parse(feedback.take(recorded_steps=6))
    assert parsed.epoch_index == 1
    assert (parsed.previous.steps, parsed.previous.mean_step_us) == (4, 1000)
    assert (parsed.current.steps, parsed.current.mean_step_us) == (1, 900)
    assert feedback.moments.count == calls  # too few calls to age at the close
    assert parsed.movement_cost_us == pytest.approx(3 * 4000)


def test_moving_steps_are_priced_signed_against_the_idle_steps_just_before():
    """Step noise cancels over a move (a faster moving step takes off what a slower one added),
    and the reference is the idle steps just served, not an epoch that began under other
    traffic; after a placement change only its own idle steps count."""
    feedback = ServingFeedback(torch.zeros(1, 3, dtype=torch.int64))
    for _ in range(100):
        feedback.step(step_us=1000, tokens=4, decode=True, in_flight=False, version=0)
    for _ in range(REFERENCE_STEPS):  # heavier traffic since: steps take twice as long
        feedback.step(step_us=2000, tokens=4, decode=True, in_flight=False, version=0)
    for micros in (2600, 1400, 2300):
        feedback.step(step_us=micros, tokens=4, decode=True, in_flight=True, moving=True, version=0)
    assert (feedback.movement_extra_us, feedback.movement_steps) == (300, 3)
    feedback.step(step_us=5000, tokens=4, decode=True, in_flight=False, version=1)
    feedback.step(step_us=5200, tokens=4, decode=True, in_flight=True, moving=True, version=1)
    assert (feedback.movement_extra_us, feedback.movement_steps) == (500, 4)


def test_rearrange_setting_is_checked_and_reaches_the_planner():
    with pytest.raises(SettingsError, match="rearrange must be"):
        RuntimeSettings(rearrange="sometimes")
    planner = PolicyPlanner("default", 40, 1, 1, RANKS, rearrange="when_it_pays", max_replicas=9)
    assert planner.gate is not None and planner.gate.max_replicas == 9
    assert PolicyPlanner("default", 40, 1, 1, RANKS).gate is None


def test_every_window_sets_the_predicted_busiest_rank_against_the_measured_one():
    committed = Placement.default(2, 32, 8, RANKS).phy2log
    per_step = _skewed(scale=40.0)
    predicted = predict_rank_us(committed, per_step, RANKS, ExpertCostModel.fit(_moments()))
    busiest = predicted.sum(axis=0)
    measured = (int(busiest[0] * 10 * 1.1), int(busiest[1] * 10))  # rank 0 10% slower
    vector = _feedback(window_steps=10, expert_us=measured)
    gate = PaybackGate(RANKS, 40, 9, step_interval=1)
    gate.decide(_load(committed, per_step * 10, vector), None)
    check = gate.accuracy[-1]
    assert check["measured_busiest_ms"] == pytest.approx(busiest.max() * 1.1 / 1e3, rel=1e-3)
    assert check["error"] == pytest.approx(1 / 1.1 - 1, rel=1e-2)
    assert gate.published["measured_rank_ms"][1] == pytest.approx(busiest[1] / 1e3, rel=1e-3)


def test_a_window_holding_a_ranks_first_steps_is_not_measured():
    stats = torch.zeros(1, 3, dtype=torch.int64)
    feedback = ServingFeedback(stats, rank=0, num_ranks=1)

    def window(steps: int) -> WindowFeedback:
        for _ in range(steps):
            stats.add_(torch.tensor([[4, 50_000, 2]]))
            feedback.step(step_us=100, tokens=1, decode=True, in_flight=False, version=0,
                          in_window=True)  # fmt: skip
        return WindowFeedback.parse(feedback.take(recorded_steps=steps))

    assert window(WARMUP_STEPS).measured_rank_us() is None  # first steps: one-off costs
    assert window(4).measured_rank_us() == [50.0]


def test_a_window_under_two_placements_is_not_checked():
    stats = torch.zeros(1, 3, dtype=torch.int64)
    feedback = ServingFeedback(stats, rank=1, num_ranks=2)
    for version in (0, 1):
        stats += torch.tensor([[4, 50_000, 2]])
        feedback.step(step_us=100, tokens=1, decode=True, in_flight=False, version=version,
                      in_window=True)  # fmt: skip
    parsed = WindowFeedback.parse(feedback.take(recorded_steps=0))
    assert parsed.window_expert_us == (0, 100) and parsed.window_mixed
    assert parsed.measured_rank_us() is None


def test_serving_feedback_leaves_out_calls_far_slower_than_the_fitted_model():
    stats = torch.zeros(2, 3, dtype=torch.int64)
    model: list[ExpertCostModel | None] = [None]
    feedback = ServingFeedback(stats, model_source=lambda: model[0])
    ordinary = torch.tensor([[10, 1_000_000, 4], [10, 1_000_000, 4]])  # 1 ms per call
    preempted = torch.tensor([[10, 1_000_000, 4], [10, 30_000_000, 4]])  # one call took 30 ms
    stats += preempted
    feedback.step(step_us=1, tokens=1, decode=True, in_flight=False, version=0)
    assert feedback.snapshot() == {"taken": 2, "dropped_outliers": 0}  # no model: all taken
    assert feedback.last_step_expert_ns == 31_000_000
    model[0] = ExpertCostModel(fixed_us=100.0, row_us=50.0, read_us=100.0, samples=64,
                               fit_error=0.0)  # fmt: skip
    stats += preempted
    feedback.step(step_us=1, tokens=1, decode=True, in_flight=False, version=0)
    assert feedback.snapshot() == {"taken": 3, "dropped_outliers": 1}
    assert feedback.last_step_expert_ns == 31_000_000  # the step's time still counts it
    stats += ordinary * 2  # twice the prediction: slow, not an outlier
    feedback.step(step_us=1, tokens=1, decode=True, in_flight=False, version=0)
    assert feedback.snapshot() == {"taken": 5, "dropped_outliers": 1}
    assert int(feedback.moments.values[0]) == 5

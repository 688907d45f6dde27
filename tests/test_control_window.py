"""Load window and step state machine (single process; multi-rank in test_control_multirank)."""

from __future__ import annotations

import pytest
import torch

import eplb_graph
from eplb_graph import RuntimeSettings
from eplb_graph.arguments import SettingsError
from eplb_graph.control import (
    EplbController,
    LoadWindow,
)
from eplb_graph.control.planning import plan_window
from eplb_graph.control.window import fold_to_logical, local_reducer, reduce_window


def _state(layers=2, experts=4, redundant=4, ranks=2) -> eplb_graph.EplbState:
    return eplb_graph.EplbState(eplb_graph.Placement.default(layers, experts, redundant, ranks))


def _logical(window: LoadWindow, num_logical: int, num_samples: int) -> torch.Tensor:
    rows, placements = window.snapshot()
    return fold_to_logical(rows, placements, num_logical, num_samples)


def _controller(state, settings, planner=lambda load: None, *, reduce=local_reducer):
    """A controller whose closed windows are reduced locally and planned, as the rebalance
    pipeline does minus movement; ``controller.plans`` collects ``(step, WindowPlan)``."""
    plans = []

    def plan_closed_window(snapshot):
        load = reduce_window(
            snapshot.copy_rows(),
            snapshot,
            snapshot.committed,
            local_reducer,
            state.num_logical,
            settings.time_samples,
        )
        plans.append((snapshot.step, plan_window(load, planner, state.num_ranks)))

    controller = EplbController(state, settings, plan_closed_window, reduce=reduce)
    controller.plans = plans
    return controller


def test_window_is_a_ring_that_counts_steps_not_recordings():
    window = LoadWindow(3, 1, 4)
    placement = torch.tensor([[0, 1, 2, 3]])
    for step in range(5):
        load = torch.full((1, 4), step + 1)
        window.fold_pass_(load, placement, recorded=step != 3)
        assert torch.count_nonzero(load) == (0 if step != 3 else 4)
    assert window.chronological_rows() == [2, 0, 1]
    assert [int(window.rows[r, 0, 0]) for r in window.chronological_rows()] == [3, 0, 5]
    assert torch.equal(window.rows.sum(dim=0), torch.full((1, 4), 8))


def test_fold_uses_the_placement_live_when_each_step_was_recorded():
    """Slot 1 held expert 1, then expert 2: its old counts must stay with expert 1."""
    window = LoadWindow(4, 1, 4)
    old = torch.tensor([[0, 1, 2, 3]])
    new = torch.tensor([[0, 2, 1, 3]])  # experts 1 and 2 swapped slots
    window.fold_pass_(torch.tensor([[0, 10, 0, 0]]), old, recorded=True)
    window.fold_pass_(torch.tensor([[0, 7, 0, 0]]), new, recorded=True)
    assert _logical(window, 4, 2).tolist() == [[[0, 10, 0, 0]], [[0, 0, 7, 0]]]
    assert _logical(window, 4, 1).tolist() == [[[0, 10, 7, 0]]]


def test_time_buckets_keep_chronological_order():
    window = LoadWindow(6, 1, 2)
    placement = torch.tensor([[0, 1]])
    for step in range(6):
        window.fold_pass_(torch.tensor([[step, 0]]), placement, recorded=True)
    assert _logical(window, 2, 3)[:, 0, 0].tolist() == [0 + 1, 2 + 3, 4 + 5]
    assert _logical(window, 2, 100).shape[0] == 6


def _run(controller: EplbController, steps: int, *, prefill_every: int = 0, load_value: int = 1):
    first = len(controller.plans)
    for step in range(steps):
        has_prefill = prefill_every > 0 and step % prefill_every == 0
        controller.begin_step(has_prefill=has_prefill, num_valid_tokens=4)
        # Stand-in for the graph: the routing op adds to the load pass iff recording is on.
        controller.state.load.add_(load_value * controller.state.record_enabled.long())
        controller.end_step()
    return controller.plans[first:]


def test_first_rearrangement_after_quarter_interval_then_every_interval():
    settings = RuntimeSettings(window_size=4, step_interval=20)
    controller = _controller(_state(), settings)
    reports = _run(controller, 65)
    assert [step for step, _ in reports] == [5, 25, 45, 65]


def test_recording_only_within_window_of_next_rearrangement():
    settings = RuntimeSettings(window_size=3, step_interval=10)
    controller = _controller(_state(), settings)
    recorded = []
    for _ in range(12):
        controller.begin_step(has_prefill=False, num_valid_tokens=1)
        recorded.append(bool(controller.state.record_enabled))
        controller.end_step()
    # Close at step 2 (10 // 4) and 12: the 3 steps before each close record.
    assert recorded == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]


@pytest.mark.parametrize("phase", ["prefill", "decode", "all"])
def test_phase_filter_zero_load_but_window_advances(phase):
    settings = RuntimeSettings(window_size=8, step_interval=32, load_collection_phase=phase)
    controller = _controller(_state(), settings)
    reports = _run(controller, 8, prefill_every=2)  # steps 0,2,4,6 prefill
    assert controller.window.steps_seen == 8
    assert len(reports) == 1  # 32 // 4 = 8: one close, whatever the phase
    report = reports[0][1]
    per_step = controller.state.num_layers * controller.state.num_slots
    expected_steps = {"prefill": 4, "decode": 4, "all": 8}[phase]
    assert int(report.load.physical.sum()) == expected_steps * per_step


def test_unknown_phase_rejected_with_choices():
    with pytest.raises(ValueError, match="load_collection_phase must be one of 'all'"):
        RuntimeSettings(load_collection_phase="chunked")


def test_no_collective_and_no_handoff_on_steps_where_nothing_is_due():
    """The controller's own reducer (balancedness log) is never called without logging, and
    exactly one snapshot is handed off per window close."""
    calls = []

    def counting_reduce(tensor):
        calls.append(tensor.numel())
        return tensor

    settings = RuntimeSettings(window_size=5, step_interval=40)
    controller = _controller(_state(), settings, reduce=counting_reduce)
    plans = _run(controller, 90)  # closes at 10, 50, 90
    assert calls == []
    assert [step for step, _ in plans] == [10, 50, 90]


def test_balancedness_logging_is_one_collective_per_interval(caplog):
    calls = []
    settings = RuntimeSettings(
        window_size=4, step_interval=100, log_balancedness=True, log_balancedness_interval=5
    )
    controller = _controller(_state(), settings, reduce=lambda t: (calls.append(t.numel()), t)[1])
    with caplog.at_level("INFO", logger="eplb_graph.control.window"):
        _run(controller, 20)
    assert len(calls) == 4
    assert controller.last_logged_balancedness == pytest.approx(1.0)
    assert "balancedness 1.0000" in caplog.text
    assert controller.snapshot()["last_logged_balancedness"] == pytest.approx(1.0)


def test_planner_sees_logical_load_of_the_real_routing_op():
    """End to end through map_and_record: the folded logical load equals the router's picks."""
    state = _state(layers=1, experts=4, redundant=4, ranks=2)
    seen = []
    settings = RuntimeSettings(window_size=4, step_interval=16, time_samples=2)
    controller = _controller(state, settings, lambda load: seen.append(load))
    generator = torch.Generator().manual_seed(0)
    expected = torch.zeros(4, dtype=torch.int64)
    for _ in range(4):
        ids = torch.randint(0, 4, (6, 2), generator=generator)
        controller.begin_step(has_prefill=False, num_valid_tokens=5)
        torch.ops.eplb_graph.map_and_record(
            ids,
            state.log2phy[0],
            state.replica_count[0],
            state.offset,
            state.load[0],
            state.num_valid_tokens,
            state.record_enabled,
        )
        expected += torch.bincount(ids[:5].flatten(), minlength=4)
        controller.end_step()
    assert len(seen) == 1
    assert torch.equal(seen[0].logical.sum(dim=0)[0], expected)
    assert seen[0].logical.shape == (2, 1, 4)


def test_window_plan_reports_balancedness_of_the_executed_slot_load():
    state = _state(layers=1, experts=2, redundant=2, ranks=2)  # slots [0 1 | 0 1]
    controller = _controller(state, RuntimeSettings(window_size=1, step_interval=4))
    controller.begin_step(has_prefill=False, num_valid_tokens=1)
    state.load[0].copy_(torch.tensor([4, 0, 1, 1]))  # rank loads 4 and 2
    controller.end_step()
    ((_, plan),) = controller.plans
    assert plan.balancedness == pytest.approx(3 / 4)


def test_controller_window_is_capped_at_the_interval():
    controller = _controller(_state(), RuntimeSettings(window_size=50, step_interval=8))
    assert controller.window.window_size == 8


def test_window_close_reports_current_and_planned_hotness():
    """A window's plan carries the peak-to-mean report of the committed placement and of the
    plan under the window's load."""
    state = _state(layers=1, experts=4, redundant=4, ranks=2)  # slots: [0 1 2 3 | 0 1 2 3]
    better = torch.tensor([[0, 1, 2, 0, 3, 0, 1, 2]])  # any valid plan to report on
    controller = _controller(
        state, RuntimeSettings(window_size=4, step_interval=8), lambda load: better
    )
    for _ in range(2):
        controller.begin_step(has_prefill=False, num_valid_tokens=4)
        ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 0]])
        torch.ops.eplb_graph.map_and_record(
            ids,
            state.log2phy[0],
            state.replica_count[0],
            state.offset,
            state.load[0],
            state.num_valid_tokens,
            state.record_enabled,
        )
        controller.end_step()
    ((_, plan),) = controller.plans
    hotness = plan.hotness
    assert set(hotness) >= {
        "current_peak_to_mean_mean",
        "updated_peak_to_mean_max",
        "current_balancedness",
        "updated_balancedness",
    }
    assert hotness["current_peak_to_mean_max"] >= 1.0
    assert hotness["updated_balancedness"] > 0.0


def test_a_rank_that_does_not_record_load_only_takes_its_steps():
    """Replicated routing: only one rank records, so the cross-rank sum counts tokens once."""
    state = _state()
    controller = _controller(state, RuntimeSettings(window_size=4, step_interval=8))
    controller.record_load = False
    plans = _run(controller, 8, load_value=3)
    assert controller.window.steps_seen == 8
    assert not bool(state.record_enabled)
    assert [int(plan.load.physical.sum()) for _, plan in plans] == [0]  # one close, step 2


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"num_nodes": 0}, "num_nodes must be >= 1"),
        ({"num_nodes": -1}, "num_nodes must be >= 1"),
        ({"num_groups": 0}, "num_groups must be >= 1"),
        ({"window_size": 10**30}, "window_size must be <="),
        ({"step_interval": True}, "step_interval must be an integer, got the boolean"),
        ({"log_balancedness": "yes"}, "log_balancedness must be True or False"),
        ({"policy": ""}, "policy must be a policy name"),
        ({"policy_options": {1: 2}}, "policy_options must be a dict"),
        ({"rebalances": 1}, "rebalances must be True or False"),
        ({"num_experts": 0}, "num_experts must be >= 1"),
        ({"num_redundant_experts": -1}, "num_redundant_experts must be >= 0"),
        ({"initial_placement": "map.json"}, "initial_placement must be a Placement"),
        ({"communicator": "nccl"}, "communicator must be 'torch_gloo'"),
        ({"layers_per_step": 0}, "layers_per_step must be >= 1"),
        ({"commit_margin_steps": 1.5}, "commit_margin_steps must be an integer"),
        ({"exchange_timeout_s": float("nan")}, "finite number of seconds"),
        ({"install_wait_s": 0}, "finite number of seconds > 0"),
        ({"staging_blocks": 0}, "staging_blocks must be >= 1"),
    ],
)
def test_runtime_settings_refuse_what_would_fail_later(keywords, match):
    with pytest.raises(SettingsError, match=match):
        RuntimeSettings(**keywords)

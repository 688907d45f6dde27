"""``min_gain_percent``: a plan that buys too little is not applied: it cannot repay its cost."""

from __future__ import annotations

import pytest
import torch

from eplb_graph import RuntimeSettings
from eplb_graph.arguments import SettingsError
from eplb_graph.control.planning import PolicyPlanner, predicted_gain
from eplb_graph.control.window import WindowLoad
from eplb_graph.placement import Placement

RANKS = 2


def _window(logical: list[list[float]]) -> WindowLoad:
    """One time bucket of logical load ``[L, N]`` against the default placement (N + 2 slots)."""
    load = torch.tensor(logical, dtype=torch.int64)
    num_layers, num_logical = load.shape
    committed = Placement.default(num_layers, num_logical, 2, RANKS).phy2log
    return WindowLoad(
        step=10,
        logical=load.unsqueeze(0),
        physical=torch.zeros(committed.shape, dtype=torch.int64),
        committed=committed,
    )


def _planner(min_gain_percent: int) -> PolicyPlanner:
    return PolicyPlanner("default", 10, 1, 1, RANKS, {}, min_gain_percent)


SKEWED = [[400, 300, 200, 100, 10, 10, 10, 10]]  # experts 0-3 on rank 0: 1000 vs 40
NEARLY_BALANCED = [[100, 100, 100, 100, 100, 100, 100, 96]]


def test_predicted_gain_is_the_share_of_the_busiest_rank_load_removed():
    window = _window(SKEWED)
    plan = _planner(0)(window)
    assert plan is not None
    gain = predicted_gain(window.committed, plan, window.logical, RANKS)
    # The default layout puts experts 0-4 on rank 0 and 5-7 plus replicas of 0 and 1 on rank 1:
    # rank 0 carries 200 + 150 + 200 + 100 + 10 = 660 of 1040 picks, rank 1 380.
    assert 0.1 < gain < 0.3
    assert predicted_gain(window.committed, window.committed, window.logical, RANKS) == 0.0


def test_a_skewed_window_is_rebalanced_at_any_threshold_it_clears():
    window = _window(SKEWED)
    gain = predicted_gain(window.committed, _planner(0)(window), window.logical, RANKS)
    assert _planner(int(100 * gain) - 1)(window) is not None
    assert _planner(int(100 * gain) + 1)(window) is None


def test_a_nearly_balanced_window_is_left_alone_with_a_threshold_and_moved_without_one():
    window = _window(NEARLY_BALANCED)
    plan = _planner(0)(window)
    assert plan is not None  # upstream behaviour: any different plan is applied
    assert predicted_gain(window.committed, plan, window.logical, RANKS) < 0.05
    assert _planner(5)(window) is None


@pytest.mark.parametrize("bad", [-1, 100, True, 2.5])
def test_min_gain_percent_out_of_range_is_a_settings_error(bad):
    with pytest.raises(SettingsError, match="min_gain_percent"):
        RuntimeSettings(min_gain_percent=bad)

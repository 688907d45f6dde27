"""The benefit curve's statistics (``tools/bench``): the pairs' confidence interval and the
verdict on the issue's goals.

What must hold: the interval is the Student-t interval of the log ratios (wide for a few noisy
pairs, narrow for many steady ones) and contains their geometric mean; the verdict takes the
skewed goals over every skewed curve (not one shape), lists every point under the ratio goal,
and calls a point slower beyond noise only when its whole interval is under the goal.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))

from bench_vllm import _benefit_verdict
from vllm_benefit import paired_interval

GOALS = {
    "decode_ratio_min": 0.99,
    "skewed_best": 1.4,
    "skewed_rows_dominate_from_64": 1.15,
    "prediction_error_max": 0.15,
}


def test_interval_is_students_t_on_the_log_ratios():
    pairs = [0.9, 1.1, 1.0, 1.05]
    logs = [math.log(p) for p in pairs]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    interval = paired_interval(pairs)
    assert interval["geomean"] == pytest.approx(math.exp(mean))
    assert interval["low"] == pytest.approx(math.exp(mean - 3.182 * sd / 2))
    assert interval["high"] == pytest.approx(math.exp(mean + 3.182 * sd / 2))
    steady = paired_interval([0.98, 0.981, 0.979, 0.98] * 10)
    assert steady["high"] < 0.99 < interval["high"]
    assert paired_interval([1.0])["low"] is None


def _row(batch: int, ratio: float, low: float, high: float, moves: int = 0) -> dict:
    return {
        "batch": batch,
        "on": {
            "decode_speedup": ratio,
            "decode_speedup_pairs": {"low": low, "high": high},
            "prediction_error": 0.01,
            "rearrangements": moves,
        },
    }


def test_verdict_over_every_skewed_curve_and_the_points_below_the_goal():
    report = {
        "goals": GOALS,
        "curves": {
            "wide/skewed": [_row(8, 1.0, 0.95, 1.05), _row(64, 1.3, 1.25, 1.35, 2)],
            "small/skewed": [_row(8, 0.985, 0.96, 1.01), _row(256, 1.42, 1.38, 1.45, 1)],
            "small/uniform": [_row(64, 0.97, 0.95, 0.985)],
        },
    }
    control = _row(8, 1.02, 0.97, 1.06)["on"]
    report["curves"]["small/skewed"][0]["off_again"] = control
    verdict = _benefit_verdict(report)
    assert verdict["skewed_best"] == ("small/skewed", 256, 1.42)
    assert verdict["skewed_from_64_min"] == ("wide/skewed", 64, 1.3)
    assert not verdict["never_slower"]
    assert [(p["curve"], p["batch"]) for p in verdict["below_goal"]] == [
        ("small/skewed", 8),
        ("small/uniform", 64),
    ]
    # With an A/A control at that point, its ratio and interval come with it.
    assert verdict["below_goal"][0]["aa_ratio"] == 1.02
    assert (verdict["below_goal"][0]["aa_low"], verdict["below_goal"][0]["aa_high"]) == (0.97, 1.06)
    assert "aa_ratio" not in verdict["below_goal"][1]
    assert [(p["curve"], p["batch"]) for p in verdict["slower_beyond_noise"]] == [
        ("small/uniform", 64)
    ]

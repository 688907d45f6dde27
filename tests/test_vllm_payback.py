"""The per-rearrangement payback ledger (``paybacks`` in the vLLM plugin's metrics files)."""

from __future__ import annotations

import pytest

from eplb_graph.integrations.vllm.payback import KEPT, PaybackLedger


class _Ledger(PaybackLedger):
    finished_seen = 0


def _feed(ledger: PaybackLedger, steps) -> None:
    """Steps as (step ms, expert ms, in flight, rearrangements finished so far)."""
    for step_ms, expert_ms, in_flight, finished in steps:
        ledger.step(step_ms / 1e3, expert_ms / 1e3, in_flight, finished - ledger.finished_seen)
        ledger.finished_seen = finished


def test_async_rearrangement_cost_and_saving():
    ledger = _Ledger()
    _feed(ledger, [(100, 60, False, 0)] * 5)
    _feed(ledger, [(150, 60, True, 0), (130, 60, True, 0), (120, 60, True, 1)])
    _feed(ledger, [(80, 40, False, 1)] * 10)
    [entry] = ledger.figures()
    assert entry["finished"] and entry["in_flight_steps"] == 3
    assert entry["cost_ms"] == pytest.approx(50 + 30 + 20)  # against the idle median before
    assert entry["step_ms_before"] == pytest.approx(100)
    assert entry["step_ms_after"] == pytest.approx(80)
    assert entry["expert_ms_before"] == pytest.approx(60)
    assert entry["expert_ms_after"] == pytest.approx(40)
    assert entry["steps_since"] == 10
    assert entry["saved_ms"] == pytest.approx(20 * 10)
    assert entry["net_ms"] == pytest.approx(200 - 100)


def test_rearrangement_that_made_steps_slower_has_negative_net():
    ledger = _Ledger()
    _feed(ledger, [(100, 50, False, 0)] * 3 + [(300, 50, True, 1)] + [(110, 55, False, 1)] * 4)
    [entry] = ledger.figures()
    assert entry["saved_ms"] == pytest.approx(-40)
    assert entry["net_ms"] == pytest.approx(-40 - 200)


def test_sync_rearrangement_ends_in_its_own_step_and_each_has_its_own_entry():
    ledger = _Ledger()
    _feed(ledger, [(100, 50, False, 0)] * 3 + [(400, 50, True, 1)])
    _feed(ledger, [(90, 45, False, 1)] * 2)
    _feed(ledger, [(500, 45, True, 2), (95, 45, False, 2)])
    first, second = ledger.figures()
    assert (first["rearrangement"], second["rearrangement"]) == (1, 2)
    assert first["finished"] and second["finished"]
    assert first["steps_since"] == 2  # counted until the next one started
    assert first["cost_ms"] == pytest.approx(300)
    assert second["step_ms_before"] == pytest.approx(90)
    assert second["cost_ms"] == pytest.approx(410)
    assert second["steps_since"] == 1


def test_back_to_back_rearrangements_without_an_idle_step_between():
    ledger = _Ledger()
    _feed(ledger, [(100, 50, False, 0), (200, 50, True, 0), (200, 50, True, 1)])
    _feed(ledger, [(200, 50, True, 1), (200, 50, True, 2), (90, 50, False, 2)])
    first, second = ledger.figures()
    assert first["in_flight_steps"] == 2 and second["in_flight_steps"] == 2
    assert first["steps_since"] == 0 and first["saved_ms"] is None
    assert second["step_ms_before"] is None  # no idle step between them
    assert second["cost_ms"] == pytest.approx(2 * 100)  # recent idle steps 100, 90: median 100


def test_no_samples_say_null_and_only_the_newest_are_kept():
    ledger = _Ledger()
    assert ledger.figures() == []
    _feed(ledger, [(200, 50, True, 0)])
    [open_entry] = ledger.figures()
    assert not open_entry["finished"] and open_entry["cost_ms"] is None
    assert open_entry["saved_ms"] is None and open_entry["net_ms"] is None
    for finished in range(1, KEPT + 5):
        _feed(ledger, [(100, 50, False, finished - 1), (150, 50, True, finished)])
    figures = ledger.figures()
    assert len(figures) == KEPT
    assert figures[-1]["rearrangement"] == KEPT + 5


def test_a_rearrangement_finished_before_timing_does_not_close_the_next_one():
    ledger = _Ledger()
    ledger.finished_seen = 1  # one finished during the untimed start-up steps
    _feed(ledger, [(100, 50, False, 1), (200, 50, True, 1), (200, 50, True, 1)])
    [entry] = ledger.figures()
    assert not entry["finished"] and entry["in_flight_steps"] == 2
    _feed(ledger, [(200, 50, True, 2), (90, 40, False, 2)])
    [entry] = ledger.figures()
    assert entry["finished"] and entry["in_flight_steps"] == 3 and entry["steps_since"] == 1

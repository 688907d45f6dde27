"""Recorded windows replayed offline give the engine's decisions (``simulate --windows``).

A planner with ``windows_path`` records every window it decides on; a fresh planner built from
the record's header, fed the same windows, must decide the same thing every time: the gate's
decisions are a function of the window sums alone.
"""

from __future__ import annotations

import json

import torch

from eplb_graph import cli
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window_record import read_windows
from eplb_graph.placement import Placement
from eplb_graph.simulate.replay import replay_windows
from tests.gate_inputs import RANKS, ROWS, Serving
from tests.test_control_gate import CHAT, CODE, MIXED, domain

DEFAULT = Placement.default(2, 32, 8, RANKS).phy2log


def _planner(path) -> PolicyPlanner:
    return PolicyPlanner("default", 40, 1, 1, RANKS, rearrange="when_it_pays", max_replicas=9,
                         step_interval=100, copy_bytes=3 << 20, windows_path=str(path))  # fmt: skip


def _record(path) -> list:
    planner = _planner(path)
    serving, committed, decisions = Serving(ROWS), DEFAULT, []
    loads = [CODE, CODE, CHAT, CHAT, MIXED, MIXED, domain(range(32)), CODE]
    for index, load in enumerate(loads):
        window = serving.window(
            committed,
            load,
            slower=1.5 if index == 3 else 1.0,
            moved_us=20_000 if index in (1, 3) else 0,
            moved_steps=4,
        )
        if index == 6:  # a window that recorded nothing: no decision on it
            window = serving.window(committed, load * 0)
        plan = planner(window)
        decisions.append(None if plan is None else plan.clone())
        committed = committed if plan is None else plan
    return decisions


def test_a_replay_of_the_recorded_windows_makes_the_same_decisions(tmp_path):
    path = tmp_path / "windows.jsonl"
    plans = _record(path)
    assert sum(plan is not None for plan in plans) >= 2  # the record holds moves to replay
    header, windows = read_windows(path)
    assert header["rearrange"] == "when_it_pays" and len(windows) == len(plans)
    assert windows[6].decision is None  # no load, no decision
    report = replay_windows(path)
    assert report.summary()["same_decisions"] == report.summary()["decisions"] == 7
    assert report.differences == []


def test_a_replay_that_differs_says_where(tmp_path, capsys):
    path = tmp_path / "windows.jsonl"
    _record(path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["step_interval"] = 1  # a setting the engine did not run with: no move repays
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert cli.main(["simulate", "--windows", str(path)]) == 1
    out = capsys.readouterr().out
    assert "NO" in out and "decisions the same" in out
    assert replay_windows(path).summary()["first_difference"]["step"] == 100


def test_simulate_windows_prints_every_decision_and_refuses_a_file_that_is_no_record(
    tmp_path, capsys
):
    path = tmp_path / "windows.jsonl"
    _record(path)
    assert cli.main(["simulate", "--windows", str(path), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "7 of 7 decisions the same (8 windows)" in out
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["same_decisions"] == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format_version": 99}\n')
    assert cli.main(["simulate", "--windows", str(bad)]) == 2
    assert "not a window record" in capsys.readouterr().err


def test_recording_a_window_that_cannot_be_written_keeps_planning(tmp_path):
    planner = _planner(tmp_path / "no" / "such" / "file")
    serving = Serving(ROWS)
    assert planner(serving.window(DEFAULT, CODE)) is not None  # planned despite the disk
    assert planner.last_decision["action"] == "failed"
    assert "recording the window" in planner.last_decision["reason"]
    assert planner(serving.window(DEFAULT, CODE)) is not None and planner.failures == 1
    assert torch.equal(DEFAULT, Placement.default(2, 32, 8, RANKS).phy2log)

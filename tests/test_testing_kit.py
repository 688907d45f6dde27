"""The regression kit as a downstream suite uses it: ``assert_graph_safe``, the replay's ``auto``
mode and generated placements, and the pytest plugin run on the worked example of
``docs/testing.md`` (so the documented example cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eplb_graph.testing as kit
from eplb_graph import cli
from eplb_graph.audit import load_target
from eplb_graph.testing import (
    GraphRegressionError,
    GraphSafetyError,
    assert_graph_safe,
    capture_commit_replay,
    graph_mode_device,
    resolve_graph_mode,
)
from tests.broken_models import TARGETS

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[1]


def _worked_example() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## Worked example", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "docs/testing.md lost its worked example"
    return match.group(1)


def test_assert_graph_safe_passes_the_project_model():
    target = load_target()
    report = assert_graph_safe(target.fn, target.example_args, target.eplb_state)
    assert report.clean


def test_assert_graph_safe_lists_every_finding():
    target = load_target(TARGETS["python_int_valid_count"])
    with pytest.raises(GraphSafetyError) as error:
        assert_graph_safe(target.fn, target.example_args, target.eplb_state, root=ROOT)
    message = str(error.value)
    assert message.startswith("2 graph-safety finding(s) in PythonCountMoE:")
    assert "recompile     tests/broken_models.py:" in message
    assert "python_value  tests/broken_models.py:" in message
    assert isinstance(error.value, AssertionError)
    assert not error.value.report.clean


def test_assert_graph_safe_can_tolerate_kinds():
    target = load_target(TARGETS["rebinding_commit"])
    report = assert_graph_safe(
        target.fn, target.example_args, target.eplb_state, ignore_kinds={"address_changed"}
    )
    assert [finding.kind for finding in report.findings] == ["address_changed"]
    with pytest.raises(ValueError, match="unknown finding kinds"):
        assert_graph_safe(target.fn, target.example_args, ignore_kinds={"typo"})


def test_replay_generates_placements_when_none_are_given():
    target = load_target()
    report = capture_commit_replay(
        target.fn, target.example_args, target.eplb_state, mode="compile:eager"
    )
    assert report.commits == 3
    assert report.replays == 3


@pytest.mark.parametrize(
    "sample", ["cloned_lookup", "constant_lookup", "per_step_copy", "stale_view"]
)
def test_replay_fails_routing_through_a_copy_of_the_lookup(sample):
    """Graph and eager agree perfectly when both read the same stale copy: the replay must look
    at where the eager run's tables come from, not only compare the two."""
    target = load_target(TARGETS[sample])
    with pytest.raises(GraphRegressionError) as error:
        capture_commit_replay(
            target.fn, target.example_args, target.eplb_state, mode="compile:eager"
        )
    message = str(error.value)
    assert message.startswith("compile:eager commit 0 step 0: routing reads a copy of the EPLB")
    assert "`log2phy` passed to eplb_graph::map_and_record is not read from the live" in message
    assert "(at tests/broken_models.py:" in message and "fix: pass the EplbState's own" in message


def test_auto_mode_follows_the_state_device(monkeypatch):
    assert resolve_graph_mode("auto", SimpleNamespace(device="cpu")) == "compile:inductor"
    assert resolve_graph_mode("compile:eager", SimpleNamespace(device="cpu")) == "compile:eager"
    monkeypatch.setattr(kit, "graph_mode_skip_reason", lambda mode: None)
    assert resolve_graph_mode("auto", SimpleNamespace(device="cuda:0")) == "cuda_graph"
    assert resolve_graph_mode("auto", SimpleNamespace(device="npu")) == "npu_graph"


def test_graph_mode_device_and_unknown_modes():
    assert graph_mode_device("cuda_graph") == "cuda"
    assert graph_mode_device("npu_graph") == "npu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert graph_mode_device("compile:eager") == expected
    with pytest.raises(ValueError, match="unknown graph mode"):
        graph_mode_device("tpu_graph")


def test_plugin_runs_the_documented_downstream_suite(pytester, capsys):
    pytester.makepyfile(test_my_moe_graphs=_worked_example())
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    expected_skips = 0 if torch.cuda.is_available() else 1
    expected_skips += 0 if kit.graph_mode_skip_reason("npu_graph") is None else 1
    assert outcomes.get("passed") == 5 - expected_skips, result.stdout.str()
    assert outcomes.get("skipped", 0) == expected_skips
    if not torch.cuda.is_available():
        result.stdout.fnmatch_lines(["*cuda_graph: CUDA graphs need a CUDA device*"])
    # The example's audit_target works from the command line too (cwd is on sys.path).
    assert cli.main(["audit", "test_my_moe_graphs:audit_target"]) == 0
    assert "no findings: graph-safe" in capsys.readouterr().out


def test_plugin_mode_option_narrows_the_parametrization(pytester):
    pytester.makepyfile(
        """
        def test_modes(eplb_graph_mode):
            assert eplb_graph_mode == "compile:eager"
        """
    )
    result = pytester.runpytest_inprocess("--eplb-graph-modes=compile:eager", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_modes?compile:eager? PASSED*"])


def test_plugin_fixtures_fail_a_model_that_routes_through_a_cloned_lookup(pytester):
    """The documented example with its lookup cloned into a buffer at build time: both fixtures
    fail it, naming the copied table."""
    example = _worked_example()
    routed = "            s.log2phy[0],\n"
    assert routed in example, "the worked example no longer routes through s.log2phy[0]"
    copy_at_build = '        self.register_buffer("lookup", state.log2phy[0].clone())\n'
    cloned = example.replace(routed, "            self.lookup,\n").replace(
        "        self.top_k = top_k\n", "        self.top_k = top_k\n" + copy_at_build
    )
    pytester.makepyfile(test_cloned_lookup=cloned)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    runnable_device_modes = sum(
        kit.graph_mode_skip_reason(mode) is None for mode in ("cuda_graph", "npu_graph")
    )
    assert outcomes.get("failed") == 3 + runnable_device_modes, result.stdout.str()
    assert outcomes.get("passed", 0) == 0
    stale = "*stale_table*`log2phy` passed to eplb_graph::map_and_record is not read from the live*"
    replay = "*compile:eager commit 0 step 0: routing reads a copy of the EPLB tables*"
    result.stdout.fnmatch_lines([stale, replay])

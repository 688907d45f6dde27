"""The regression kit as a downstream suite uses it: ``assert_graph_safe``, the replay's ``auto``
mode and generated placements, and the pytest plugin run on the worked example of
``docs/testing.md`` (so the documented example cannot rot)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eplb_graph.testing as kit
from eplb_graph import cli
from eplb_graph.audit import hints, load_target
from eplb_graph.errors import EplbError
from eplb_graph.testing import (
    GraphBreakError,
    GraphRegressionError,
    GraphSafetyError,
    StepInputs,
    UnknownGraphModeError,
    assert_graph_safe,
    capture_commit_replay,
    check_graph_mode,
    graph_mode_device,
    graph_mode_skip_reason,
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


@pytest.mark.cuda
def test_graph_mode_device_and_unknown_modes():
    assert graph_mode_device("cuda_graph") == "cuda"
    assert graph_mode_device("npu_graph") == "npu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert graph_mode_device("compile:eager") == expected
    with pytest.raises(ValueError, match="unknown graph mode"):
        graph_mode_device("tpu_graph")


@pytest.mark.cuda
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


@pytest.mark.cuda
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


# -- failures a newcomer meets: short output, kit errors with a fix, typos as usage errors ------

_MASKED_AND_BRANCHY = """
import logging

from test_my_moe_graphs import MyMoELayer, build


class MaskedMoE(MyMoELayer):
    def forward(self, x):
        return super().forward(x[x.sum(-1) > -1e9])  # boolean mask: a data-dependent shape


class BranchyMoE(MyMoELayer):
    def forward(self, x):
        if self.state.num_valid_tokens > 3:  # a branch on a device value breaks the graph
            x = x * 2
        return super().forward(x)


def test_audit_fails(eplb_audit):
    logging.getLogger("my_runner").warning("my runner's own log line")
    _, args, state = build()
    eplb_audit(MaskedMoE(state), args, state)


def test_replay_fails(eplb_replay, eplb_graph_device):
    _, args, state = build(eplb_graph_device)
    eplb_replay(BranchyMoE(state), args, state)
"""


def test_failing_kit_tests_print_no_torch_trace_records(pytester):
    """pytest attaches its log handlers to torch's non-propagating ``torch.__trace`` logger, so
    every compile left hundreds of empty DEBUG records under a failing test."""
    pytester.makepyfile(test_my_moe_graphs=_worked_example(), test_failing=_MASKED_AND_BRANCHY)
    result = pytester.runpytest_inprocess(
        "test_failing.py", "-p", "no:cacheprovider", "--eplb-graph-modes=compile:eager"
    )
    result.assert_outcomes(failed=2)
    output = result.stdout.str()
    assert "torch.__trace" not in output
    assert "my runner's own log line" in output  # the user's own logs are still captured
    assert len(output.splitlines()) < 120, output
    # The failure names the cause and shows the fix, not the kit's frames.
    assert "GraphBreakError: compile:eager: BranchyMoE does not compile as one graph" in output
    assert "torch.zeros_like(x).scatter_add_(0" in output
    assert "eplb_graph/testing.py" not in output


def _branchy(target):
    model = target.fn

    def branchy(hidden):
        if target.eplb_state.num_valid_tokens > 3:  # the user's line the error must name
            hidden = hidden * 2
        return model(hidden)

    return branchy


def test_replay_turns_a_graph_break_into_a_kit_error_with_a_fix():
    target = load_target()
    with pytest.raises(GraphBreakError) as error:
        capture_commit_replay(
            _branchy(target), target.example_args, target.eplb_state, mode="compile:eager"
        )
    message = str(error.value)
    line = next(
        number
        for number, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if "the user's line the error must name" in text
    )
    first = message.splitlines()[0]
    assert first.startswith("compile:eager: _branchy.<locals>.branchy does not compile as one")
    assert first.endswith(f"Data-dependent branching at tests/test_testing_kit.py:{line}")
    assert "fix: a Python value read from a device tensor" in message
    assert "torch.where(condition, a, b)" in message
    assert len(message.splitlines()) < 12, message
    assert isinstance(error.value, GraphRegressionError)
    assert isinstance(error.value, EplbError)
    assert isinstance(error.value.torch_error, torch._dynamo.exc.Unsupported)


def test_replay_turns_a_recompile_into_a_kit_error():
    target = load_target(TARGETS["python_int_valid_count"])
    knobs = [StepInputs(num_valid_tokens=12), StepInputs(num_valid_tokens=5)]
    with pytest.raises(GraphRegressionError) as error:
        capture_commit_replay(
            target.fn,
            target.example_args,
            target.eplb_state,
            mode="compile:eager",
            step_inputs=knobs,
        )
    first, *rest = str(error.value).splitlines()
    assert first.startswith("compile:eager commit 0 step 1: recompiled:")
    assert re.search(r"guard `self\.state\.num_valid_host == 12` failed at tests/broken", first)
    assert rest[0] == (
        "  fix: if that value is routing state, keep it in a device tensor of the EPLB state "
        "and update it in place"
    )


def test_a_failed_device_capture_is_a_kit_error_with_a_fix(monkeypatch):
    """Capturing a host sync (nonzero, .item()) fails inside the device's graph context."""

    class FakeStream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def refusing_graph(graph):
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    device = SimpleNamespace(
        Stream=FakeStream,
        current_stream=FakeStream,
        stream=lambda stream: contextlib.nullcontext(),
        graph=refusing_graph,
        synchronize=lambda: None,
    )
    monkeypatch.setattr(kit, "_device_graph_api", lambda mode: (device, object))
    monkeypatch.setattr(kit, "graph_mode_skip_reason", lambda mode: None)
    target = load_target()
    with pytest.raises(GraphBreakError) as error:
        capture_commit_replay(target.fn, target.example_args, target.eplb_state, mode="cuda_graph")
    lines = str(error.value).splitlines()
    assert lines[0] == (
        "cuda_graph: TinyMoE cannot be captured, so there is nothing to replay: "
        "CUDA error: operation not permitted when stream is capturing"
    )
    assert lines[1].startswith("  fix: a device graph cannot capture a host sync.")
    assert "nonzero, torch.where(mask) or x[mask]" in str(error.value)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("inductr", "unknown graph mode 'inductr'; did you mean 'compile:inductor'?"),
        (
            "compile:inductr",
            "unknown graph mode 'compile:inductr' (torch.compile has no backend 'inductr'); "
            "did you mean 'compile:inductor'?",
        ),
        ("cuda-graph", "unknown graph mode 'cuda-graph'; did you mean 'cuda_graph'?"),
    ],
)
def test_unknown_modes_are_refused_before_anything_runs(mode, expected):
    target = load_target()
    before = target.eplb_state.placement
    for call in (
        lambda: check_graph_mode(mode),
        lambda: graph_mode_skip_reason(mode),
        lambda: capture_commit_replay(target.fn, target.example_args, target.eplb_state, mode=mode),
    ):
        with pytest.raises(UnknownGraphModeError) as error:
            call()
        message = str(error.value)
        assert message.startswith(expected)
        assert "valid modes: auto, compile:eager, compile:aot_eager, compile:inductor" in message
        assert isinstance(error.value, ValueError) and isinstance(error.value, EplbError)
    assert target.eplb_state.placement == before
    assert check_graph_mode("compile:aot_eager_decomp_partition") == (
        "compile:aot_eager_decomp_partition"  # any backend torch.compile has is a mode
    )


@pytest.mark.parametrize("how", ["option", "ini"])
def test_a_mode_typo_is_a_pytest_usage_error(pytester, how):
    pytester.makepyfile("def test_modes(eplb_graph_mode):\n    pass\n")
    if how == "ini":
        pytester.makeini("[pytest]\neplb_graph_modes = compile:eager, inductr\n")
        result = pytester.runpytest_inprocess()
        source = "ini eplb_graph_modes"
    else:
        result = pytester.runpytest_inprocess("--eplb-graph-modes=compile:eager,inductr")
        source = "--eplb-graph-modes"
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    error = result.stderr.str()
    assert f"ERROR: {source}: unknown graph mode 'inductr'; did you mean 'compile:inductor'?" in (
        error
    )
    assert "valid modes: auto, compile:eager" in error
    assert "InvalidBackend" not in error + result.stdout.str()


def test_a_mode_typo_in_a_marker_fails_collection_with_the_valid_modes(pytester):
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.eplb_graph_modes("cuda-graph")
        def test_modes(eplb_graph_mode):
            pass
        """
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.eplb_graph_modes on *test_modes: unknown graph mode 'cuda-graph'*"]
    )


def test_the_docs_show_the_dispatch_pattern_of_the_hint():
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## Graph-safe dispatch", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{hints.DISPATCH_EXAMPLE}```" in section

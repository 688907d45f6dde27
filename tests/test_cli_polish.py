"""What a newcomer meets first at the ``eplb-graph`` command line: ``--version``, and a
``--help`` on every command that says what each option does, its default and its choices."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eplb_graph import cli
from eplb_graph.policy import policy_names


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(path, parser)`` for the top level and every subcommand, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _commands(subparser, (*path, name))


ROOT = Path(__file__).resolve().parents[1]
SMALL_SIMULATION = ["simulate", "--steps", "10", "--layers", "2", "--no-progress"]


COMMANDS = dict(_commands(cli.build_parser()))


def test_every_command_is_walked():
    names = {" ".join(path) for path in COMMANDS}
    assert {"", "info", "map", "map validate", "audit", "simulate", "demo"} <= names


def _help_of(path: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*path, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps: compare unwrapped


def _compact(text: str) -> str:
    """``text`` without whitespace: argparse may wrap a line at a hyphen ("--step- interval")."""
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join(path) or "top")
def test_help_shows_text_default_and_choices_of_every_option(path, capsys):
    parser = COMMANDS[path]
    shown = _help_of(path, capsys)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar
        assert action.help and action.help.strip(), f"{' '.join(path)} {name}: no help text"
        assert _compact(action.help) in _compact(shown), f"{name}: help text not shown"
        default = action.default
        if default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            assert f"(default: {default})" in shown, f"{' '.join(path)} {name}: default not shown"
        if action.choices is not None:
            assert "{" + ",".join(action.choices) + "}" in shown, f"{name}: choices not shown"


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_policy_choices_are_the_registered_policies(command, capsys):
    shown = _help_of((command,), capsys)
    assert "--policy {" + ",".join(policy_names()) + "}" in shown


@pytest.mark.parametrize(
    ("command", "option", "choices"),
    [
        ("demo", "--format", "{unquantized,w8a8}"),
        ("demo", "--backend", "{inductor,aot_eager,eager}"),
        ("simulate", "--load-collection-phase", "{all,prefill,decode}"),
        ("simulate", "--shape", "{zipf,lognormal}"),
    ],
)
def test_enumerated_options_list_their_choices(command, option, choices, capsys):
    assert f"{option} {choices}" in _help_of((command,), capsys)


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"eplb-graph \d+\.\d+\.\d+\S*\n", out), out
    assert out == f"eplb-graph {cli.package_version()}\n"


def _run_cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``eplb-graph`` as a user does: a fresh interpreter, whose logging pytest cannot touch."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "eplb_graph.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=timeout,
    )


def test_simulate_warns_when_the_window_is_capped_at_the_interval_and_goes_on():
    result = _run_cli(
        *("simulate", "--steps", "40", "--layers", "2", "--experts", "16", "--top-k", "2"),
        *("--num-redundant", "0", "--ranks", "4", "--no-progress"),
        *("--window-size", "20", "--step-interval", "10"),
    )
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warning) == 1, result.stderr
    assert "--window-size 20 exceeds --step-interval 10" in warning[0]
    assert "only the 10 steps" in warning[0]
    assert "balancedness" in result.stdout


def test_simulate_does_not_warn_when_the_window_fits(capsys):
    argv = [*SMALL_SIMULATION, "--window-size", "10", "--step-interval", "10"]
    with _cli_warnings() as warnings:
        assert cli.main(argv) == 0
    assert warnings == []


def test_demo_warns_when_the_window_is_capped_at_the_interval(monkeypatch, capsys):
    monkeypatch.setattr("eplb_graph.demo.command._run_spawned", lambda options: 0)
    argv = ["demo", "--no-plot", "--window-size", "80", "--step-interval", "60"]
    with _cli_warnings() as warnings:
        assert cli.main(argv) == 0
    assert len(warnings) == 1
    assert "--window-size 80 exceeds --step-interval 60" in warnings[0]


@contextlib.contextmanager
def _cli_warnings():
    """The WARNING records the CLI logs (pytest owns the root logger's handlers here)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = Collect()
    cli_logger = logging.getLogger("eplb_graph.cli")
    cli_logger.addHandler(handler)
    try:
        yield records
    finally:
        cli_logger.removeHandler(handler)


SMALL_DEMO = (
    *("demo", "--ranks", "2", "--steps", "30", "--layers", "2", "--experts", "8"),
    *("--redundant", "4", "--window-size", "10", "--step-interval", "15"),
    *("--no-plot", "--no-progress", "--backend", "eager"),
)


@pytest.mark.multiprocess
def test_verbose_reaches_every_rank_and_quiet_shows_no_info():
    verbose = _run_cli("-v", *SMALL_DEMO)
    assert verbose.returncode == 0, verbose.stderr
    info = [line for line in verbose.stderr.splitlines() if " INFO " in f" {line} "]
    for rank in (0, 1):
        assert any(line.startswith(f"[rank {rank}] INFO") for line in info), verbose.stderr
    assert any("committed layers" in line for line in info), verbose.stderr
    quiet = _run_cli(*SMALL_DEMO)
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO" not in quiet.stderr, quiet.stderr


def _trace(tmp_path: Path, layers: int = 3, experts: int = 16) -> Path:
    from eplb_graph.simulate.trace import TraceSpec, generate_trace, save_trace

    path = tmp_path / "trace.npz"
    spec = TraceSpec(num_layers=layers, num_experts=experts, top_k=2, num_steps=200, seed=1)
    save_trace(generate_trace(spec), path)
    return path


def test_map_write_default_placement_round_trips_through_map_validate(tmp_path, capsys):
    from eplb_graph.placement import Placement

    out = tmp_path / "map.json"
    argv = ["map", "write", str(out), "--layers", "2", "--experts", "8"]
    assert cli.main([*argv, "--redundant", "4", "--ranks", "4"]) == 0
    assert "wrote:" in capsys.readouterr().out
    assert cli.main(["map", "validate", str(out), "--num-logical", "8"]) == 0
    assert "valid:" in capsys.readouterr().out
    assert Placement.load_expert_map(out, num_logical=8) == Placement.default(2, 8, 4, 4)


@pytest.mark.parametrize("policy", ["default", "churn_aware", "flash_lb", "swift_balance"])
def test_map_write_plans_on_the_traces_total_load(policy, tmp_path, capsys):
    from eplb_graph.map_command import trace_total_load
    from eplb_graph.placement import Placement
    from eplb_graph.policy import balancedness, rank_load, rebalance

    trace, out = _trace(tmp_path), tmp_path / "map.json"
    argv = ["map", "write", str(out), "--trace", str(trace), "--policy", policy]
    assert cli.main([*argv, "--redundant", "8", "--ranks", "8"]) == 0
    assert cli.main(["map", "validate", str(out), "--num-logical", "16"]) == 0
    written = Placement.load_expert_map(out, num_logical=16)
    load = trace_total_load(str(trace))
    assert torch.equal(written.phy2log, rebalance(policy, load, 24, 1, 1, 8))
    initial = Placement.default(3, 16, 8, 8)
    planned = balancedness(rank_load(written.phy2log, load, 8))
    assert planned >= balancedness(rank_load(initial.phy2log, load, 8))


MAP_WRITE_USAGE_ERRORS = [
    (["--layers", "2", "--experts", "8", "--redundant", "3", "--ranks", "4"], "not divisible"),
    (["--layers", "1", "--experts", "2", "--redundant", "2", "--ranks", "1"], "one copy"),
    (["--experts", "8", "--ranks", "4"], "--layers and --experts are required"),
    (["--layers", "2", "--experts", "8", "--ranks", "4", "--policy", "default"], "--trace"),
    (["--layers", "2", "--experts", "8"], "--ranks"),
    (["--layers", "0", "--experts", "8", "--ranks", "4"], "--layers"),
    (["--layers", "2", "--experts", "8", "--ranks", "4", "--policy", "nope"], "nope"),
    (["--trace", "{tmp}/missing.npz", "--ranks", "4"], "missing.npz"),
    (["--trace", "{trace}", "--ranks", "4", "--layers", "5"], "--layers 5 does not match"),
    (["--trace", "{trace}", "--ranks", "4", "--groups", "3"], "--groups 3"),
    (["--trace", "{trace}", "--ranks", "1", "--redundant", "8"], "lower --redundant"),
]


@pytest.mark.parametrize(("options", "mentions"), MAP_WRITE_USAGE_ERRORS)
def test_map_write_shape_errors_are_one_line_exit_2_and_write_nothing(
    options, mentions, tmp_path, capsys
):
    trace = _trace(tmp_path)
    out = tmp_path / "map.json"
    options = [o.format(tmp=tmp_path, trace=trace) for o in options]
    try:
        status = cli.main(["map", "write", str(out), *options])
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert mentions in err, err
    assert not out.exists()


def test_map_write_and_simulate_follow_one_replica_rule(tmp_path, capsys):
    """The default policy alone gives a hot expert 3 copies on 2 ranks, which no expert map can
    hold; both commands take the capped plan on the same setup, and both refuse a shape that
    forces two copies onto one rank, for the same reason."""
    from eplb_graph.map_command import trace_total_load
    from eplb_graph.placement import Placement
    from eplb_graph.policy.registry import PolicyProblem, get_policy, normalize_weight
    from eplb_graph.simulate.trace import TraceSpec, generate_trace, save_trace

    trace, out = tmp_path / "skewed.npz", tmp_path / "map.json"
    spec = TraceSpec(num_layers=2, num_experts=16, top_k=2, num_steps=200, skew=1.5, seed=1)
    save_trace(generate_trace(spec), trace)
    raw = get_policy("default")(
        PolicyProblem(normalize_weight(trace_total_load(str(trace))), 18, 1, 1, 2)
    )
    assert int(torch.bincount(raw[0]).max()) > 2  # the setup does exercise the rule
    simulate = ["simulate", "--trace", str(trace), "--policy", "default", "--no-progress"]
    simulate += ["--window-size", "50", "--step-interval", "50"]
    write = ["map", "write", str(out), "--trace", str(trace)]
    assert cli.main([*write, "--ranks", "2", "--redundant", "2"]) == 0, capsys.readouterr().err
    assert Placement.load_expert_map(out, num_logical=16).max_replica_count() <= 2
    assert cli.main([*simulate, "--ranks", "2", "--num-redundant", "2"]) == 0
    capsys.readouterr()
    out.unlink()
    reasons = []
    for argv in (
        [*write, "--ranks", "2", "--redundant", "18"],
        [*simulate, "--ranks", "2", "--num-redundant", "18"],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        reasons.append(err.split(": ", 2)[-1].split("; lower")[0])
    assert reasons[0] == reasons[1] and "second copy of some expert on one rank" in reasons[0]
    assert not out.exists()


def test_map_write_refuses_an_unwritable_destination_first(tmp_path, capsys):
    out = tmp_path / "missing" / "map.json"
    assert cli.main(["map", "write", str(out), "--layers", "1", "--experts", "4", "--ranks", "2"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


@pytest.mark.parametrize("status", ["pending", "loaded", "disabled", "unavailable"])
def test_info_says_what_the_native_kernel_status_means(status, monkeypatch, tmp_path, capsys):
    from eplb_graph.ops import native

    monkeypatch.setattr(native, "status", lambda: native.NativeStatus(status))
    path = tmp_path / "info.json"
    assert cli.main(["info", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("native_note"))
    assert json.loads(path.read_text())["native_note"] in note
    if status == "pending":
        assert "not built yet" in note and "eplb-graph info --build-native" in note


# -- the command line answers without torch --------------------------------------------------------

_WITHOUT_TORCH = """
import sys, time
started = time.perf_counter()
from eplb_graph import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
sys.stderr.write(f"\\nSTATUS {status} TORCH {'torch' in sys.modules} SECONDS "
                 f"{time.perf_counter() - started:.3f}\\n")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["simulate", "--help"],
        ["demo", "--help"],
        ["map", "write", "--help"],
        ["checkpoint", "--help"],
        ["simulate", "--ranks", "abc"],  # usage errors, from every level
        ["demo", "--format", "int3"],
        ["map", "write", "out.json", "--layers", "0", "--ranks", "2"],
        ["nonsense"],
        [],
    ],
)
def test_help_and_usage_errors_do_not_import_torch(argv):
    """Importing torch takes seconds; ``--help`` or a typo must answer well under one."""
    timings = []
    for _ in range(2):  # the better of two runs: the machine may be busy
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-c", _WITHOUT_TORCH, *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        timings.append(time.perf_counter() - started)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("STATUS ") and " TORCH False " in last, result.stderr
        assert last.split()[1] == ("0" if "--help" in argv else "2"), result.stderr
    assert min(timings) < 1.0, timings


def test_importing_the_package_first_still_registers_the_ops_when_torch_comes():
    """``import eplb_graph`` no longer imports torch, yet ``torch.ops.eplb_graph.*`` is there
    as soon as torch is, in either import order, and every public name still resolves."""
    code = """
import sys
import time
import eplb_graph
assert "torch" not in sys.modules
import torch
assert callable(torch.ops.eplb_graph.map_and_record)
for name in eplb_graph.__all__:
    getattr(eplb_graph, name)
from eplb_graph import Placement, EplbRuntime, policy
assert policy.rebalance and Placement.default(1, 4, 0, 2).num_slots == 4
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert result.stdout == "ok\n", result.stderr


def test_the_built_in_policy_list_is_the_registry():
    from eplb_graph.cli_support import BUILT_IN_POLICIES

    assert list(BUILT_IN_POLICIES) == policy_names()

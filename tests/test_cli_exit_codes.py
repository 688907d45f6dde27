"""The ``eplb-graph`` exit-status contract at its boundary with the user.

Usage, shape and unreadable input exit 2 with exactly one stderr line and no traceback, and are
decided before anything expensive: no rank is spawned, no replay runs, no report is lost to an
unwritable ``--json`` destination after a long run.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eplb_graph import cli

ROOT = Path(__file__).resolve().parents[1]
SMALL_SIMULATION = ["simulate", "--steps", "10", "--layers", "2", "--no-progress"]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a command gets as far as spawning ranks or replaying a trace."""

    def refuse_to_run(*_args, **_kwargs):
        raise AssertionError("the command started its run before rejecting its input")

    monkeypatch.setattr("eplb_graph.launch.spawn_ranks", refuse_to_run)
    monkeypatch.setattr("eplb_graph.simulate.simulator.simulate", refuse_to_run)


def _exit_status_and_stderr(argv: list[str], capsys) -> tuple[int, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    return status, capsys.readouterr().err


def _assert_one_line_usage_error(status: int, err: str, mentions: str) -> None:
    assert status == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert mentions in err, err


DEMO_USAGE_ERRORS = [
    (["--redundant", "-2"], "--redundant"),
    (["--layers", "0"], "--layers"),
    (["--window-size", "0"], "--window-size"),
    (["--step-interval", "0"], "--step-interval"),
    (["--layers-per-step", "0"], "--layers-per-step"),
    (["--hidden", "0"], "--hidden"),
    (["--intermediate", "0"], "--intermediate"),
    (["--experts", "0"], "--experts"),
    (["--steps", "0"], "--steps"),
    (["--steps", "1.5"], "--steps"),
    (["--top-k", "0"], "--top-k"),
    (["--top-k", "99"], "--top-k"),
    (["--ranks", "1"], "--ranks"),
    (["--ranks", "-2"], "--ranks"),
    (["--ranks", "abc"], "--ranks"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**40)], "--seed"),
    (["--backend", "bogus"], "--backend"),
    (["--format", "bogus"], "--format"),
    (["--policy", "bogus"], "bogus"),
    (["--ranks", "4", "--experts", "10", "--redundant", "1"], "divisible by --ranks"),
]


@pytest.mark.parametrize(("options", "mentions"), DEMO_USAGE_ERRORS)
def test_demo_rejects_each_bad_option_in_one_line_before_spawning(
    options, mentions, nothing_runs, capsys
):
    status, err = _exit_status_and_stderr(["demo", "--no-plot", *options], capsys)
    _assert_one_line_usage_error(status, err, mentions)


SIMULATE_USAGE_ERRORS = [
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "-2"], "--ranks"),
    (["--ranks", "3", "--experts", "8", "--num-redundant", "0"], "--ranks 3"),
    (["--experts", "10", "--ranks", "4", "--num-redundant", "1"], "--ranks 4"),
    (["--nodes", "0"], "--nodes"),
    (["--groups", "0"], "--groups"),
    (["--groups", "3"], "--groups 3"),
    (["--num-redundant", "-1"], "--num-redundant"),
    (["--window-size", "0"], "--window-size"),
    (["--step-interval", "0"], "--step-interval"),
    (["--steps", "0"], "--steps"),
    (["--experts", "0"], "--experts"),
    (["--top-k", "0"], "--top-k"),
    (["--top-k", "300"], "--top-k"),
    (["--segment-steps", "0"], "--segment-steps"),
    (["--skew", "-1"], "--skew"),
    (["--skew", "nan"], "--skew"),
    (["--drift-sigma", "inf"], "--drift-sigma"),
    (["--prefill-fraction", "2"], "--prefill-fraction"),
    (["--expert-bytes", "-1"], "--expert-bytes"),
    (["--seed", "-1"], "--seed"),
    (["--policy", "nope"], "nope"),
    (["--load-collection-phase", "never"], "--load-collection-phase"),
]


@pytest.mark.parametrize(("options", "mentions"), SIMULATE_USAGE_ERRORS)
def test_simulate_rejects_each_bad_option_in_one_line_before_replaying(
    options, mentions, nothing_runs, capsys
):
    status, err = _exit_status_and_stderr([*SMALL_SIMULATION, *options], capsys)
    _assert_one_line_usage_error(status, err, mentions)


def _bad_traces(tmp_path: Path) -> dict[str, Path]:
    from eplb_graph.simulate.trace import TraceSpec, generate_trace, save_trace

    good = tmp_path / "good.npz"
    save_trace(generate_trace(TraceSpec(num_layers=2, num_experts=8, top_k=2, num_steps=20)), good)
    data = good.read_bytes()
    traces = {
        "empty": tmp_path / "empty.npz",
        "corrupt": tmp_path / "corrupt.npz",
        "truncated": tmp_path / "truncated.npz",
        "missing": tmp_path / "missing.npz",
        "directory": tmp_path,
        "fifo": tmp_path / "fifo.npz",
    }
    traces["empty"].write_bytes(b"")
    traces["corrupt"].write_bytes(bytes(range(256)) * 4)
    traces["truncated"].write_bytes(data[: len(data) // 2])
    os.mkfifo(traces["fifo"])
    return traces


@pytest.mark.parametrize("kind", ["empty", "corrupt", "truncated", "missing", "directory", "fifo"])
def test_simulate_rejects_an_unreadable_trace_in_one_line(kind, tmp_path, nothing_runs, capsys):
    trace = _bad_traces(tmp_path)[kind]
    status, err = _exit_status_and_stderr([*SMALL_SIMULATION, "--trace", str(trace)], capsys)
    _assert_one_line_usage_error(status, err, str(trace))


def test_simulate_rejects_a_cluster_shape_that_does_not_fit_the_trace(
    tmp_path, nothing_runs, capsys
):
    _bad_traces(tmp_path)  # also writes good.npz, a valid trace of 8 experts
    argv = [*SMALL_SIMULATION, "--trace", str(tmp_path / "good.npz"), "--num-redundant", "1"]
    status, err = _exit_status_and_stderr([*argv, "--ranks", "2"], capsys)
    _assert_one_line_usage_error(status, err, "experts (8) + --num-redundant (1)")


def _unwritable_destinations(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {
        "missing directory": str(tmp_path / "no" / "such" / "dir" / "report.json"),
        "a directory": str(tmp_path),
        "parent is a file": str(a_file / "report.json"),
        "empty path": "",
    }


COMMANDS_WITH_JSON = {
    "info": ["info"],
    "simulate": SMALL_SIMULATION,
    "demo": ["demo", "--no-plot", "--ranks", "2", "--experts", "8", "--redundant", "4"],
    "audit": ["audit"],
    "map validate": ["map", "validate", "expert_map.json"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_JSON))
@pytest.mark.parametrize(
    "destination", ["missing directory", "a directory", "parent is a file", "empty path"]
)
def test_unwritable_json_destination_is_refused_before_the_run(
    command, destination, tmp_path, nothing_runs, monkeypatch, capsys
):
    def no_audit(*_args, **_kwargs):
        raise AssertionError("the audit ran before checking where its report goes")

    monkeypatch.setattr("eplb_graph.audit.load_target", no_audit)
    monkeypatch.setattr("eplb_graph.audit.run_audit", no_audit)
    path = _unwritable_destinations(tmp_path)[destination]
    status, err = _exit_status_and_stderr([*COMMANDS_WITH_JSON[command], "--json", path], capsys)
    _assert_one_line_usage_error(status, err, "--json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files and directories")
@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_JSON))
def test_read_only_json_destination_is_refused_before_the_run(
    command, tmp_path, nothing_runs, capsys
):
    read_only = tmp_path / "read-only.json"
    read_only.write_text("{}")
    read_only.chmod(stat.S_IRUSR)
    status, err = _exit_status_and_stderr(
        [*COMMANDS_WITH_JSON[command], "--json", str(read_only)], capsys
    )
    _assert_one_line_usage_error(status, err, "read-only")


def test_demo_refuses_an_unwritable_plot_before_spawning(tmp_path, nothing_runs, capsys):
    plot = tmp_path / "missing" / "demo.png"
    status, err = _exit_status_and_stderr(["demo", "--plot", str(plot)], capsys)
    _assert_one_line_usage_error(status, err, "--plot")


def test_a_writable_json_destination_is_accepted_and_written_atomically(tmp_path, capsys):
    path = tmp_path / "info.json"
    path.write_text("old report")
    path.chmod(0o640)
    assert cli.main(["info", "--json", str(path)]) == 0
    assert "ops" in json.loads(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the report keeps its permissions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["info.json"]  # no temp files left
    capsys.readouterr()


def test_an_interrupted_report_write_leaves_the_old_report_whole(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old report")

    class Interrupted(Exception):
        pass

    def half_write(temp: str) -> None:
        Path(temp).write_text("half a rep")
        raise Interrupted

    from eplb_graph.cli_support import write_file_atomically, write_text_atomically

    with pytest.raises(Interrupted):
        write_file_atomically(str(path), half_write)
    assert path.read_text() == "old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    write_text_atomically(str(path), "new report")
    assert path.read_text() == "new report"


def test_a_symlinked_report_is_written_through_the_link(tmp_path):
    from eplb_graph.cli_support import check_destination, write_text_atomically

    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert check_destination(str(link)) == real
    write_text_atomically(str(link), "new")
    assert link.is_symlink() and real.read_text() == "new"


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "eplb_graph.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--no-plot", "--layers", "0"],
        ["demo", "--no-plot", "--backend", "bogus"],
        [*SMALL_SIMULATION, "--experts", "10", "--ranks", "4", "--num-redundant", "1"],
        [*SMALL_SIMULATION, "--trace", "/dev/null"],
    ],
    ids=["demo-layers", "demo-backend", "simulate-shape", "simulate-trace"],
)
def test_the_installed_command_exits_2_with_one_stderr_line(argv):
    result = _run_cli(*argv)
    _assert_one_line_usage_error(result.returncode, result.stderr, "eplb-graph")
    assert result.stdout == ""


def test_the_installed_command_refuses_a_missing_json_directory_before_the_demo(tmp_path):
    path = tmp_path / "missing" / "demo.json"
    result = _run_cli("demo", "--no-plot", "--steps", "100000", "--json", str(path))
    _assert_one_line_usage_error(result.returncode, result.stderr, str(path.parent))

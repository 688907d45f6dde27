"""eplb-graph inside real vLLM engines (vLLM 0.32, CPU backend), with the plugin installed.

A tiny Qwen3-MoE written by the tests (float32; its router skewed toward experts 2, 3 and 4,
which the default placement puts on one rank) is served by:

- ``tp1``: one rank, no expert parallelism: the reference tokens;
- ``fixed``: 2 EP ranks with 2 redundant slots and eplb-graph in record mode (plans are written
  to an expert map, never applied): the same layout with EPLB off, measured;
- ``async_compiled``: the offline example of docs/vllm.md, run as written: the same layout,
  EPLB on, asynchronous, compiled with ``torch.compile``;
- ``sync_eager``: the same layout, EPLB on, synchronous, eager.

The OpenAI-compatible server commands of README.md and docs/vllm.md run in
``tests/test_vllm_server.py``.

``tp1``, ``fixed`` and ``sync_eager`` run one after another in one process, the docs' example in
another (``tests/vllm_scenario.py``: one vLLM import per process), once per test module, and
write their tokens; their workers write the per-rank metrics files the tests read. The
tests need the ``vllm`` extra (``pip install -e '.[vllm]'``; CI installs it) and skip with that
reason without it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ipc_tmpdir import ipc_safe_tmpdir
from tests.vllm_model_info import share_model_info

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "vllm_scenario.py"
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 64  # the docs' offline example generates 64 tokens
ROUNDS = 1
ENGINE_TIMEOUT_S = 900
DOCS = ROOT / "docs" / "vllm.md"
EPLB = {"window_size": 4, "step_interval": 8, "num_redundant_experts": 2}


def engine_environment(root: Path, tensor_parallel_size: int) -> dict[str, str]:
    """Caches and vLLM's temp files under ``root``; offline; only eplb-graph's plugin."""
    env = dict(os.environ)
    for name, folder in (
        ("HF_HOME", "hf"),
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("XDG_CACHE_HOME", "xdg"),
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / folder)
    share_model_info(root / "vllm")
    env["TMPDIR"] = str(ipc_safe_tmpdir(root / "tmp"))
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="eplb_graph")
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel_size))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def docs_block(language: str, heading: str) -> str:
    """The first ``language`` code block under ``heading`` in docs/vllm.md, as written."""
    text = DOCS.read_text()
    section = text[text.index(heading) :]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def engine_spec(name: str, model: Path, llm: dict) -> dict:
    """One engine of a scenario: this module's defaults, then ``llm``; threads bound per rank."""
    llm = {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "seed": 0,
        **llm,
    }
    ranks = llm.get("tensor_parallel_size", 1)
    return {
        "name": name,
        "model": str(model),
        "prompts": PROMPTS,
        "llm": llm,
        "max_tokens": MAX_TOKENS,
        "rounds": ROUNDS,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(ranks))},
    }


def run_scenario(root: Path, label: str, spec: dict, engines: int = 1) -> dict:
    """``tests/vllm_scenario.py`` on ``spec`` in a fresh process; what it wrote."""
    spec_path, out_path, log_path = (root / f"{label}.{ext}" for ext in ("spec", "out", "log"))
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(SCENARIO), str(spec_path), str(out_path)],
            env=engine_environment(root / "cache", 2),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = process.wait(ENGINE_TIMEOUT_S * engines)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    if returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-4000:]
        raise AssertionError(f"engines {label!r} failed (exit {returncode}):\n{tail}")
    return json.loads(out_path.read_text())


def run_engines(root: Path, label: str, engines: list[dict]) -> dict:
    """Every engine of ``engines`` one after another in one fresh process (one vLLM import and
    one start for all): name -> result; an engine that raised fails here, with the log."""
    results = run_scenario(root, label, {"engines": engines}, len(engines))
    failed = {name: result["error"] for name, result in results.items() if "error" in result}
    if failed:
        tail = (root / f"{label}.log").read_text()[-4000:]
        raise AssertionError(f"engines failed: {failed}\n{tail}")
    return results


def run_engine(root: Path, name: str, model: Path, llm: dict | None, snippet: str = "") -> dict:
    """Start one engine in a fresh process, generate, and return what it wrote."""
    if snippet:
        spec = {"model": str(model), "prompts": PROMPTS, "snippet": snippet}
        return run_scenario(root, name, {**spec, "metrics": str(root / f"metrics-{name}")})
    return run_scenario(root, name, engine_spec(name, model, llm or {}))


def metrics(directory: Path) -> list[dict]:
    files = sorted(directory.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], files
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every engine of the module, started once, one after another (2 cores: never two)."""
    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("vllm")
    model = write_tiny_qwen3_moe(root / "model")
    expert_parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    cache: dict[str, dict] = {}

    def llm_of(name: str) -> dict:
        # Every plan applied: this tiny model never repays a move (rearrange="when_it_pays").
        section = {"metrics_path": str(root / f"metrics-{name}"), "rearrange": "always"}
        if name == "tp1":
            return {"enforce_eager": True, "tensor_parallel_size": 1}
        if name == "fixed":
            section["record_map_path"] = str(root / "recorded-map.json")
        else:
            assert name == "sync_eager", name
        return {
            **expert_parallel,
            "enforce_eager": True,
            "enable_eplb": True,
            "eplb_config": {**EPLB, "use_async": name != "sync_eager"},
            "additional_config": {"eplb_graph": section},
        }

    def start(name: str) -> dict:
        if name in cache:
            return cache[name]
        if name == "async_compiled":  # the docs' offline example, as written
            results = {
                name: run_engine(root, name, model, None, docs_block("python", "## Offline"))
            }
        else:  # the other engines in one process, the first time any of them is asked for
            specs = [engine_spec(n, model, llm_of(n)) for n in ("tp1", "fixed", "sync_eager")]
            results = run_engines(
                root, "engines", [spec for spec in specs if spec["name"] not in cache]
            )
        for started, result in results.items():
            if started != "tp1":
                result["metrics"] = metrics(root / f"metrics-{started}")
            result["root"] = root
            cache[started] = result
        return cache[name]

    start.root = root
    start.model = model
    return start


def test_greedy_tokens_with_eplb_equal_eplb_off_and_one_rank(engines):
    """float32: which rank computes a token's experts changes nothing, so every run agrees."""
    reference = engines("tp1")["tokens"]
    assert len(reference) == ROUNDS and all(len(t) == MAX_TOKENS for t in reference[0])
    for name in ("fixed", "async_compiled", "sync_eager"):
        assert engines(name)["tokens"] == reference, name


def test_the_sync_engine_commits_at_least_three_rearrangements_that_change_the_placement(
    engines,
):
    """Synchronous: a window closes every ``step_interval`` steps and its rearrangement runs
    inside that step, so the count follows the steps served, not the machine's load."""
    per_rank = engines("sync_eager")["metrics"]
    initial = engines("fixed")["metrics"][0]["placement_digest"]
    for rank in per_rank:
        assert rank["rearrangements"] >= 3, rank
        assert rank["layers_committed"] >= 3 and rank["placement_version"] >= 3, rank
        assert rank["placement_digest"] != initial
        assert rank["async"] is False
        assert rank["policy"] == "default"
    # Every rank committed the same placement.
    assert len({rank["placement_digest"] for rank in per_rank}) == 1
    assert len({rank["layers_committed"] for rank in per_rank}) == 1


def test_the_async_engine_commits_a_placement_both_ranks_agree_on(engines):
    """Asynchronous: how many rearrangements finish while the tokens are served depends on the
    CPU time the movement thread gets (a loaded machine starves it), so no count beyond one is
    asserted. What asynchronous EPLB must do however little it got: a rearrangement committed
    (a layer installed, the placement changed) and both ranks serve the same committed
    placement, at the same version. Tokens equal one rank's:
    ``test_greedy_tokens_with_eplb_equal_eplb_off_and_one_rank``."""
    per_rank = engines("async_compiled")["metrics"]
    initial = engines("fixed")["metrics"][0]["placement_digest"]
    for rank in per_rank:
        assert rank["layers_committed"] >= 1 and rank["placement_version"] >= 1, rank
        assert rank["placement_digest"] != initial, rank
        assert rank["async"] is True
        assert rank["policy"] == "default"
    agreed = {
        (rank["placement_digest"], rank["placement_version"], rank["layers_committed"])
        for rank in per_rank
    }
    assert len(agreed) == 1, per_rank


def test_compiled_engine_has_no_graph_break_and_commits_do_not_recompile(engines):
    for rank in engines("async_compiled")["metrics"]:
        compiled = rank["compile"]
        assert compiled["graph_breaks"] == 0
        assert compiled["unique_graphs"] >= 1  # the model really was compiled
        # Graphs compiled before the first served step are all there is: the commits since
        # (written in place into graph inputs) recompiled nothing.
        assert compiled["unique_graphs"] == compiled["unique_graphs_at_first_step"]
        assert compiled["model_compiled"] and compiled["recompiled_while_serving"] is False
        assert rank["layers_committed"] >= 1  # a commit happened while serving compiled
    for rank in engines("sync_eager")["metrics"]:
        # An eager model has no graphs of its own: no figure that could read as a recompile.
        assert rank["compile"]["model_compiled"] is False, rank["compile"]
        assert rank["compile"]["unique_graphs"] is None


def test_skewed_router_is_better_balanced_with_eplb(engines):
    """Balancedness of the placement in force under each window's load (upstream formula)."""
    fixed = engines("fixed")["metrics"][0]["balancedness_windows"]
    balanced = engines("async_compiled")["metrics"][0]["balancedness_windows"]
    # The asynchronous worker coalesces windows that pile up while it moves weights, so it
    # reports fewer of them than the record-mode run on a loaded machine (4 against 7 seen; 2
    # against 8 in a fresh-clone CI run of the whole suite on 2 cores).
    assert len(fixed) >= 5 and len(balanced) >= 2, (fixed, balanced)
    # The first windows ran under the default placement in both runs, and the asynchronous
    # worker may take a few windows on a loaded machine: compare the later half of each run.
    later_off, later_on = fixed[len(fixed) // 2 :], balanced[len(balanced) // 2 :]
    off = sum(later_off) / len(later_off)
    on = sum(later_on) / len(later_on)
    assert on > off + 0.03, (off, on)


def test_record_mode_writes_a_valid_map_and_moves_nothing(engines):
    from eplb_graph import Placement

    fixed = engines("fixed")
    for rank in fixed["metrics"]:
        assert rank["layers_committed"] == 0 and rank["plans_recorded"] >= 3, rank
    recorded = Placement.load_expert_map(fixed["root"] / "recorded-map.json", num_logical=8)
    assert (recorded.num_layers, recorded.num_slots, recorded.num_ranks) == (2, 10, 2)


def test_metrics_files_carry_the_documented_figures(engines):
    for rank in engines("sync_eager")["metrics"]:
        for key in ("rearrangements", "layers_committed", "aborted", "balancedness"):
            assert key in rank
        assert isinstance(rank["placement_digest"], str) and len(rank["placement_digest"]) == 16
        assert rank["steps"] >= MAX_TOKENS
        assert 0.0 < rank["balancedness"] <= 1.0
        # Synchronous: each rearrangement ran inside a step, whose time is its cost.
        assert rank["rearrangements"] >= 1 and rank["movement_cost_ms"] > 0.0, rank
        # rearrange="always": no payback gate, so no ledger of moves.
        assert rank["cost_model"] is None and rank["moves"] == [], rank
        text = DOCS.read_text()
        table = text[text.index("| key | meaning |") :].split("\n\n")[0]
        undocumented = [key for key in rank if f"`{key}`" not in table]
        assert not undocumented, f"metrics keys missing from docs/vllm.md's table: {undocumented}"


@pytest.mark.parametrize("name", ["async_compiled", "sync_eager", "fixed"])
def test_a_normal_exit_leaves_every_rank_file_closed_with_its_final_counts(engines, name):
    """The offline engine's script ended normally: each worker wrote its final state."""
    run = engines(name)
    steps = [rank["steps"] for rank in run["metrics"]]
    for rank in run["metrics"]:
        assert rank["closed"] is True, rank
    # Both ranks served the same steps (replicated routing), at least one per generated token.
    assert len(set(steps)) == 1 and steps[0] >= MAX_TOKENS, steps

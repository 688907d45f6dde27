"""vLLM's default ``rearrange="when_it_pays"`` on a real engine (TP=2 + EP, eager).

A user who turns EPLB on and sets nothing else gets the payback gate: each rank calibrates the
cost model on its own kernel before the first window, every window ends in one decision per rank
(the same on both: the model is fitted from sums over ranks), each window's predicted
busiest-rank expert time is set against the measured one, and serving gives the tokens of the
same model without EPLB.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

from tests.test_vllm_engine import EPLB, engine_spec, metrics, run_engines

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("payback")
    model = write_tiny_qwen3_moe(root / "model")
    expert_parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    gate = {
        **expert_parallel,
        "enforce_eager": True,
        "enable_eplb": True,
        # Window 8 / interval 16: several windows in one generate call, and steps between them
        # with no job in flight (the cost model's serving samples come only from those; at an
        # interval of 8 a fast host's jobs overlapped every step, and the model never fitted).
        "eplb_config": {**EPLB, "window_size": 8, "step_interval": 16},
        "additional_config": {"eplb_graph": {"metrics_path": str(root / "metrics-gate")}},
    }
    off = {**expert_parallel, "enforce_eager": True}
    specs = [engine_spec("gate", model, gate), engine_spec("off", model, off)]
    results = run_engines(root, "engines", specs)
    gate, off = results["gate"], results["off"]
    return {"gate": gate, "off": off, "ranks": metrics(root / "metrics-gate"), "root": root}


def test_the_default_is_the_payback_gate_with_one_model_and_one_decision_per_window(runs):
    ranks = runs["ranks"]
    for rank in ranks:
        assert rank["rearrange"] == "when_it_pays"
        gate = rank["cost_model"]
        model = gate["model"]
        assert model is not None and model["samples"] >= 32
        assert min(model["fixed_us"], model["row_us"], model["read_us"]) >= 0
        assert math.isfinite(model["fit_error"])
        assert gate["decisions"], gate
        for decision in gate["decisions"]:
            assert decision["action"] in {"applied", "kept", "rollback", "failed"}
            assert decision["reason"]
        assert gate["applied"] + gate["kept"] >= 1
    # Every rank fitted the same model and took the same decisions (sums over ranks).
    first = ranks[0]["cost_model"]
    for rank in ranks[1:]:
        assert rank["cost_model"]["model"] == first["model"]
        assert rank["cost_model"]["decisions"] == first["decisions"]
        assert rank["placement_digest"] == ranks[0]["placement_digest"]
        assert rank["placement_version"] == ranks[0]["placement_version"]


def test_each_window_checks_the_predicted_busiest_rank_against_the_measured_one(runs):
    checks = runs["ranks"][0]["cost_model"]["accuracy"]
    assert checks, runs["ranks"][0]["cost_model"]
    for check in checks:
        assert check["predicted_busiest_ms"] > 0 and check["measured_busiest_ms"] > 0
        expected = check["predicted_busiest_ms"] / check["measured_busiest_ms"] - 1
        assert check["error"] == pytest.approx(expected)
    assert len(runs["ranks"][0]["cost_model"]["measured_rank_ms"]) == 2


def test_every_rank_calibrated_its_own_kernel_before_the_first_window(runs):
    """5 local slots: 1, 2 and 5 active slots (1 = 5 // 4 counted once) x 3 row counts."""
    log = (runs["root"] / "engines.log").read_text()  # the gate engine, then the one off
    for rank in (0, 1):
        assert f"eplb-graph cost calibration on EP rank {rank}: 9 kernel calls" in log
    # Each window's decision is logged (kept windows rate-limited, the first always).
    first_window = log.index("EPLB step ")
    assert log.index("eplb-graph cost calibration on EP rank 0") < first_window


def test_the_gate_serves_the_tokens_of_the_model_without_eplb(runs):
    assert runs["gate"]["tokens"] == runs["off"]["tokens"]

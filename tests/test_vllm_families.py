"""More MoE families in real vLLM engines (vLLM 0.32, CPU backend), with the plugin installed.

One engine per family, started once per module (``tests/vllm_scenario.py``, as in
``test_vllm_engine.py``): TP=2 with expert parallelism, EPLB on (synchronous, eager), 2 redundant
slots. Llama 4 (fused expert weights, router weight on the input) failed to load with redundant
slots in vLLM's own loader (``IndexError``) before ``integrations/vllm/llama4_loading.py``.
Its tokens under expert parallelism are not asserted here: the weight-0 exclusion of
``expert_parallel.to_local`` is wrong for a router weight applied on the input (issue 20; the
row-exclusion op of issue 17 fixes it).
"""

from __future__ import annotations

import pytest
from test_vllm_engine import EPLB, metrics, run_engine

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from eplb_graph.models.tiny_families import write_tiny_llama4

    root = tmp_path_factory.mktemp("l4")
    model = write_tiny_llama4(root / "model")
    llm = {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "enforce_eager": True,
        "enable_eplb": True,
        "eplb_config": {**EPLB, "use_async": False},
        "additional_config": {"eplb_graph": {"metrics_path": str(root / "metrics")}},
    }
    result = run_engine(root, "llama4", model, llm)
    result["metrics"] = metrics(root / "metrics")
    return result


def test_llama4_loads_with_redundant_slots_and_commits_rearrangements(llama4):
    per_rank = llama4["metrics"]
    assert all(len(tokens) > 0 for tokens in llama4["tokens"][0])
    for rank in per_rank:
        assert rank["rearrangements"] >= 2 and rank["layers_committed"] >= 2, rank
        assert rank["aborted"] == 0 and rank["last_error"] is None, rank
    assert len({rank["placement_digest"] for rank in per_rank}) == 1

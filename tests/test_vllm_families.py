"""More MoE families in real vLLM engines (vLLM 0.32, CPU backend), with the plugin installed.

One engine per family, started once (``tests/vllm_scenario.py``, as in ``test_vllm_engine.py``):
TP=2 with expert parallelism, EPLB on (synchronous), 2 redundant slots, float32. Its greedy
tokens must equal transformers' own greedy decoding of the same checkpoint (float32, one device,
no expert parallelism, computed in the test process): the reference a one-rank engine or an
EPLB-off engine of the same layout would give, since in float32 neither expert parallelism nor
a placement changes a token (``test_vllm_engine.py`` checks both engines against each other on
Qwen3-MoE). One engine per family instead of three keeps CI's time: each start costs 50-90 s.

- Mixtral (softmax top-2), eager;
- DeepSeek-V3 style (MLA, grouped top-k with sigmoid scores and a correction bias, a shared
  expert), **compiled**: in eager mode vLLM's CPU rotary kernel rotates only head 0 of MLA's
  3-D query, so eager DeepSeek tokens are wrong at TP=1 too (vLLM's bug, not worked around
  here); MLA on CPU needs ``attention_config={"backend": "CPU_MLA"}`` and ``kv_lora_rank +
  qk_rope_head_dim = 576``;
- Llama 4 (router weight applied on the input, top-1, fused expert weights): loads with
  redundant slots through ``integrations/vllm/llama4_loading.py``;
- GPT-OSS (expert biases, ``swigluoai``, attention sinks, sliding window): vLLM's model class
  lacks the ``MixtureOfExperts`` interface and builds no redundant slots;
  ``integrations/vllm/gpt_oss.py`` and ``moe_model.py`` supply both.
"""

from __future__ import annotations

import pytest
from test_vllm_engine import EPLB, MAX_TOKENS, PROMPTS, metrics, run_engine

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

pytestmark = pytest.mark.vllm

FAMILIES = {
    "mixtral": {"enforce_eager": True},
    "deepseek_v3": {"enforce_eager": False, "attention_config": {"backend": "CPU_MLA"}},
    "llama4": {"enforce_eager": True},
    "gpt_oss": {"enforce_eager": True},
}


def transformers_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers' own model class (float32, one device): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from eplb_graph.models import tiny_families

    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = getattr(tiny_families, f"write_tiny_{name}")(root / "model")
    llm = {
        **FAMILIES[name],
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "enable_eplb": True,
        "eplb_config": {**EPLB, "use_async": False},
        "additional_config": {"eplb_graph": {"metrics_path": str(root / "metrics")}},
    }
    out = run_engine(root, name, model, llm)
    return {
        "name": name,
        "tokens": out["tokens"][0],
        "metrics": metrics(root / "metrics"),
        "reference": transformers_greedy(model, PROMPTS, MAX_TOKENS),
    }


def test_rearrangements_commit_on_both_ranks_alike(family):
    from eplb_graph import Placement
    from eplb_graph.integrations.vllm.metrics import placement_digest

    layers = 2
    initial = placement_digest(
        Placement.default(layers, 8, EPLB["num_redundant_experts"], 2).phy2log
    )
    per_rank = family["metrics"]
    for rank in per_rank:
        assert rank["rearrangements"] >= 2 and rank["layers_committed"] >= 2, rank
        assert rank["aborted"] == 0 and rank["last_error"] is None, rank
        assert rank["placement_digest"] != initial, rank
    assert len({rank["placement_digest"] for rank in per_rank}) == 1
    if not FAMILIES[family["name"]]["enforce_eager"]:  # compiled: one graph, commits in place
        for rank in per_rank:
            compiled = rank["compile"]
            assert compiled["graph_breaks"] == 0 and compiled["unique_graphs"] >= 1
            assert compiled["unique_graphs"] == compiled["unique_graphs_at_first_step"]


def test_tokens_equal_one_device_without_expert_parallelism(family):
    """float32: which rank computes an expert, and where experts moved, changes no token."""
    tokens = family["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == family["reference"]

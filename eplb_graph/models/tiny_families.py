"""Tiny random checkpoints of more MoE families, for real vLLM engines (tests only).

Written with transformers' own model classes (``XxxForCausalLM(config).save_pretrained``), no hub:
hidden 128, 2 layers, 4 heads / 2 KV heads of 32 (vLLM's CPU attention supports head size 32;
DeepSeek-V3's MLA has 8 heads, see there), 8 experts, vocabulary 512, float32. Weights are drawn
larger than transformers' default init so routing and logits are not degenerate (the same recipe
as ``tiny_qwen3_moe``).
"""

from __future__ import annotations

from pathlib import Path

NUM_EXPERTS = 8
_COMMON = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _save(build, path: str | Path, seed: int, *, then=None) -> Path:
    """``build()`` under ``seed``: the same checkpoint every time (the model's own init draws
    some one-dimensional parameters, e.g. GPT-OSS's sinks, before the weights are redrawn)."""
    import torch

    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.1)
        if then is not None:
            then(model)
    path = Path(path)
    model.save_pretrained(path)
    return path


def write_tiny_llama4(path: str | Path, *, seed: int = 0) -> Path:
    """Llama 4 text: top-1 router applied on the input, a shared expert, fused expert weights."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **_COMMON,
        intermediate_size=64,
        intermediate_size_mlp=256,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        moe_layers=[0, 1],
        no_rope_layers=[1, 1],
        use_qk_norm=False,
        attention_chunk_size=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return _save(lambda: Llama4ForCausalLM(config), path, seed)


def write_tiny_mixtral(path: str | Path, *, seed: int = 0) -> Path:
    """Mixtral: softmax top-2 over 8 experts, separate ``w1``/``w2``/``w3`` per expert."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_COMMON,
        intermediate_size=64,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return _save(lambda: MixtralForCausalLM(config), path, seed)


def write_tiny_deepseek_v3(path: str | Path, *, seed: int = 0) -> Path:
    """DeepSeek-V3 style: MLA attention, grouped top-k (2 groups, 1 kept) with sigmoid scores and
    a correction bias, one shared expert.

    vLLM's CPU MLA backend needs ``kv_lora_rank + qk_rope_head_dim = 576`` (512 + 64). 8 heads, not
    the other families' 4: with 2 heads per rank (4 heads, TP=2) vLLM 0.32's compiled CPU MLA engine
    already differs from one rank at the first token without expert parallelism (prefill
    log-probabilities differ; TP=1 equals transformers, also with 2 heads), while with 4 or 8 heads
    per rank TP=2 equals TP=1 (issue 20, docs/vllm.md). MLA has no shared KV heads:
    ``num_key_value_heads`` equals the head count so that transformers' own forward (which repeats
    K/V by their ratio) runs too; vLLM reads no KV head count for MLA.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    config = DeepseekV3Config(
        **{**common, "num_attention_heads": 8, "num_key_value_heads": 8},
        intermediate_size=256,
        moe_intermediate_size=64,
        n_shared_experts=1,
        n_routed_experts=NUM_EXPERTS,
        routed_scaling_factor=2.5,  # DeepSeek-V3's own: a lost or doubled scale shows
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=32,
        qk_nope_head_dim=32,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # What DeepSeek-V3's own config.json says and vLLM reads (transformers assumes both).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )

    def correction_bias(model) -> None:  # transformers starts it at 0: make it steer routing
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)

    return _save(lambda: DeepseekV3ForCausalLM(config), path, seed, then=correction_bias)


def write_tiny_gpt_oss(path: str | Path, *, seed: int = 0) -> Path:
    """GPT-OSS: top-2 router with a bias, fused expert weights with biases, ``swigluoai``,
    attention sinks, alternating sliding / full attention. Unquantized (vLLM's mxfp4 experts have
    no CPU kernel; an unquantized checkpoint runs ``CPUUnquantizedExperts`` with biases)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **_COMMON,
        intermediate_size=64,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )  # GPT-OSS's own YaRN rope parameters (vLLM's model reads them)
    return _save(lambda: GptOssForCausalLM(config), path, seed)

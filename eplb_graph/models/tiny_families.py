"""Tiny random checkpoints of more MoE families, for real vLLM engines (tests only).

Written with transformers' own model classes (``XxxForCausalLM(config).save_pretrained``), no hub:
hidden 128, 2 layers, 4 heads / 2 KV heads of 32 (vLLM's CPU attention supports head size 32),
8 experts, vocabulary 512, float32. Weights are drawn larger than transformers' default init so
routing and logits are not degenerate (the same recipe as ``tiny_qwen3_moe``).
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


def _save(model, path: str | Path, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.1)
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
    return _save(Llama4ForCausalLM(config), path, seed)

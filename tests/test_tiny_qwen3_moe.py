"""The tiny Qwen3-MoE writer's router skew: Zipf-shaped popularity on low-numbered experts."""

from __future__ import annotations

import pytest
import torch

from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

pytest.importorskip("transformers")  # comes with the vllm extra


def _first_half_share(path, num_experts: int, top_k: int) -> float:
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    gate = weights["model.layers.0.mlp.gate.weight"]  # [E, H]
    hidden = torch.randn(4096, gate.shape[1], generator=torch.Generator().manual_seed(0))
    chosen = (hidden @ gate.T).topk(top_k, dim=1).indices
    return float((chosen < num_experts // 2).float().mean())


def test_zipf_skew_puts_most_choices_on_the_first_half(tmp_path):
    shape = {"num_experts": 16, "top_k": 4, "hidden_size": 64, "num_layers": 1}
    skewed = write_tiny_qwen3_moe(tmp_path / "zipf", router_zipf=1.2, **shape)
    uniform = write_tiny_qwen3_moe(tmp_path / "uniform", hot_experts=(), **shape)
    assert _first_half_share(skewed, 16, 4) > 0.7
    assert 0.4 < _first_half_share(uniform, 16, 4) < 0.6

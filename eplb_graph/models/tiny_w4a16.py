"""Tiny W4A16 checkpoints (compressed-tensors ``pack-quantized``) for real vLLM engines (tests).

The float Qwen3-MoE of the tests (``tiny_qwen3_moe``: skewed router, 8 experts) with its
**experts** quantized offline, the way ``llmcompressor`` writes a ``W4A16`` scheme without
calibration data: symmetric int4, one scale per group of :data:`GROUP_SIZE` input channels,
``<name>.weight_packed`` int32 ``[out, in / 8]`` (eight 4-bit values per word, packed with
compressed-tensors' own ``pack_to_int32``), ``<name>.weight_scale`` bfloat16 ``[out, in / group]``
and ``<name>.weight_shape`` ``[out, in]``. Attention, routers, embeddings and ``lm_head`` stay
float: vLLM's CPU W4A16 *linear* kernel is another kernel, and the experts are what EPLB moves.

vLLM 0.32 serves it with ``CompressedTensorsWNA16MoEMethod`` -> ``CPUExpertsInt4`` in
``dtype="bfloat16"`` (the plugin opens that kernel's device gate on AVX-512 CPUs without AMX,
see ``integrations/vllm/quantized.py``). The scales are rounded to bfloat16 *before* the weights
are quantized with them, so ``q * scale`` is exactly what the checkpoint means.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

GROUP_SIZE = 64
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
IGNORE = ["lm_head", r"re:.*self_attn\..*", r"re:.*mlp\.gate$"]


def quantization_config(group_size: int = GROUP_SIZE) -> dict:
    """compressed-tensors' description of W4A16: int4 group weights, float activations."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": list(IGNORE),
        "kv_cache_scheme": None,
    }


def quantize_int4_groups(weight, group_size: int = GROUP_SIZE):
    """``(int8 q in [-8, 7] [out, in], bfloat16 scale [out, in / group])``, ``weight ~= q * s``."""
    import torch

    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group {group_size}")
    grouped = weight.to(torch.float32).view(out_features, in_features // group_size, group_size)
    scale = (grouped.abs().amax(dim=2).clamp(min=1e-8) / 7.0).to(torch.bfloat16)
    quantized = torch.round(grouped / scale.float().unsqueeze(2)).clamp(-8, 7).to(torch.int8)
    return quantized.view(out_features, in_features), scale.contiguous()


def gptq_config(group_size: int = GROUP_SIZE) -> dict:
    """GPTQ's ``quantization_config``: 4-bit symmetric groups, no activation reordering. Which
    layers are quantized vLLM reads from the tensors' dtypes (only the experts' are int32)."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "lm_head": False,
        "checkpoint_format": "gptq",
    }


def _gptq_tensors(stem: str, quantized, scale, group_size: int) -> dict:
    """GPTQ's tensors of one linear: ``qweight`` int32 ``[in / 8, out]`` (``q + 8`` packed along
    the input), ``qzeros`` int32 ``[groups, out / 8]`` (GPTQ stores zero point 8 as 7),
    ``scales`` float16 ``[groups, out]`` (bf16-rounded values, exact in fp16), ``g_idx``."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out_features, in_features = quantized.shape
    groups = in_features // group_size
    zeros = torch.full((groups, out_features), 7 - 8, dtype=torch.int8)  # offset 8 -> nibble 7
    return {
        f"{stem}.qweight": pack_to_int32(quantized.t().contiguous(), 4, packed_dim=0).contiguous(),
        f"{stem}.qzeros": pack_to_int32(zeros, 4),
        f"{stem}.scales": scale.t().to(torch.float16).contiguous(),
        f"{stem}.g_idx": torch.arange(in_features, dtype=torch.int32) // group_size,
    }


#: AWQ's nibble order: nibble ``i`` of a word holds column ``8 j + AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_config(group_size: int = GROUP_SIZE) -> dict:
    """AutoAWQ's ``quantization_config`` (GEMM, asymmetric): attention and routers unconverted."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["self_attn", "mlp.gate"],
    }


def quantize_uint4_groups(weight, group_size: int = GROUP_SIZE):
    """Asymmetric: ``(q in [0, 15], zero in [0, 15] [out, in / group], bf16 scale)`` with
    ``weight ~= (q - zero) * scale``; zero points differ by expert (what AWQ checkpoints carry)."""
    import torch

    out_features, in_features = weight.shape
    grouped = weight.to(torch.float32).view(out_features, in_features // group_size, group_size)
    low = grouped.amin(dim=2).clamp(max=0.0)
    high = grouped.amax(dim=2).clamp(min=0.0)
    scale = ((high - low).clamp(min=1e-8) / 15.0).to(torch.bfloat16)
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    quantized = torch.round(grouped / scale.float().unsqueeze(2)) + zero.unsqueeze(2)
    quantized = quantized.clamp(0, 15).to(torch.int32).view(out_features, in_features)
    return quantized, zero.to(torch.int32), scale.contiguous()


def _pack_awq(values):
    """``[rows, cols]`` in [0, 15] -> int32 ``[rows, cols / 8]`` in AWQ's nibble order."""
    import torch

    rows, cols = values.shape
    blocks = values.view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].to(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (blocks << shifts).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _awq_tensors(stem: str, weight, group_size: int) -> dict:
    """AWQ's tensors of one linear: ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups,
    out / 8]`` (packed along the output, AWQ order), ``scales`` float16 ``[groups, out]``."""
    import torch

    quantized, zero, scale = quantize_uint4_groups(weight, group_size)
    return {
        f"{stem}.qweight": _pack_awq(quantized.t().contiguous()),
        f"{stem}.qzeros": _pack_awq(zero.t().contiguous()),
        f"{stem}.scales": scale.t().to(torch.float16).contiguous(),
    }


FORMATS = ("compressed-tensors", "gptq", "awq")


def write_tiny_w4a16(
    path: str | Path,
    *,
    seed: int = 0,
    group_size: int = GROUP_SIZE,
    checkpoint_format: str = "compressed-tensors",
) -> Path:
    """Write the W4A16 checkpoint folder ``path`` (float model written beside it, then removed)
    in ``checkpoint_format``: compressed-tensors ``pack-quantized``, GPTQ (both symmetric) or
    AWQ (asymmetric: per-group zero points)."""
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
    import tempfile

    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        source = write_tiny_qwen3_moe(Path(scratch) / "float", seed=seed)
        tensors = load_file(source / "model.safetensors")
        out = {}
        for name, tensor in tensors.items():
            if not EXPERT.search(name):
                out[name] = tensor.contiguous()
                continue
            stem = name[: -len(".weight")]
            if checkpoint_format == "awq":
                out.update(_awq_tensors(stem, tensor, group_size))
                continue
            quantized, scale = quantize_int4_groups(tensor, group_size)
            if checkpoint_format == "gptq":
                out.update(_gptq_tensors(stem, quantized, scale, group_size))
                continue
            out[f"{stem}.weight_packed"] = pack_to_int32(quantized, 4)
            out[f"{stem}.weight_scale"] = scale
            out[f"{stem}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
        save_file(out, path / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = {
            "gptq": gptq_config,
            "awq": awq_config,
            "compressed-tensors": quantization_config,
        }[checkpoint_format](group_size)
        (path / "config.json").write_text(json.dumps(config, indent=2))
        generation = source / "generation_config.json"
        if generation.exists():
            (path / "generation_config.json").write_text(generation.read_text())
    return path

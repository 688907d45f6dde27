"""FP8 block experts on vLLM's CPU backend (``CPUExpertsFp8``) with EP and EPLB.

vLLM's per-block FP8 MoE methods (online ``quantization="online", quantization_config={"moe":
"fp8_per_block"}``: ``Fp8PerBlockOnlineMoEMethod``; 128x128-block FP8 checkpoints) run
``CPUExpertsFp8`` on CPU: fp8 weights packed per expert, float32 block scales, bf16 activations
(W8A16). Their methods already declare ``supports_eplb``; two things stand between them and
expert parallelism with EPLB, each fixed here for this experts class only:

- **Local rows**: ``CPUExpertsFp8.apply`` hands its kernel global slot ids and no expert map,
  so with expert parallelism it indexes past the rank's weights. The wrapper calls
  ``torch.ops.eplb_graph.vllm_local_experts`` with the ``cpu_fp8_block`` kernel instead: vLLM's
  own kernel on the rank's own rows.
- **Device gate**: vLLM offers ``CPUExpertsFp8`` on x86 CPUs with AMX tiles only, though its
  kernel (``fused_experts_cpu``, FP8_W8A16) has an AVX-512 path: on CPUs with AVX-512, VNNI and
  AVX-512-BF16 but no AMX (AMD EPYC, this project's CI machines) vLLM otherwise has no FP8 MoE
  backend at all. The gate is opened there, with one INFO line; the tests check that path's
  results against a dequantized reference.

:func:`weight_view` names what moves: the packed fp8 weights and the block scales the kernel
reads (:class:`~eplb_graph.movement.views.cpu_fp8.CpuFp8BlockView`). Only 128x128 blocks are
accepted (the only block vLLM's online method writes, and DeepSeek-style checkpoints'); another
block shape is refused when EPLB attaches.
"""

from __future__ import annotations

import functools
import logging

import torch

from eplb_graph.integrations.vllm import compat
from eplb_graph.integrations.vllm.local_rows import (
    LocalRowsError,
    register_kernel,
    vllm_local_experts,
)
from eplb_graph.integrations.vllm.quantized import QuantizedLayerError
from eplb_graph.movement.views import ExpertWeightView, make_expert_view
from eplb_graph.movement.views.cpu_fp8 import BLOCK

logger = logging.getLogger(__name__)

KERNEL = "cpu_fp8_block"
"""The ``kernel`` name of ``vllm_local_experts`` for ``CPUExpertsFp8``."""


def avx512_fp8_capable() -> bool:
    """Whether this CPU runs the FP8 kernel's AVX-512 path (checked here: AVX-512 with VNNI and
    AVX-512-BF16, fp8 weights widened to bf16)."""
    cpu = torch.cpu
    return bool(
        cpu._is_avx512_supported() and cpu._is_vnni_supported() and cpu._is_avx512_bf16_supported()
    )


@register_kernel(KERNEL)
def _cpu_fp8_block(out, rows, weights, topk_weights, topk_ids, activation, isa, on_input):
    """vLLM's FP8 W8A16 CPU kernel (CPUExpertsFp8: packed fp8 weights, 128x128 block scales,
    bf16 activations, SiLU-and-mul only)."""
    from vllm._custom_ops import CPUQuantMethod, fused_experts_cpu

    if on_input or activation != "silu":
        raise LocalRowsError(
            "the FP8 CPU kernel computes silu experts with the router weight on the output only "
            f"(got activation {activation!r}, weight_on_input={on_input})"
        )
    w13, w2, w13_scale, w2_scale = weights
    fused_experts_cpu(
        out, rows, w13, w2, topk_weights, topk_ids, CPUQuantMethod.FP8_W8A16, w13_scale, w2_scale,
        None, None, list(BLOCK), None, None, None, None, True,
    )  # fmt: skip


def install() -> None:
    """Patch the FP8 experts' apply and their device gate (idempotent)."""
    _install_apply()
    _install_device_gate()


def _block_shape(kernel) -> tuple[int, ...] | None:
    """The weight block the kernel is told, found as ``CPUExpertsFp8.apply`` finds it (the
    config's ``block_shape``, else its w1 group shape)."""
    config = kernel.quant_config
    if config.block_shape:
        return tuple(config.block_shape)
    shape = config._w1.shape
    return None if shape is None else (shape.row, shape.col)


def _install_apply() -> None:
    owner, name, apply = compat.CPU_FP8_EXPERTS_APPLY.owner_and_value()
    if getattr(apply, "__wrapped__", None) is not None:
        return
    from eplb_graph.integrations.vllm.expert_parallel import _SCRATCH_STATS

    @functools.wraps(apply)
    def apply_on_local_rows(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
        global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
        expert_tokens_meta, apply_router_weight_on_input,
    ):  # fmt: skip
        if expert_map is None or apply_router_weight_on_input:  # vLLM's path (or its refusal)
            return apply(
                self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                expert_tokens_meta, apply_router_weight_on_input,
            )  # fmt: skip
        if _block_shape(self) != BLOCK:
            raise QuantizedLayerError(
                f"the FP8 CPU experts use {_block_shape(self)} blocks; eplb-graph's local-rows "
                f"kernel runs {BLOCK[0]}x{BLOCK[1]} blocks only"
            )
        stats = getattr(self, "eplb_stats", None)
        output.copy_(
            vllm_local_experts(
                hidden_states,
                topk_ids,
                topk_weights,
                expert_map,
                [w1, w2, self.w1_scale, self.w2_scale],
                _SCRATCH_STATS if stats is None else stats,
                KERNEL,
                activation.value,
                "",
                False,
            )
        )
        return None

    setattr(owner, name, apply_on_local_rows)


def _install_device_gate() -> None:
    owner, name, supported = compat.CPU_FP8_EXPERTS_DEVICE.owner_and_value()
    if getattr(supported, "__wrapped__", None) is not None:
        return

    @functools.wraps(supported)
    def supported_with_avx512() -> bool:
        if supported():
            return True
        from vllm.platforms import CpuArchEnum, current_platform

        if not (
            current_platform.is_cpu()
            and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and avx512_fp8_capable()
        ):
            return False
        _announce_avx512()
        return True

    setattr(owner, name, staticmethod(supported_with_avx512))


@functools.cache
def _announce_avx512() -> None:
    """The gate is asked once per backend choice: say it once per process."""
    logger.info(
        "eplb-graph: CPUExpertsFp8 runs its kernel's AVX-512 path on this CPU (no AMX tiles; "
        "vLLM offers it with AMX only)"
    )


def is_fp8_experts(kernel: object) -> bool:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8

    return type(kernel) is CPUExpertsFp8


def weight_view(index: int, experts, kernel) -> ExpertWeightView:
    """The view of one ``CPUExpertsFp8`` layer: packed fp8 weights and the kernel's block scales.

    The scales are taken from the kernel (``w1_scale``/``w2_scale``: what it reads) and must be
    the layer's own parameters (``w13_weight_scale_inv``), so a moved scale is the one vLLM's
    model sees too.
    """
    if _block_shape(kernel) != BLOCK:
        raise QuantizedLayerError(
            f"MoE layer {index}: the FP8 CPU experts use {_block_shape(kernel)} blocks; "
            f"eplb-graph moves and computes {BLOCK[0]}x{BLOCK[1]}-block FP8 experts only"
        )
    tensors = {"w13": experts.w13_weight.data, "w2": experts.w2_weight.data}
    for ours, theirs, stem in (("w13_scale", "w1_scale", "w13"), ("w2_scale", "w2_scale", "w2")):
        read = getattr(kernel, theirs, None)
        layer = getattr(experts, f"{stem}_weight_scale_inv", None)
        if read is None or layer is None or read.data_ptr() != layer.data_ptr():
            raise QuantizedLayerError(
                f"MoE layer {index}: the FP8 kernel's {theirs} is not the layer's "
                f"{stem}_weight_scale_inv parameter; eplb-graph would move a copy the kernel "
                "does not read"
            )
        tensors[ours] = read.data
    return make_expert_view("cpu_fp8_block", tensors)

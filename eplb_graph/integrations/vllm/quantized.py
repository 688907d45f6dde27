"""Quantized experts on vLLM's CPU backend: W8A8 int8 (``CPUExpertsInt8``) with EP and EPLB.

Both of vLLM's W8A8 int8 MoE methods, compressed-tensors checkpoints
(``CompressedTensorsW8A8Int8MoEMethod``) and online quantization (``quantization=
"experts_int8"``, ``Int8OnlineMoEMethod``), run ``CPUExpertsInt8`` on CPU. Three things stand
between them and expert parallelism with EPLB, and each is fixed here, for this experts class
only (the formats the plugin really moves):

- **Local rows**: ``CPUExpertsInt8.apply`` hands its kernel global slot ids and no expert map,
  so with expert parallelism it indexes past the rank's weights (a segfault in
  ``moe_align_block_size``). The wrapper calls ``torch.ops.eplb_graph.vllm_local_experts``
  with the ``cpu_int8_w8a8`` kernel instead: vLLM's own kernel on the rank's own rows.
- **EPLB refusal**: compressed-tensors' method says ``supports_eplb = False`` and vLLM raises
  ``NotImplementedError`` when the layer is built. It now says ``True`` when (and only when) its
  experts are ``CPUExpertsInt8``, whose weights and scales :func:`weight_view` moves.
- **Device gate**: vLLM offers ``CPUExpertsInt8`` on x86 CPUs with AMX tiles only, though its
  kernel (``fused_experts_cpu``, INT8_W8A8) has an AVX-512 path: on CPUs with AVX-512, VNNI and
  AVX-512-BF16 but no AMX (AMD EPYC, this project's CI machines) vLLM otherwise has no int8 MoE
  backend at all. The gate is opened there, with one INFO line; the tests check that path's
  results against a dequantized reference.
"""

from __future__ import annotations

import functools
import logging

import torch

from eplb_graph.integrations.vllm import compat
from eplb_graph.integrations.vllm.local_rows import vllm_local_experts
from eplb_graph.movement.views import ExpertWeightView, make_expert_view

logger = logging.getLogger(__name__)


class QuantizedLayerError(compat.VllmPluginError):
    """A quantized MoE layer's live tensors are not the ones its kernel reads."""


def avx512_int8_capable() -> bool:
    """Whether this CPU runs the int8 kernel's AVX-512 path (VNNI dot products, bf16 I/O)."""
    cpu = torch.cpu
    return bool(
        cpu._is_avx512_supported() and cpu._is_vnni_supported() and cpu._is_avx512_bf16_supported()
    )


def install() -> None:
    """Patch the int8 experts' apply, its device gate and compressed-tensors' EPLB flag."""
    _install_apply()
    _install_device_gate()
    _install_supports_eplb()


def _install_apply() -> None:
    owner, name, apply = compat.CPU_INT8_EXPERTS_APPLY.owner_and_value()
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
        stats = getattr(self, "eplb_stats", None)
        output.copy_(
            vllm_local_experts(
                hidden_states,
                topk_ids,
                topk_weights,
                expert_map,
                [w1, w2, self.w1_scale, self.w2_scale],
                _SCRATCH_STATS if stats is None else stats,
                "cpu_int8_w8a8",
                activation.value,
                "",
                False,
            )
        )
        return None

    setattr(owner, name, apply_on_local_rows)


def _install_device_gate() -> None:
    owner, name, supported = compat.CPU_INT8_EXPERTS_DEVICE.owner_and_value()
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
            and avx512_int8_capable()
        ):
            return False
        logger.info(
            "eplb-graph: CPUExpertsInt8 runs its kernel's AVX-512 path on this CPU (no AMX "
            "tiles; vLLM offers it with AMX only)"
        )
        return True

    setattr(owner, name, staticmethod(supported_with_avx512))


def _install_supports_eplb() -> None:
    owner, name, flag = compat.W8A8_INT8_SUPPORTS_EPLB.owner_and_value()
    if getattr(flag.fget, "__wrapped__", None) is not None:
        return

    @functools.wraps(flag.fget)
    def supports_eplb(self) -> bool:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt8

        return getattr(self, "experts_cls", None) is CPUExpertsInt8 or flag.fget(self)

    setattr(owner, name, property(supports_eplb))


def is_int8_experts(kernel: object) -> bool:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt8

    return type(kernel) is CPUExpertsInt8


def weight_view(index: int, experts, kernel) -> ExpertWeightView:
    """The view of one ``CPUExpertsInt8`` layer: packed int8 weights and the kernel's scales.

    The scales are taken from the kernel (``w1_scale``/``w2_scale``: what it reads) and must be
    the layer's own parameters (``w13_weight_scale`` or, online, ``w13_scale``), so a moved
    scale is the one vLLM's model sees too.
    """
    tensors = {"w13": experts.w13_weight.data, "w2": experts.w2_weight.data}
    for ours, theirs, stem in (("w13_scale", "w1_scale", "w13"), ("w2_scale", "w2_scale", "w2")):
        read = getattr(kernel, theirs, None)
        layer = getattr(experts, f"{stem}_weight_scale", None)
        if layer is None:
            layer = getattr(experts, f"{stem}_scale", None)
        if read is None or layer is None or read.data_ptr() != layer.data_ptr():
            raise QuantizedLayerError(
                f"MoE layer {index}: the int8 kernel's {theirs} is not the layer's {stem} scale "
                "parameter; eplb-graph would move a copy the kernel does not read"
            )
        tensors[ours] = read.data
    return make_expert_view("cpu_int8_packed", tensors)

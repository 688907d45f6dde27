"""Quantized experts on vLLM's CPU backend with EP and EPLB: the experts classes the plugin moves.

Each entry of :data:`FORMATS` is one vLLM CPU experts class whose weights eplb-graph really
moves, whole: W8A8 int8 (``CPUExpertsInt8``: vLLM's compressed-tensors W8A8 int8 method and
online ``quantization="experts_int8"``), W4A16 (``CPUExpertsInt4``: compressed-tensors
``pack-quantized``, GPTQ and AWQ int4 groups) and FP8 with 128x128 blocks (``CPUExpertsFp8``:
vLLM's per-block FP8 methods, W8A16). Three things stand between such a class and expert
parallelism with EPLB, and each is fixed here, for the listed classes only:

- **Local rows**: these classes' ``apply`` hands the kernel global slot ids and no expert map,
  so with expert parallelism it indexes past the rank's weights (a segfault in
  ``moe_align_block_size``). The wrapper calls ``torch.ops.eplb_graph.vllm_local_experts`` with
  the format's kernel instead: vLLM's own kernel on the rank's own rows.
- **EPLB refusal**: the int8 and int4 methods say ``supports_eplb = False`` and vLLM raises
  ``NotImplementedError`` when the layer is built. The listed methods now say ``True`` when (and
  only when) their experts are the listed class, whose weights, scales and zero points
  :func:`weight_view` moves (vLLM's FP8 methods already say ``True``).
- **Device gate**: vLLM offers the three classes on x86 CPUs with AMX tiles only, though their
  kernel (``fused_experts_cpu``: INT8_W8A8, INT4_W4A8, FP8_W8A16) has an AVX-512 path: on CPUs
  with AVX-512, VNNI and AVX-512-BF16 but no AMX (AMD EPYC, this project's CI machines) vLLM
  otherwise has no int8, int4 or FP8 MoE backend at all. The gate is opened there, with one INFO
  line per class and process; the tests check that path against dequantized references.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eplb_graph.integrations.vllm import compat
from eplb_graph.integrations.vllm.local_rows import vllm_local_experts
from eplb_graph.movement.views import ExpertWeightView, make_expert_view
from eplb_graph.movement.views.cpu_fp8 import BLOCK

logger = logging.getLogger(__name__)


class QuantizedLayerError(compat.VllmPluginError):
    """A quantized MoE layer's live tensors are not the ones its kernel reads."""


@dataclass(frozen=True)
class QuantizedExperts:
    """One vLLM CPU experts class whose weights the plugin moves, and how it is wired.

    ``supports_eplb``: the quantization methods whose EPLB refusal is lifted for this class
    (each tested with a real engine). ``tensors``: ``(view name, kernel attribute, layer
    attribute names)`` for every per-expert tensor besides ``w13``/``w2``, in the order the
    local-rows kernel takes them; the layer names differ by method (compressed-tensors
    ``w13_weight_scale``, GPTQ ``w13_scales``). The kernel's attribute (what it reads) must be
    one of the layer's parameters, so a moved tensor is the one vLLM's model sees too.
    """

    experts_class: str
    kernel: str
    view_format: str
    apply: compat.PatchTarget
    device: compat.PatchTarget
    supports_eplb: tuple[compat.PatchTarget, ...]
    tensors: tuple[tuple[str, str, tuple[str, ...]], ...]
    problem: Callable[[object], str | None] = lambda kernel: None

    def experts_type(self) -> type:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe

        return getattr(cpu_moe, self.experts_class)


INT8 = QuantizedExperts(
    experts_class="CPUExpertsInt8",
    kernel="cpu_int8_w8a8",
    view_format="cpu_int8_packed",
    apply=compat.CPU_INT8_EXPERTS_APPLY,
    device=compat.CPU_INT8_EXPERTS_DEVICE,
    supports_eplb=(compat.W8A8_INT8_SUPPORTS_EPLB,),
    tensors=(
        ("w13_scale", "w1_scale", ("w13_weight_scale", "w13_scale")),
        ("w2_scale", "w2_scale", ("w2_weight_scale", "w2_scale")),
    ),
)
INT4 = QuantizedExperts(
    experts_class="CPUExpertsInt4",
    kernel="cpu_int4_w4a8",
    view_format="cpu_int4_packed",
    apply=compat.CPU_INT4_EXPERTS_APPLY,
    device=compat.CPU_INT4_EXPERTS_DEVICE,
    supports_eplb=(compat.WNA16_SUPPORTS_EPLB, compat.GPTQ_SUPPORTS_EPLB, compat.AWQ_SUPPORTS_EPLB),
    tensors=(
        ("w13_scale", "w1_scale", ("w13_weight_scale", "w13_scales")),
        ("w2_scale", "w2_scale", ("w2_weight_scale", "w2_scales")),
        ("w13_zp", "w1_zp", ("w13_weight_zero_point", "w13_qzeros")),
        ("w2_zp", "w2_zp", ("w2_weight_zero_point", "w2_qzeros")),
    ),
)


def fp8_block_shape(kernel) -> tuple[int, ...] | None:
    """The weight block an FP8 kernel is told, found as ``CPUExpertsFp8.apply`` finds it (the
    config's ``block_shape``, else its w1 group shape)."""
    config = kernel.quant_config
    if config.block_shape:
        return tuple(config.block_shape)
    shape = config._w1.shape
    return None if shape is None else (shape.row, shape.col)


def _fp8_block_problem(kernel) -> str | None:
    block = fp8_block_shape(kernel)
    if block == BLOCK:
        return None
    return (
        f"the FP8 CPU experts use {block} blocks; eplb-graph moves and computes "
        f"{BLOCK[0]}x{BLOCK[1]}-block FP8 experts only"
    )


FP8 = QuantizedExperts(
    experts_class="CPUExpertsFp8",
    kernel="cpu_fp8_block",
    view_format="cpu_fp8_block",
    apply=compat.CPU_FP8_EXPERTS_APPLY,
    device=compat.CPU_FP8_EXPERTS_DEVICE,
    supports_eplb=(),
    tensors=(
        ("w13_scale", "w1_scale", ("w13_weight_scale_inv",)),
        ("w2_scale", "w2_scale", ("w2_weight_scale_inv",)),
    ),
    problem=_fp8_block_problem,
)
FORMATS = (INT8, INT4, FP8)


def avx512_vnni_bf16_capable() -> bool:
    """Whether this CPU runs the quantized kernels' AVX-512 path (VNNI dot products, bf16 I/O)."""
    cpu = torch.cpu
    return bool(
        cpu._is_avx512_supported() and cpu._is_vnni_supported() and cpu._is_avx512_bf16_supported()
    )


def install() -> None:
    """Patch each listed experts class's apply and device gate, and its methods' EPLB flags."""
    for experts in FORMATS:
        _install_apply(experts)
        _install_device_gate(experts)
        for method in experts.supports_eplb:
            _install_supports_eplb(experts, method)


def _install_apply(experts: QuantizedExperts) -> None:
    from eplb_graph.integrations.vllm.expert_parallel import _SCRATCH_STATS, wrap_apply

    attributes = [attribute for _, attribute, _ in experts.tensors]

    def on_local_rows(call: dict) -> bool:
        if call["expert_map"] is None or call["apply_router_weight_on_input"]:
            return False  # vLLM's path (or its refusal)
        kernel = call["self"]
        reason = _problem_once(experts, kernel)
        if reason is not None:
            raise QuantizedLayerError(reason)
        stats = getattr(kernel, "eplb_stats", None)
        call["output"].copy_(
            vllm_local_experts(
                call["hidden_states"],
                call["topk_ids"],
                call["topk_weights"],
                call["expert_map"],
                [call["w1"], call["w2"], *(getattr(kernel, name) for name in attributes)],
                _SCRATCH_STATS if stats is None else stats,
                experts.kernel,
                call["activation"].value,
                "",
                False,
            )
        )
        return True

    wrap_apply(experts.apply, on_local_rows)


def _problem_once(experts: QuantizedExperts, kernel) -> str | None:
    """``experts.problem(kernel)``, asked on the first forward only: a kernel's configuration
    does not change while it serves, and ``apply`` runs every layer of every step."""
    try:
        return kernel._eplb_graph_problem
    except AttributeError:
        kernel._eplb_graph_problem = experts.problem(kernel)
        return kernel._eplb_graph_problem


def _install_device_gate(experts: QuantizedExperts) -> None:
    owner, name, supported = experts.device.owner_and_value()
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
            and avx512_vnni_bf16_capable()
        ):
            return False
        _announce_avx512(experts.experts_class)
        return True

    setattr(owner, name, staticmethod(supported_with_avx512))


@functools.cache
def _announce_avx512(experts_class: str) -> None:
    """The gate is asked at every backend choice: say it once per class and process."""
    logger.info(
        "eplb-graph: %s runs its kernel's AVX-512 path on this CPU (no AMX tiles; vLLM offers "
        "it with AMX only)",
        experts_class,
    )


def _install_supports_eplb(experts: QuantizedExperts, method: compat.PatchTarget) -> None:
    owner, name, flag = method.owner_and_value()
    if getattr(flag.fget, "__wrapped__", None) is not None:
        return

    @functools.wraps(flag.fget)
    def supports_eplb(self) -> bool:
        return getattr(self, "experts_cls", None) is experts.experts_type() or flag.fget(self)

    setattr(owner, name, property(supports_eplb))


def format_of(kernel: object) -> QuantizedExperts | None:
    """The listed format whose experts class ``kernel`` is exactly, or ``None``."""
    for experts in FORMATS:
        if type(kernel) is experts.experts_type():
            return experts
    return None


def weight_view(index: int, layer, kernel) -> ExpertWeightView:
    """The view of one quantized MoE layer: packed weights and every tensor the kernel reads
    beside them (scales, zero points), each checked to be the layer's own parameter."""
    experts = format_of(kernel)
    if experts is None:
        raise QuantizedLayerError(
            f"MoE layer {index}: {type(kernel).__name__} is not one of the quantized experts "
            f"eplb-graph moves ({', '.join(f.experts_class for f in FORMATS)})"
        )
    reason = experts.problem(kernel)
    if reason is not None:
        raise QuantizedLayerError(f"MoE layer {index}: {reason}")
    tensors = {"w13": layer.w13_weight.data, "w2": layer.w2_weight.data}
    for ours, theirs, candidates in experts.tensors:
        read = getattr(kernel, theirs, None)
        own = next(
            (getattr(layer, c) for c in candidates if getattr(layer, c, None) is not None), None
        )
        if read is None or own is None or read.data_ptr() != own.data_ptr():
            raise QuantizedLayerError(
                f"MoE layer {index}: the {experts.experts_class} kernel's {theirs} is not the "
                f"layer's {' or '.join(candidates)} parameter; eplb-graph would move a copy the "
                "kernel does not read"
            )
        tensors[ours] = read.data
    return make_expert_view(experts.view_format, tensors)

"""One EP rank's expert work on vLLM's CPU kernels: only the rank's own (token, k) rows.

vLLM's CPU expert parallelism routes every token on every rank and all-reduces partial sums.
Its kernels (``cpu_fused_moe``, ...) compute every row they are given, so handing them all
``T x K`` rows (other ranks' rows on local row 0 with weight 0) makes each rank compute the
whole layer whatever the placement: a better placement saves nothing. And where the router
weight is applied to the input (Llama 4), the kernel ignores ``topk_weights``, so weight 0 does
not even exclude the row.

``torch.ops.eplb_graph.vllm_local_experts`` fixes both inside one registered op: fixed output
shape ``[T, H]`` (so it traces into vLLM's fullgraph compile as one node, with a fake kernel),
data-dependent work inside. Its CPU implementation keeps the ``M`` (token, k) rows whose slot is
local, gathers them into ``[M, H]`` with top-1 ids and weights, runs vLLM's own kernel on just
those rows (reading the very tensors the plugin's weight views move: vLLM's prepacked layout),
and adds them back into ``[T, H]``. It times itself into the layer's ``stats`` row
(``EplbState.expert_stats[layer]``: rows, nanoseconds, active local slots), which is how
per-rank expert time, and what drives it, is measured inside compiled graphs.

The one place that knows how to call an experts class's kernel on compacted rows is
:data:`KERNELS`: add an entry (``register_kernel``) for another vLLM CPU kernel (int8, ...) and
pass its name as ``kernel``; the compaction, timing and combine are shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eplb_graph.errors import EplbError

SCHEMA = (
    "vllm_local_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor expert_map,"
    " Tensor?[] weights, Tensor(a!) stats, str kernel, str activation, str isa,"
    " bool weight_on_input=False) -> Tensor"
)

KernelCall = Callable[..., None]
"""``(out [M, H], rows [M, H], weights list, topk_weights [M, 1], topk_ids [M, 1],
activation, isa, weight_on_input) -> None``: vLLM's kernel on compacted rows, writing ``out``."""

KERNELS: dict[str, KernelCall] = {}


class LocalRowsError(EplbError, ValueError):
    """Bad input to ``vllm_local_experts`` (unknown kernel, wrong shapes or dtypes)."""


def register_kernel(name: str) -> Callable[[KernelCall], KernelCall]:
    """Make ``name`` a ``kernel`` value of the op (one per vLLM CPU experts kernel)."""

    def add(call: KernelCall) -> KernelCall:
        KERNELS[name] = call
        return call

    return add


@register_kernel("cpu_fused_moe")
def _cpu_fused_moe(out, rows, weights, topk_weights, topk_ids, activation, isa, on_input):
    """vLLM's unquantized CPU kernel (CPUUnquantizedExperts: isa "vec"; X86...: "amx")."""
    from vllm._custom_ops import cpu_fused_moe

    w13, w2, w13_bias, w2_bias = weights
    cpu_fused_moe(
        out, rows, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, activation, isa, on_input
    )


def _register_fused_experts_cpu(name: str, method: str, label: str, block: bool) -> None:
    """One of vLLM's quantized CPU kernels (``fused_experts_cpu``), SiLU-and-mul experts with
    the router weight on the output only. ``weights``: ``[w13, w2, w13_scale, w2_scale]`` and,
    for int4, ``w13_zp, w2_zp``; ``block``: FP8's 128x128 weight blocks.

    - ``cpu_int8_w8a8`` (CPUExpertsInt8): VNNI-packed int8, per-channel scales, int8 tokens;
    - ``cpu_int4_w4a8`` (CPUExpertsInt4): blocked int4 groups with scales and zero points;
    - ``cpu_fp8_block`` (CPUExpertsFp8): packed fp8, 128x128 block scales, bf16 activations.
    """

    def call(out, rows, weights, topk_weights, topk_ids, activation, isa, on_input):
        from vllm._custom_ops import CPUQuantMethod, fused_experts_cpu

        from eplb_graph.movement.views.cpu_fp8 import BLOCK

        if on_input or activation != "silu":
            raise LocalRowsError(
                f"the {label} CPU kernel computes silu experts with the router weight on the "
                f"output only (got activation {activation!r}, weight_on_input={on_input})"
            )
        w13, w2, w13_scale, w2_scale, *zero_points = weights
        w13_zp, w2_zp = zero_points or (None, None)
        fused_experts_cpu(
            out, rows, w13, w2, topk_weights, topk_ids, getattr(CPUQuantMethod, method),
            w13_scale, w2_scale, w13_zp, w2_zp, list(BLOCK) if block else None,
            None, None, None, None, True,
        )  # fmt: skip

    register_kernel(name)(call)


for _name, _method, _label, _block in (
    ("cpu_int8_w8a8", "INT8_W8A8", "int8", False),
    ("cpu_int4_w4a8", "INT4_W4A8", "int4", False),
    ("cpu_fp8_block", "FP8_W8A16", "FP8", True),
):
    _register_fused_experts_cpu(_name, _method, _label, _block)


def _check(hidden, topk_ids, topk_weights, expert_map, stats, kernel) -> None:
    if kernel not in KERNELS:
        raise LocalRowsError(f"kernel {kernel!r} is not one of {sorted(KERNELS)}")
    if hidden.dim() != 2:
        raise LocalRowsError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise LocalRowsError(
            f"topk_ids must be [T, K] with T={hidden.shape[0]}, got {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise LocalRowsError(
            f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}"
        )
    if expert_map.dim() != 1:
        raise LocalRowsError(f"expert_map must be [P], got shape {tuple(expert_map.shape)}")
    if stats.dtype != torch.int64 or tuple(stats.shape) not in ((2,), (3,)):
        raise LocalRowsError(
            f"stats must be int64 [2] (rows, ns) or [3] (rows, ns, active slots), got "
            f"{stats.dtype} {tuple(stats.shape)}"
        )


LAST_CALL: list = [None]
"""The newest call's fixed arguments ``(expert_map, weights, kernel, activation, isa,
weight_on_input, hidden dtype, hidden size, topk_ids dtype)``: what a cost calibration needs to
replay this rank's very kernel on its live weights (``calibration.py``). One list store per call."""


def local_experts_cpu(
    hidden, topk_ids, topk_weights, expert_map, weights, stats, kernel, activation, isa,
    weight_on_input=False,
):  # fmt: skip
    """The CPU implementation: compact the local rows, run ``KERNELS[kernel]``, add back."""
    started = time.perf_counter_ns()
    _check(hidden, topk_ids, topk_weights, expert_map, stats, kernel)
    num_tokens, top_k = topk_ids.shape
    local = expert_map.index_select(0, topk_ids.reshape(-1).long())
    flat = torch.nonzero(local >= 0).squeeze(1)  # (token, k) rows this rank holds, t-major
    rows = flat.numel()
    active = 0
    accumulate = torch.float32 if hidden.dtype != torch.float32 else hidden.dtype
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=accumulate, device=hidden.device)
    if rows:
        tokens = flat // top_k
        partial = torch.empty(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        KERNELS[kernel](
            partial,
            hidden.index_select(0, tokens).contiguous(),
            list(weights),
            topk_weights.reshape(-1).index_select(0, flat).view(rows, 1).contiguous(),
            local.index_select(0, flat).to(topk_ids.dtype).view(rows, 1).contiguous(),
            activation,
            isa,
            weight_on_input,
        )
        out.index_add_(0, tokens, partial.to(accumulate))
        if stats.shape[0] == 3:
            active = int(torch.unique(local.index_select(0, flat)).numel())
    stats[0] += rows
    stats[1] += time.perf_counter_ns() - started
    if stats.shape[0] == 3:
        stats[2] += active
    LAST_CALL[0] = (
        expert_map, weights, kernel, activation, isa, weight_on_input, hidden.dtype,
        hidden.shape[1], topk_ids.dtype,
    )  # fmt: skip
    return out.to(hidden.dtype)


def _fake(
    hidden, topk_ids, topk_weights, expert_map, weights, stats, kernel, activation, isa,
    weight_on_input=False,
):  # fmt: skip
    return hidden.new_empty(hidden.shape)


def _register() -> None:
    namespace = torch.ops.eplb_graph
    if hasattr(namespace, "vllm_local_experts"):
        return
    library = torch.library.Library("eplb_graph", "FRAGMENT")
    library.define(SCHEMA)
    library.impl("vllm_local_experts", local_experts_cpu, "CPU")
    torch.library.register_fake("eplb_graph::vllm_local_experts", _fake, lib=library)
    _LIBRARIES.append(library)  # dropping the library would unregister the op


_LIBRARIES: list[torch.library.Library] = []
_register()


def vllm_local_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor,
    weights: list[torch.Tensor | None],
    stats: torch.Tensor,
    kernel: str = "cpu_fused_moe",
    activation: str = "silu",
    isa: str = "vec",
    weight_on_input: bool = False,
) -> torch.Tensor:
    """``[T, H]``: the sum of this rank's (token, k) rows, other ranks' rows skipped."""
    return torch.ops.eplb_graph.vllm_local_experts(
        hidden, topk_ids, topk_weights, expert_map, weights, stats, kernel, activation, isa,
        weight_on_input,
    )  # fmt: skip

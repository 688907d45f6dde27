"""vLLM's CPU int8 experts (``CPUExpertsInt8``): VNNI-packed int8 weights with their scales.

After loading, vLLM repacks each expert's int8 ``[rows, cols]`` matrix into the VNNI layout its
CPU kernel reads and appends ``4`` bytes per row: the int32 compensation (``-128 * sum`` of the
row's weights, for unsigned activations). The packing is per expert, so the packed tensors keep
their ``[slots, ...]`` shape and slot ``s`` of ``w13 [S, 2I, H + 4]`` / ``w2 [S, H, I + 4]`` is
exactly one expert, compensation included. Its per-output-channel float32 scales (``[S, 2I, 1]``
from compressed-tensors checkpoints, ``[S, 2I]`` from online ``experts_int8`` quantization) are
meaningless without those bytes: all four travel in one payload, as one transaction.
"""

from __future__ import annotations

import torch

from eplb_graph.movement.views import table
from eplb_graph.movement.views.checks import FormatChecker

#: Bytes the CPU int8 packing appends to every row (one int32 compensation term).
COMPENSATION_BYTES = 4


class CpuInt8PackedView(table.TensorTableView):
    """``w13`` int8 ``[S, 2I, H + 4]``, ``w2`` int8 ``[S, H, I + 4]`` (packed, compensation
    included), ``w13_scale`` float32 ``[S, 2I]`` or ``[S, 2I, 1]``, ``w2_scale`` float32
    ``[S, H]`` or ``[S, H, 1]``; every byte of a slot moves."""

    FORMAT = "cpu_int8_packed"
    TENSORS = (*table.WEIGHTS, "w13_scale", "w2_scale")

    def _lay_out(self, check: FormatChecker, tensors: table.Tensors) -> table.Layout:
        w13_shape, w2_shape, fields = table.expert_weights(check, tensors, (torch.int8,))
        hidden, intermediate = w2_shape[1], w13_shape[1] // 2
        check.equal("gate+up rows: w13.shape[1] is even", w13_shape[1] % 2, 0)
        check.equal(
            f"w13.shape[2] (hidden {hidden} + {COMPENSATION_BYTES} compensation bytes)",
            w13_shape[2],
            hidden + COMPENSATION_BYTES,
        )
        check.equal(
            f"w2.shape[2] (intermediate {intermediate} + {COMPENSATION_BYTES} compensation bytes)",
            w2_shape[2],
            intermediate + COMPENSATION_BYTES,
        )
        for name, rows in (("w13_scale", 2 * intermediate), ("w2_scale", hidden)):
            scale = tensors[name]
            dims = scale.dim() if isinstance(scale, torch.Tensor) else 0
            if dims not in (2, 3):
                check.fail(f"{name!r} must be [S, {rows}] or [S, {rows}, 1], got {dims}-D")
            shape = check.tensor(name, scale, dims, (torch.float32,))
            check.equal(f"{name}.shape[1] (output channels)", shape[1], rows)
            if dims == 3:
                check.equal(f"{name}.shape[2] (one scale per channel)", shape[2], 1)
            fields.append(table.leading_field(name, scale))
        return fields, {}

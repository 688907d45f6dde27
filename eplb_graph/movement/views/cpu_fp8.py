"""vLLM's CPU FP8 block experts (``CPUExpertsFp8``): packed fp8 weights with 128x128 block scales.

After loading, vLLM repacks each expert's ``float8_e4m3fn`` ``[rows, cols]`` matrix into the
VNNI layout its CPU kernel (W8A16: fp8 weights, bf16 activations) reads. Unlike the int8 packing
nothing is appended, so the packed tensors keep their logical shapes ``w13 [S, 2I, H]`` and
``w2 [S, H, I]``, and the packing is per expert: slot ``s`` is exactly one expert. Its float32
scales hold one value per 128x128 block of that expert's matrix (``[S, ceil(2I/128),
ceil(H/128)]`` and ``[S, ceil(H/128), ceil(I/128)]``); a block's fp8 bytes mean nothing without
its scale, so all four travel in one payload, as one transaction.
"""

from __future__ import annotations

import torch

from eplb_graph.movement.views import table
from eplb_graph.movement.views.checks import FormatChecker
from eplb_graph.movement.views.registry import _keyword_factory, register_weight_format

#: The weight block (rows, columns) one scale covers: vLLM's online per-block FP8 and the
#: DeepSeek-style FP8 checkpoints use 128x128.
BLOCK = (128, 128)

#: The fp8 encoding vLLM's CPU kernel reads (the platform's ``fp8_dtype()`` on CPU).
FP8_DTYPES = (torch.float8_e4m3fn,)


def _blocks(size: int, block: int) -> int:
    return (size + block - 1) // block


class CpuFp8BlockView(table.TensorTableView):
    """``w13`` fp8 ``[S, 2I, H]``, ``w2`` fp8 ``[S, H, I]`` (packed per expert), ``w13_scale``
    float32 ``[S, ceil(2I/128), ceil(H/128)]``, ``w2_scale`` float32 ``[S, ceil(H/128),
    ceil(I/128)]``; every byte of a slot moves."""

    FORMAT = "cpu_fp8_block"
    TENSORS = (*table.WEIGHTS, "w13_scale", "w2_scale")

    def _lay_out(self, check: FormatChecker, tensors: table.Tensors) -> table.Layout:
        w13_shape, w2_shape, fields = table.expert_weights(check, tensors, FP8_DTYPES)
        check.gated_mlp(w13_shape, w2_shape)
        for name, weight in (("w13_scale", w13_shape), ("w2_scale", w2_shape)):
            shape = check.tensor(name, tensors[name], 3, (torch.float32,))
            stem = name.removesuffix("_scale")
            for dim, block in ((1, BLOCK[0]), (2, BLOCK[1])):
                check.equal(
                    f"{name}.shape[{dim}] ({block}-wide blocks of {stem}'s {weight[dim]})",
                    shape[dim],
                    _blocks(weight[dim], block),
                )
            fields.append(table.leading_field(name, tensors[name]))
        return fields, {}


register_weight_format(CpuFp8BlockView.FORMAT, _keyword_factory(CpuFp8BlockView))

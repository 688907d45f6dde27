"""vLLM's CPU int4 experts (``CPUExpertsInt4``, W4A16): blocked int4 weights, scales, zero points.

After loading, vLLM repacks each expert's int4 groups (``convert_weight_packed_scale_zp``) into
the tiles its CPU kernel reads: weights ``uint8 [S, N / 32, K / 64, bytes]``, and beside them the
group scales ``float32 [S, N / 32, K / 64, 32]`` and zero points ``int8 [S, N / 32, K / 64, 32]``
(synthesised as 8 for symmetric checkpoints, still read by the kernel). The repacking is per
expert: packing expert ``e`` alone gives exactly slot ``e``'s bytes, so a slot is one expert and
its three tensors of each matrix are meaningless apart: all six travel in one payload.
"""

from __future__ import annotations

import torch

from eplb_graph.movement.views import table
from eplb_graph.movement.views.checks import FormatChecker


class CpuInt4PackedView(table.TensorTableView):
    """``w13``/``w2`` uint8 ``[S, Nb, Kb, bytes]``, ``*_scale`` float32 and ``*_zp`` int8
    ``[S, Nb, Kb, block]`` (one per output channel of each tile); every byte of a slot moves."""

    FORMAT = "cpu_int4_packed"
    TENSORS = (*table.WEIGHTS, "w13_scale", "w2_scale", "w13_zp", "w2_zp")

    def _lay_out(self, check: FormatChecker, tensors: table.Tensors) -> table.Layout:
        """Payload order is per matrix (``w13``, its scales, its zero points, then ``w2``'s), so
        each tile's three tensors sit together."""
        fields = []
        for stem in table.WEIGHTS:
            weight, scale, zero = (tensors[f"{stem}{part}"] for part in ("", "_scale", "_zp"))
            tiles = check.tensor(stem, weight, 4, (torch.uint8,))
            scales = check.tensor(f"{stem}_scale", scale, 4, (torch.float32,))
            zeros = check.tensor(f"{stem}_zp", zero, 4, (torch.int8,))
            if scales != zeros:
                check.fail(
                    f"{stem}_scale {list(scales)} and {stem}_zp {list(zeros)} must have one shape "
                    "(one scale and one zero point per output channel of each tile)"
                )
            if scales[1:3] != tiles[1:3]:
                check.fail(
                    f"{stem}_scale's tiles {list(scales[1:3])} must match {stem}'s "
                    f"{list(tiles[1:3])} (blocked by convert_weight_packed_scale_zp?)"
                )
            fields += [
                table.leading_field(stem, weight),
                table.leading_field(f"{stem}_scale", scale),
                table.leading_field(f"{stem}_zp", zero),
            ]
        return fields, {}

"""Typed entry points for the routing and expert-compute ops (``torch.ops.eplb_graph``).

These are what model code calls; torch.compile sees the underlying op (one node, no graph break)
and captured device graphs replay its kernel. Every argument is a tensor, so changing a value
(offset, valid-token count, record flag) never recompiles or re-captures.

Each entry point takes its op's schema as its Python signature (``signatures``): the op already
checks and converts its arguments, so re-spelling them here would only be one more list to keep
in step with the schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import eplb_graph.ops.registration  # noqa: F401  (defines the schemas before any call)
from eplb_graph.ops.signatures import SIGNATURES, with_signature

_OPS = torch.ops.eplb_graph


def _entry_point(name: str, doc: str) -> Callable[..., Any]:
    """The entry point of op ``name``: calls its ``.default`` overload with the arguments given.

    A call with too few or unknown arguments raises ``TypeError`` as a Python function would.
    """
    handle = getattr(_OPS, name).default
    signature = SIGNATURES[name]

    def entry_point(*args, **kwargs):
        return handle(*signature.arguments(args, kwargs))

    return with_signature(name, entry_point, __name__, name, doc)


map_to_physical = _entry_point(
    "map_to_physical",
    """Map logical expert ids to physical slots.

    Args:
        topk_ids: ``[T, K]`` int32/int64 logical ids; ids outside ``[0, N)`` map to -1.
        log2phy: ``[N, R]`` int32/int64 (N, R >= 1), row e lists e's slots in ascending order,
            -1 padded.
        replica_count: ``[N]`` int32/int64 number of valid entries of each row.
        offset: 0-d int64, any value; row t hashes ``(t + offset) * 2654435769 mod 2**32`` and
            takes replica ``min(h % max(count, 1), R - 1)``; all K choices of a row share the hash.

    Returns:
        ``[T, K]`` physical slot ids with ``topk_ids``' dtype.

    Table values are not checked (that would read device data), so every value has one defined
    result, the same on every kernel: a chosen entry that is negative, or larger than
    ``topk_ids``' dtype holds, falls back to the row's replica 0 (a torn refresh), and to -1 if
    that is no usable slot either; an entry ``>= P`` is returned as is (and never counted).
    Shapes, dtypes and devices are checked; a bad one raises ``RuntimeError`` naming the argument.
    """,
)

record_load = _entry_point(
    "record_load",
    """Count executed (token, slot) pairs into ``load`` in place.

    Args:
        load: ``[P]`` int32/int64 per-slot counter, mutated; P >= 1, one memory cell per slot
            (no stride-0 view) and no memory shared with another argument, else
            ``RuntimeError``. Counters wrap at their dtype's limit.
        physical_ids: ``[T, K]`` slots; ids outside ``[0, P)`` are not counted.
        num_valid_tokens: 0-d integer, any value; rows at or beyond it are padding and not
            counted (a negative value counts nothing, one above T counts every row).
        record_enabled: 0-d bool; when False nothing is counted (the kernel still runs).
    """,
)

map_and_record = _entry_point(
    "map_and_record",
    """``map_to_physical`` then ``record_load`` of its output, as one op (one pass natively).

    Shapes and rules as in :func:`map_to_physical` and :func:`record_load`; every argument is
    checked before anything is written. Returns ``[T, K]`` slots.
    """,
)

local_experts = _entry_point(
    "local_experts",
    """This rank's share of a SwiGLU MoE layer: only the (token, k) rows routed to local slots.

    Why an op: expert parallelism only pays when a rank's work follows the placement. The output
    shape is fixed (graph-safe) while the work inside is data dependent: the native CPU kernel
    buckets the local rows by expert, runs two GEMMs per expert on just those rows and
    scatter-adds them, so other ranks' rows, ``-1`` slots and padding rows cost nothing.

    Args:
        hidden: ``[T, H]`` float32 or bfloat16.
        slots: ``[T, K]`` int32/int64 physical slot ids (``-1`` = no expert).
        topk_weights: ``[T, K]`` combine weights, float32 or hidden's dtype.
        slot_to_local: ``[P]`` int32/int64: the local expert row of slot p on this rank, ``-1``
            when the slot lives on another rank.
        w13: ``[E, 2I, H]`` gate rows then up rows, hidden's dtype. w2: ``[E, H, I]``.
        stats: ``[2]`` int64, mutated: ``stats[0] +=`` rows computed, ``stats[1] +=`` ns spent
            (CPU wall clock in the native kernel; the ATen reference adds 0 ns).
        num_valid_tokens: 0-d integer; rows ``t >= num_valid_tokens`` are padding.
        weight_on_input: scale the expert's input by ``w_tk`` (Llama-4) instead of its output.

    Returns:
        ``[T, H]`` in hidden's dtype, fully written (zero rows where nothing is local):
        ``out[t] = sum_k w_tk * W2_e(silu(G_e x_t) * U_e x_t)`` over the computed rows, where
        row (t, k) is computed iff ``t < num_valid_tokens``, ``0 <= slots[t, k] < P`` and
        ``0 <= slot_to_local[slots[t, k]] < E`` (other values contribute nothing, no error).
        The K-sum is accumulated in float32; bf16 rounds ``G x, U x``, the SwiGLU product and
        ``W2 (...)`` to bf16 once each (GEMMs accumulate in fp32), then the sum once. A row's
        result does not depend on which other rows share its expert (batch invariant).
    """,
)

local_experts_w8a8 = _entry_point(
    "local_experts_w8a8",
    """:func:`local_experts` for W8A8 weights: int8 ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` with
    float32 per-output-channel scales ``w13_scale [E, 2I]``, ``w2_scale [E, H]``.

    Each computed row is quantized per row (``scale = max|x| / 127``, round half to even,
    clamp to +-127), multiplied by the int8 weights with float32 sums (exact while the integer
    sum stays below 2**24), rescaled ``acc * x_scale * w_scale``; the SwiGLU output is
    quantized the same way before ``w2``. This is the demo model's format.
    """,
)

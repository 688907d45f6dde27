"""Schema definitions for ``torch.ops.eplb_graph`` and the registration of fake/reference kernels.

Registration uses the low-level ``torch.library.Library`` define/impl API rather than
``torch.library.custom_op``: ``custom_op`` wraps every eager call in a Python autograd and
ADInplaceOrView layer that costs 1.4-7 us more per call (``tools/bench/bench_registration.py``),
about as much as the whole native op at decode sizes (1.7 us). The schemas below are what
torch.compile, opcheck, torchair and the native kernels all key on; keep them stable.
"""

from __future__ import annotations

import torch

from eplb_graph.ops.checks import (
    check_local_experts_args,
    check_local_experts_w8a8_args,
    check_map_and_record_args,
    check_map_args,
    check_record_args,
)
from eplb_graph.ops.reference import (
    local_experts_ref,
    local_experts_w8a8_ref,
    map_and_record_ref,
    map_to_physical_ref,
    record_load_ref,
)

NAMESPACE = "eplb_graph"

SCHEMAS = {
    "map_to_physical": (
        "map_to_physical(Tensor topk_ids, Tensor log2phy, Tensor replica_count, Tensor offset)"
        " -> Tensor"
    ),
    "record_load": (
        "record_load(Tensor(a!) load, Tensor physical_ids, Tensor num_valid_tokens,"
        " Tensor record_enabled) -> ()"
    ),
    "map_and_record": (
        "map_and_record(Tensor topk_ids, Tensor log2phy, Tensor replica_count, Tensor offset,"
        " Tensor(a!) load, Tensor num_valid_tokens, Tensor record_enabled) -> Tensor"
    ),
    "local_experts": (
        "local_experts(Tensor hidden, Tensor slots, Tensor topk_weights, Tensor slot_to_local,"
        " Tensor w13, Tensor w2, Tensor(a!) stats, Tensor num_valid_tokens,"
        " bool weight_on_input=False) -> Tensor"
    ),
    "local_experts_w8a8": (
        "local_experts_w8a8(Tensor hidden, Tensor slots, Tensor topk_weights,"
        " Tensor slot_to_local, Tensor w13, Tensor w2, Tensor w13_scale, Tensor w2_scale,"
        " Tensor(a!) stats, Tensor num_valid_tokens, bool weight_on_input=False) -> Tensor"
    ),
}

#: The routing ops (map/record) and the expert-compute ops, by name.
ROUTING_OPS = ("map_to_physical", "record_load", "map_and_record")
EXPERT_OPS = ("local_experts", "local_experts_w8a8")

# The DEF library must stay alive for the process lifetime: dropping it unregisters the ops.
_DEF_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _DEF_LIBRARY.define(_schema)

# The reference kernels serve every backend that has no direct kernel of its own (CUDA, NPU via
# PrivateUse1, Meta-less fallbacks) and the CPU when the native kernel cannot be built.
_DEF_LIBRARY.impl("map_to_physical", map_to_physical_ref, "CompositeExplicitAutograd")
_DEF_LIBRARY.impl("record_load", record_load_ref, "CompositeExplicitAutograd")
_DEF_LIBRARY.impl("map_and_record", map_and_record_ref, "CompositeExplicitAutograd")
_DEF_LIBRARY.impl("local_experts", local_experts_ref, "CompositeExplicitAutograd")
_DEF_LIBRARY.impl("local_experts_w8a8", local_experts_w8a8_ref, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{NAMESPACE}::map_to_physical", lib=_DEF_LIBRARY)
def _map_to_physical_fake(topk_ids, log2phy, replica_count, offset):
    check_map_args(topk_ids, log2phy, replica_count, offset)
    return topk_ids.new_empty(topk_ids.shape)


@torch.library.register_fake(f"{NAMESPACE}::record_load", lib=_DEF_LIBRARY)
def _record_load_fake(load, physical_ids, num_valid_tokens, record_enabled):
    check_record_args(load, physical_ids, num_valid_tokens, record_enabled)


@torch.library.register_fake(f"{NAMESPACE}::map_and_record", lib=_DEF_LIBRARY)
def _map_and_record_fake(
    topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
):
    check_map_and_record_args(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    )
    return topk_ids.new_empty(topk_ids.shape)


@torch.library.register_fake(f"{NAMESPACE}::local_experts", lib=_DEF_LIBRARY)
def _local_experts_fake(
    hidden,
    slots,
    topk_weights,
    slot_to_local,
    w13,
    w2,
    stats,
    num_valid_tokens,
    weight_on_input=False,
):
    check_local_experts_args(
        hidden, slots, topk_weights, slot_to_local, w13, w2, stats, num_valid_tokens
    )
    return hidden.new_empty(hidden.shape)


@torch.library.register_fake(f"{NAMESPACE}::local_experts_w8a8", lib=_DEF_LIBRARY)
def _local_experts_w8a8_fake(
    hidden,
    slots,
    topk_weights,
    slot_to_local,
    w13,
    w2,
    w13_scale,
    w2_scale,
    stats,
    num_valid_tokens,
    weight_on_input=False,
):
    check_local_experts_w8a8_args(
        hidden,
        slots,
        topk_weights,
        slot_to_local,
        w13,
        w2,
        w13_scale,
        w2_scale,
        stats,
        num_valid_tokens,
    )
    return hidden.new_empty(hidden.shape)


def op_handles() -> dict[str, torch._ops.OpOverload]:
    """The ``.default`` overload of every op, by name (what graphs and opcheck refer to)."""
    namespace = getattr(torch.ops, NAMESPACE)
    return {name: getattr(namespace, name).default for name in SCHEMAS}

"""Schema definitions for ``torch.ops.eplb_graph`` and the registration of fake/reference kernels.

Registration uses the low-level ``torch.library.Library`` define/impl API rather than
``torch.library.custom_op``: ``custom_op`` wraps every eager call in a Python autograd and
ADInplaceOrView layer that costs 1.4-7 us more per call (``tools/bench/bench_registration.py``),
about as much as the whole native op at decode sizes (1.7 us). The schemas below are what
torch.compile, opcheck, torchair and the native kernels all key on; keep them stable.
"""

from __future__ import annotations

from collections.abc import Callable

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


def _register_fake(name: str, check: Callable[..., None], checked: int, like: int | None) -> None:
    """The fake kernel of op ``name``: the checks every kernel runs on its first ``checked``
    arguments, then an empty output shaped like argument ``like`` (None: the op returns
    nothing). Written once from the schema's order, so no fake re-spells an op's parameters."""

    def fake(*args):
        check(*args[:checked])
        return None if like is None else args[like].new_empty(args[like].shape)

    fake.__name__ = fake.__qualname__ = f"{name}_fake"
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_DEF_LIBRARY)


# (check, how many leading arguments it checks, the argument the output is shaped like)
_FAKES = {
    "map_to_physical": (check_map_args, 4, 0),
    "record_load": (check_record_args, 4, None),
    "map_and_record": (check_map_and_record_args, 7, 0),
    "local_experts": (check_local_experts_args, 8, 0),  # weight_on_input needs no check
    "local_experts_w8a8": (check_local_experts_w8a8_args, 10, 0),
}
for _name, (_check, _checked, _like) in _FAKES.items():
    _register_fake(_name, _check, _checked, _like)


def op_handles() -> dict[str, torch._ops.OpOverload]:
    """The ``.default`` overload of every op, by name (what graphs and opcheck refer to)."""
    namespace = getattr(torch.ops, NAMESPACE)
    return {name: getattr(namespace, name).default for name in SCHEMAS}

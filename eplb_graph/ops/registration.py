"""Schema definitions for ``torch.ops.eplb_graph`` and the registration of fake/reference kernels.

Registration uses the low-level ``torch.library.Library`` define/impl API rather than
``torch.library.custom_op``: ``custom_op`` wraps every eager call in a Python autograd and
ADInplaceOrView layer that costs 1.4-7 us more per call (``tools/bench/bench_registration.py``),
about as much as the whole native op at decode sizes (1.7 us). The schemas (``signatures``) are
what torch.compile, opcheck, torchair and the native kernels all key on; keep them stable.
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
from eplb_graph.ops.signatures import NAMESPACE, SCHEMAS, SIGNATURES

__all__ = ["EXPERT_OPS", "NAMESPACE", "ROUTING_OPS", "SCHEMAS", "op_handles"]

#: The routing ops (map/record) and the expert-compute ops, by name.
ROUTING_OPS = ("map_to_physical", "record_load", "map_and_record")
EXPERT_OPS = ("local_experts", "local_experts_w8a8")

# The DEF library must stay alive for the process lifetime: dropping it unregisters the ops.
_DEF_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
for _schema in SCHEMAS.values():
    _DEF_LIBRARY.define(_schema)

#: Each op's input checks (what its fake kernel runs) and its ATen reference kernel, which serves
#: every backend that has no direct kernel of its own (CUDA, NPU via PrivateUse1, Meta-less
#: fallbacks) and the CPU when the native kernel cannot be built.
_KERNELS: dict[str, tuple[Callable[..., None], Callable]] = {
    "map_to_physical": (check_map_args, map_to_physical_ref),
    "record_load": (check_record_args, record_load_ref),
    "map_and_record": (check_map_and_record_args, map_and_record_ref),
    "local_experts": (check_local_experts_args, local_experts_ref),
    "local_experts_w8a8": (check_local_experts_w8a8_args, local_experts_w8a8_ref),
}


def _register_fake(name: str, check: Callable[..., None]) -> None:
    """The fake kernel of op ``name``: the checks every kernel runs on its tensor arguments, then
    an empty output shaped like its first argument (every op that returns a tensor returns one
    of that shape). Derived from the schema, so no fake re-spells an op's parameters."""
    signature = SIGNATURES[name]
    checked = len(signature.tensors)

    def fake(*args):
        check(*args[:checked])
        return args[0].new_empty(args[0].shape) if signature.returns_tensor else None

    fake.__name__ = fake.__qualname__ = f"{name}_fake"
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_DEF_LIBRARY)


for _name, (_check, _reference) in _KERNELS.items():
    _DEF_LIBRARY.impl(_name, _reference, "CompositeExplicitAutograd")
    _register_fake(_name, _check)


def op_handles() -> dict[str, torch._ops.OpOverload]:
    """The ``.default`` overload of every op, by name (what graphs and opcheck refer to)."""
    namespace = getattr(torch.ops, NAMESPACE)
    return {name: getattr(namespace, name).default for name in SCHEMAS}

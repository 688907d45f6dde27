"""Which ATen operations force a host sync or a data-dependent shape, and where custom-op bodies
are audited.

The classification is by op tags, not by a hand list of names, so new ops that torch tags
``data_dependent_output`` or ``dynamic_output_shape`` are caught without an update here:

- host sync: ``_local_scalar_dense``/``item``, ``equal``, ``allclose``, ``is_nonzero`` (untagged,
  listed), any op tagged ``data_dependent_output``, an ``index``/``index_put`` with a boolean index
  (the mask becomes ``nonzero`` inside the kernel), ``cond``/``while_loop`` (inductor reads the
  predicate on the host), and explicit ``streams.synchronize_*``;
- dynamic shape: ops tagged ``dynamic_output_shape`` (``nonzero``, ``bincount``,
  ``repeat_interleave.Tensor``, ...) and any node that binds a new unbacked symbol.

A ``TorchDispatchMode`` does not see the ATen calls made inside a custom op's Python body (the
mode is popped while the op runs), so op bodies are audited by calling their implementation
directly under :class:`SyncRecorder`. The ``eplb_graph`` ops map to their ATen reference kernels
(what CUDA/NPU run and what inductor decomposes to); ``torch.library.custom_op`` ops use their
registered Python function; anything else can be registered with :func:`register_op_body`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eplb_graph.ops.reference import map_and_record_ref, map_to_physical_ref, record_load_ref

aten = torch.ops.aten

_EXPLICIT_SYNC = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.allclose.default,
}
_MASKABLE = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_AUTO_FUNCTIONALIZED_NAMES = ("auto_functionalized", "auto_functionalized_v2")

_OP_BODIES: dict[str, Callable] = {
    "eplb_graph::map_to_physical": map_to_physical_ref,
    "eplb_graph::record_load": record_load_ref,
    "eplb_graph::map_and_record": map_and_record_ref,
}


def register_op_body(qualname: str, body: Callable) -> None:
    """Audit ``body`` wherever the custom op ``qualname`` (``"ns::name"``) appears in a graph.

    Needed for ops defined with ``torch.library.Library.define/impl`` (their kernels are opaque
    to the audit); ``torch.library.custom_op`` ops are found without registering.
    """
    _OP_BODIES[qualname] = body


def op_body(op: torch._ops.OpOverload) -> Callable | None:
    """The Python implementation to audit for a custom op, or ``None`` if none is known."""
    qualname = op._schema.name
    if qualname in _OP_BODIES:
        return _OP_BODIES[qualname]
    try:  # torch.library.custom_op keeps the user's function (private attribute, 2.4+).
        from torch._library.custom_ops import OPDEFS

        definition = OPDEFS.get(qualname)
    except ImportError:  # pragma: no cover - torch without custom_op
        return None
    return getattr(definition, "_init_fn", None) if definition is not None else None


def is_custom_op(op: object) -> bool:
    """True for an ``OpOverload`` outside torch's own namespaces (the user's or ours)."""
    return isinstance(op, torch._ops.OpOverload) and op.namespace not in {
        "aten",
        "prim",
        "prims",
        "_c10d_functional",
        "c10d_functional",
        "streams",
        "higher_order",
        "inductor",
    }


def _has_bool_index(indices) -> bool:
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in (indices or ())
    )


def classify_op(op, indices=None) -> tuple[str, str] | None:
    """``(kind, why)`` for an op that syncs or has a data-dependent shape, else ``None``.

    ``indices`` are the (example) index tensors of an ``index``/``index_put`` call, judged for
    boolean masks; without them those ops are not flagged (integer indexing is fine).
    """
    name = getattr(op, "__name__", str(op))
    if op in (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop):
        return "host_sync", f"{name}: inductor reads the predicate on the host each call"
    if not isinstance(op, torch._ops.OpOverload):
        return None
    qualified = f"{op.namespace}.{op._opname}"
    if op.namespace == "streams" and "synchronize" in op._opname:
        return "host_sync", f"{qualified}: explicit device synchronize in the graph"
    tags = getattr(op, "tags", ())
    if op in _EXPLICIT_SYNC or torch.Tag.data_dependent_output in tags:
        return "host_sync", f"{qualified} reads a device value on the host"
    if op in _MASKABLE:
        if _has_bool_index(indices):
            return "host_sync", f"{qualified} with a boolean mask (nonzero on the host)"
        return None
    if torch.Tag.dynamic_output_shape in tags:
        return "dynamic_shape", f"{qualified} has a data-dependent output shape"
    return None


def mutable_target(node: torch.fx.Node):
    """The op a node runs: the wrapped op of ``auto_functionalized(_v2)``, else its target."""
    target = node.target
    if getattr(target, "__name__", "") in _AUTO_FUNCTIONALIZED_NAMES and node.args:
        return node.args[0]
    return target


def classify_node(node: torch.fx.Node) -> tuple[str, str] | None:
    """Classify one ATen-graph node (see :func:`classify_op`), including new unbacked symbols."""
    if node.op != "call_function":
        return None
    indices = None
    if node.target in _MASKABLE and len(node.args) > 1:
        indices = [
            arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
            for arg in (node.args[1] or ())
        ]
    found = classify_op(node.target, indices)
    if found is None and node.meta.get("unbacked_bindings"):
        symbols = ", ".join(sorted(str(symbol) for symbol in node.meta["unbacked_bindings"]))
        found = "dynamic_shape", f"{node.target} binds data-dependent symbol(s) {symbols}"
    return found


@dataclass(frozen=True)
class BodyHit:
    """One flagged ATen call inside an op body: what, why, and the body's source line."""

    kind: str
    why: str
    body_location: str


class SyncRecorder(TorchDispatchMode):
    """Records every ATen call under it that :func:`classify_op` flags, with the Python line
    (inside ``body_file`` when given) that issued it."""

    supports_higher_order_operators = True

    def __init__(self, body_file: str | None = None) -> None:
        super().__init__()
        self.hits: list[BodyHit] = []
        self._body_file = str(Path(body_file).resolve()) if body_file else None

    def _caller(self) -> str:
        frames = traceback.extract_stack()[:-2]
        if self._body_file is not None:
            inside = [f for f in frames if str(Path(f.filename).resolve()) == self._body_file]
            if inside:
                frames = inside
        frame = frames[-1]
        return f"{frame.filename}:{frame.lineno}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        indices = args[1] if func in _MASKABLE and len(args) > 1 else None
        found = classify_op(func, indices)
        if found is not None:
            self.hits.append(BodyHit(found[0], found[1], self._caller()))
        return func(*args, **kwargs)


def audit_op_body(body: Callable, args: tuple, kwargs: dict) -> list[BodyHit]:
    """Run ``body`` on copies of ``args`` under :class:`SyncRecorder`; return its hits."""
    import inspect

    def copy(value):
        return value.clone() if isinstance(value, torch.Tensor) else value

    try:
        body_file = inspect.getsourcefile(inspect.unwrap(body))
    except TypeError:
        body_file = None
    args = tuple(copy(arg) for arg in args)
    kwargs = {key: copy(value) for key, value in kwargs.items()}
    recorder = SyncRecorder(body_file)
    with recorder:
        body(*args, **kwargs)
    return recorder.hits

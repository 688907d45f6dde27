"""Each op's signature, written once: the ``torch.library`` schemas and what is read off them.

Why one home: the typed entry points (``wrappers``), the fake kernels (``registration``), the
reference, CUDA and NPU kernels and the input checks all take the same arguments in the same
order. Spelled out in each of them, the lists drifted apart one edit at a time; here every Python
signature, argument count and "which argument the op writes" is derived from the schema that
torch itself parses, so a schema change reaches all of them. The schemas are what torch.compile,
opcheck, torchair and the native kernels key on: keep them stable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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

_PYTHON_TYPES = {"Tensor": torch.Tensor, "bool": bool}


@dataclass(frozen=True)
class OpSignature:
    """One op's arguments as its schema declares them.

    ``tensors`` are the leading ``Tensor`` arguments: what the checks see and what a fake kernel
    checks (every schema lists its tensors before its flags, which :func:`_parse` enforces).
    ``written`` is the index in ``tensors`` of the ``Tensor(a!)`` argument, if the op has one;
    ``defaults`` are the values of the trailing arguments that have one.
    """

    name: str
    python: inspect.Signature
    tensors: tuple[str, ...]
    written: int | None
    returns_tensor: bool
    arity: int
    defaults: tuple

    def arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """Every argument in schema order, defaults filled in; ``TypeError`` like a Python call.

        A positional call costs a length test and a tuple join (plain enough for dynamo to trace
        without a graph break); only a keyword or malformed call pays for ``inspect`` binding.
        """
        if not kwargs:
            missing = self.arity - len(args)
            if 0 <= missing <= len(self.defaults):
                return args + self.defaults[len(self.defaults) - missing :]
        bound = self.python.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args


def _parse(name: str, schema: str) -> OpSignature:
    parsed = torch._C.parse_schema(schema)
    parameters = [
        inspect.Parameter(
            argument.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=argument.default_value
            if argument.has_default_value()
            else inspect.Parameter.empty,
            annotation=_PYTHON_TYPES[str(argument.type)],
        )
        for argument in parsed.arguments
    ]
    kinds = [str(argument.type) for argument in parsed.arguments]
    tensors = tuple(
        argument.name for argument in parsed.arguments if str(argument.type) == "Tensor"
    )
    if kinds[: len(tensors)] != ["Tensor"] * len(tensors):
        raise ValueError(f"{name}: the schema must list every Tensor before other arguments")
    written = [i for i, a in enumerate(parsed.arguments) if a.alias_info and a.alias_info.is_write]
    returns_tensor = len(parsed.returns) == 1
    return OpSignature(
        name=name,
        python=inspect.Signature(
            parameters, return_annotation=torch.Tensor if returns_tensor else None
        ),
        tensors=tensors,
        written=written[0] if written else None,
        returns_tensor=returns_tensor,
        arity=len(parameters),
        defaults=tuple(p.default for p in parameters if p.default is not inspect.Parameter.empty),
    )


#: Every op's signature, by name, in the order of :data:`SCHEMAS`.
SIGNATURES = {name: _parse(name, schema) for name, schema in SCHEMAS.items()}


def with_signature(op: str, function: Callable, module: str, name: str, doc: str) -> Callable:
    """Give ``function`` (which takes ``*args``) op ``op``'s Python signature, a home and a doc.

    ``help()`` and ``inspect.signature`` then show the schema's arguments although the function
    itself does not spell them.
    """
    function.__signature__ = SIGNATURES[op].python
    function.__module__ = module
    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


def checked_kernel(
    op: str,
    check: Callable[..., None],
    compute: Callable[..., Any],
    module: str,
    name: str,
    doc: str,
) -> Callable[..., Any]:
    """A kernel of ``op``: ``check`` on its tensor arguments, then ``compute`` on all of them.

    Every kernel must reject a bad input with the checks' message before it reads or writes
    anything; writing that prologue once keeps the argument list in the schema alone.
    ``__wrapped__`` leads to ``compute``, where the audit of an op body looks for source lines.
    """
    signature = SIGNATURES[op]
    checked = len(signature.tensors)

    def kernel(*args, **kwargs):
        args = signature.arguments(args, kwargs)
        check(*args[:checked])
        return compute(*args)

    kernel.__wrapped__ = compute
    return with_signature(op, kernel, module, name, doc)


def _mapped_arity() -> int:
    """How many of ``map_and_record``'s arguments are ``map_to_physical``'s.

    The fused op takes the map's arguments, then the record's without ``physical_ids`` (the
    mapped result takes its place); every unfused kernel and the checks split it there.
    """
    mapped, recorded = SIGNATURES["map_to_physical"].tensors, SIGNATURES["record_load"].tensors
    if SIGNATURES["map_and_record"].tensors != mapped + recorded[:1] + recorded[2:]:
        raise ValueError("map_and_record's schema must be map_to_physical's then record_load's")
    return len(mapped)


#: ``map_and_record``'s arguments before ``load``: those of ``map_to_physical``.
MAPPED = _mapped_arity()

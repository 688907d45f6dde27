"""A fake of torchair generated from ``eplb_graph/ops/torchair_surface.json`` (the pinned wheel).

It has exactly the names, parameter lists and ``DataType`` members the file records and refuses
everything else: an unknown builder or public name (AttributeError), an unknown or missing
argument (TypeError, from the recorded signature), a ``dst_type``/``dtype`` that is not a GE
``DataType`` value (e.g. a torch dtype), an input dtype outside a builder's explicit REG_OP type
list, ``tensor[i]`` (a GE tensor has no ``__getitem__``). Binary ops also insist on equal input
dtypes (GE's REG_OP declares both inputs with one type variable).

Each builder also *computes* its result on CPU with torch (``_SEMANTICS``: this file's reading
of the Ascend IR op, not torchair's), so a converter's graph can be checked value for value
against the reference kernel. ``InplaceIndexAdd`` writes into the tensor behind its ``var``.
"""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import ClassVar

import torch

SURFACE = json.loads(
    (Path(__file__).resolve().parents[1] / "eplb_graph/ops/torchair_surface.json").read_text()
)
_TORCH_OF_GE = {
    "DT_INT64": torch.int64,
    "DT_INT32": torch.int32,
    "DT_INT16": torch.int16,
    "DT_INT8": torch.int8,
    "DT_UINT8": torch.uint8,
    "DT_BOOL": torch.bool,
    "DT_FLOAT": torch.float32,
    "DT_FLOAT16": torch.float16,
    "DT_BF16": torch.bfloat16,
}
DATA_TYPE = types.SimpleNamespace(**SURFACE["DataType"])
_NAME_OF_VALUE = {value: name for name, value in SURFACE["DataType"].items()}
_BINARY = {"Add", "Sub", "Mul", "BitwiseAnd", "FloorMod", "Maximum", "Minimum", "Less"}
_BINARY |= {"LessEqual", "GreaterEqual", "LogicalAnd"}


def ge_dtype(dtype: torch.dtype) -> int:
    for name, torch_dtype in _TORCH_OF_GE.items():
        if torch_dtype == dtype:
            return SURFACE["DataType"][name]
    raise TypeError(f"no GE DataType for {dtype}")


def _torch_dtype(value) -> torch.dtype:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _NAME_OF_VALUE:
        raise TypeError(f"expected a torchair DataType value, got {value!r}")
    return _TORCH_OF_GE[_NAME_OF_VALUE[value]]


class FakeTensor:
    """A GE graph tensor: ``dtype`` is a DataType int; ``value`` is what it computes on CPU."""

    _ATTRIBUTES: ClassVar[set[str]] = set(SURFACE["Tensor"]["attributes"])

    def __init__(self, value: torch.Tensor, producer: str):
        self.value = value
        self.producer = producer

    @property
    def dtype(self) -> int:
        """Known for graph inputs only: torchair leaves a builder's output ``DT_UNDEFINED``
        until it sets the meta of the converter's result (seen in the real modules)."""
        if self.producer == "Data":
            return ge_dtype(self.value.dtype)
        return SURFACE["DataType"]["DT_UNDEFINED"]

    @property
    def value_dtype(self) -> str:
        return _NAME_OF_VALUE[ge_dtype(self.value.dtype)]

    @property
    def symsize(self) -> list[int]:
        return list(self.value.shape)

    @property
    def rank(self) -> int:
        return self.value.dim()

    def __getattr__(self, name):
        if name in self._ATTRIBUTES:
            raise NotImplementedError(f"the fake GE Tensor does not model .{name}")
        raise AttributeError(f"torchair's GE Tensor has no attribute {name!r}")


assert not SURFACE["Tensor"]["getitem"]  # FakeTensor defines no __getitem__ either


def _value(x):
    return x.value if isinstance(x, FakeTensor) else x


def _gather(x, indices, axis):
    index = indices.reshape(-1).to(torch.int64)
    out = x.index_select(axis, index)
    return out.reshape((*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :]))


def _index_add(var, indices, updates, alpha, axis):
    var.index_add_(axis, indices.to(torch.int64), updates)
    return var


def _range(start, limit, delta):
    if not start.dtype == limit.dtype == delta.dtype:
        raise TypeError("Range: start, limit and delta must share a dtype")
    return torch.arange(int(start), int(limit), int(delta), dtype=start.dtype)


def _select(condition, then, else_changed_as_is_python_key):
    if then.dtype != else_changed_as_is_python_key.dtype:
        raise TypeError("SelectV2: then and else must share a dtype")
    return torch.where(condition, then, else_changed_as_is_python_key)


_SEMANTICS = {
    "Add": lambda x1, x2: x1 + x2,
    "Sub": lambda x1, x2: x1 - x2,
    "Mul": lambda x1, x2: x1 * x2,
    "BitwiseAnd": torch.bitwise_and,
    "LogicalAnd": torch.logical_and,
    "FloorMod": torch.remainder,
    "Maximum": torch.maximum,
    "Minimum": torch.minimum,
    "Less": torch.lt,
    "LessEqual": torch.le,
    "GreaterEqual": torch.ge,
    "SelectV2": _select,
    "GatherV2": lambda x, indices, axis, **attrs: _gather(x, indices, int(axis)),
    "Gather": lambda x, indices, **attrs: _gather(x, indices, 0),
    "Shape": lambda x, dtype: torch.tensor(list(x.shape), dtype=_torch_dtype(dtype)),
    "Range": _range,
    "Reshape": lambda x, shape, **attrs: x.reshape(shape.tolist()),
    "Unsqueeze": lambda x, axes: _unsqueeze(x, axes),
    "InplaceIndexAdd": _index_add,
}


def _unsqueeze(x, axes):
    for axis in axes:
        x = x.unsqueeze(axis)
    return x


def _signature(params: list[dict]) -> inspect.Signature:
    return inspect.Signature(
        [
            inspect.Parameter(
                p["name"],
                getattr(inspect.Parameter, p["kind"]),
                default=eval(p["default"]) if "default" in p else inspect.Parameter.empty,
            )
            for p in params
        ]
    )


class Recorder:
    """The ops built so far, in order: (op type, {input name: FakeTensor or None})."""

    def __init__(self):
        self.ops: list[tuple[str, dict]] = []


def _builder(name: str, entry: dict, recorder: Recorder):
    signature = _signature(entry["params"])
    inputs = {i["name"]: i for i in entry["ir"]["inputs"]}
    # Python names for IR inputs that are keywords ("else") get a suffix in ge_apis.
    param_names = [p["name"] for p in entry["params"]]

    def build(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        values.pop("dependencies", None)
        values.pop("node_name", None)
        tensors = {}
        for param, ir in zip(param_names, inputs.values(), strict=False):
            arg = values[param]
            if arg is None and ir["kind"] == "OPTIONAL_INPUT":
                tensors[ir["name"]] = None
                continue
            if not isinstance(arg, FakeTensor):
                raise TypeError(f"{name}: input {ir['name']} must be a GE Tensor, got {arg!r}")
            allowed = ir["types"]
            if allowed is not None and arg.value_dtype not in allowed:
                raise TypeError(
                    f"{name}: input {ir['name']} has {arg.value_dtype}, not in {allowed}"
                )
            tensors[ir["name"]] = arg
        if name in _BINARY and values["x1"].value_dtype != values["x2"].value_dtype:
            raise TypeError(f"{name}: x1 and x2 must share a dtype")
        recorder.ops.append((name, tensors))
        result = _SEMANTICS[name](**{k: _value(v) for k, v in values.items()})
        if name == "InplaceIndexAdd":
            values["var"].value = result
            return values["var"]
        return FakeTensor(result, name)

    build.__name__ = name
    build.__signature__ = signature
    return build


def _public(recorder: Recorder) -> types.ModuleType:
    public = SURFACE["public"]
    module = types.ModuleType(public["module"])
    module.__all__ = list(public["all"])
    const_sig = _signature(public["functions"]["Const"])
    cast_sig = _signature(public["functions"]["Cast"])

    def Const(*args, **kwargs):
        bound = const_sig.bind(*args, **kwargs)
        dtype = bound.arguments.get("dtype")
        if dtype is None:
            raise TypeError("the fake needs Const's dtype (torchair would infer one)")
        recorder.ops.append(("Const", {}))
        return FakeTensor(torch.tensor(bound.arguments["v"], dtype=_torch_dtype(dtype)), "Const")

    def Cast(*args, **kwargs):
        bound = cast_sig.bind(*args, **kwargs)
        x = bound.arguments["x"]
        if not isinstance(x, FakeTensor):
            raise TypeError(f"Cast: x must be a GE Tensor, got {x!r}")
        recorder.ops.append(("Cast", {"x": x}))
        return FakeTensor(x.value.to(_torch_dtype(bound.arguments["dst_type"])), "Cast")

    def unsupported(name):
        def call(*args, **kwargs):
            raise NotImplementedError(f"the fake does not model torchair.ge.{name}")

        return call

    for name in public["all"]:
        setattr(module, name, unsupported(name))
    module.Const, module.Cast, module.DataType = Const, Cast, DATA_TYPE
    return module


class _Builders(types.ModuleType):
    def __getattr__(self, name):
        raise AttributeError(
            f"{SURFACE['builders']['module']} has no {name!r} in the extracted surface (if the"
            " pinned torchair has it, rerun tools/extract_torchair_surface.py)"
        )


def make_torchair() -> tuple[types.ModuleType, dict[str, types.ModuleType], Recorder, dict]:
    """(fake ``torchair``, its modules by import name, the op recorder, registered converters)."""
    recorder = Recorder()
    converters: dict = {}
    register_sig = _signature(SURFACE["register"]["params"])

    def register_fx_node_ge_converter(*args, **kwargs):
        target = register_sig.bind(*args, **kwargs).arguments["aten_op"]

        def decorate(fn):
            converters[target] = fn
            return object()  # torchair returns its Converter object, not the function

        return decorate

    torchair = types.ModuleType(SURFACE["register"]["module"])
    setattr(torchair, SURFACE["register"]["name"], register_fx_node_ge_converter)
    public = _public(recorder)
    builders = _Builders(SURFACE["builders"]["module"])
    for name, entry in SURFACE["builders"]["functions"].items():
        setattr(builders, name, _builder(name, entry, recorder))
    torchair.ge = public
    modules = {
        "torchair": torchair,
        public.__name__: public,
        "torchair._ge_concrete_graph": types.ModuleType("torchair._ge_concrete_graph"),
        builders.__name__: builders,
    }
    return torchair, modules, recorder, converters


def data(tensor: torch.Tensor) -> FakeTensor:
    """A graph input over ``tensor`` itself (an ``InplaceIndexAdd`` on it writes ``tensor``)."""
    return FakeTensor(tensor, "Data")

"""Run the GE converters inside the REAL torchair Python modules (the pinned wheel's sources,
C extension stubbed) and print what happened as JSON. Run as a subprocess by
``tests/test_torchair_converters.py``: importing torchair patches torch globally.

Usage: ``python tests/torchair_real_check.py <torchair source root> <wheel>``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools import extract_torchair_surface as surface_tool  # noqa: E402


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _data(index, tensor, dtype_of):
    from torchair.ge._ge_graph import Data

    node = Data(
        index=index, dtype=dtype_of(tensor.dtype), shape=list(tensor.shape), placement="NPU"
    )
    node.set_meta(tensor.to("meta"))
    return node


def _inputs(ids_dtype, table_dtype):
    rows, top_k, experts, width, slots = 6, 2, 4, 3, 10
    return {
        "topk_ids": torch.zeros(rows, top_k, dtype=ids_dtype),
        "log2phy": torch.zeros(experts, width, dtype=table_dtype),
        "replica_count": torch.ones(experts, dtype=torch.int32),
        "offset": torch.zeros((), dtype=torch.int64),
        "load": torch.zeros(slots, dtype=ids_dtype),
        "physical_ids": torch.zeros(rows, top_k, dtype=ids_dtype),
        "num_valid_tokens": torch.zeros((), dtype=torch.int32),
        "record_enabled": torch.zeros((), dtype=torch.bool),
    }


def _case(op_name, ids_dtype, table_dtype):
    """Convert one op call into a fresh real GeGraph; returns the ops built and the outputs."""
    from torchair._ge_concrete_graph.auto_functionalized_v2 import conveter_auto_functionalize_v2
    from torchair._ge_concrete_graph.fx2ge_converter import torch_type_to_ge_type
    from torchair.ge._ge_graph import GeGraph, Tensor

    from eplb_graph.ops.registration import SCHEMAS

    op = getattr(torch.ops.eplb_graph, op_name).default
    names = [a.name for a in op._schema.arguments]
    tensors = _inputs(ids_dtype, table_dtype)
    with GeGraph() as graph:
        kwargs = {n: _data(i, tensors[n], torch_type_to_ge_type) for i, n in enumerate(names)}
        first = len(graph._proto.op)
        if "Tensor(a!)" in SCHEMAS[op_name]:
            base = kwargs.pop("load")
            outputs = conveter_auto_functionalize_v2(
                op, _all_bases=[base], _load_base_index=0, **kwargs
            )
        else:
            outputs = (op._ge_converter(**kwargs),)
        built = list(graph._proto.op)[first:]
    result = {
        "ops": [o.type for o in built],
        "outputs": [None if o is None else type(o).__name__ for o in outputs],
    }
    if op_name != "map_to_physical":
        load_out = outputs[-1]
        result["load_from"] = load_out.node.type if isinstance(load_out, Tensor) else None
        result["load_output_name"] = load_out.node.output_desc[load_out.index].name
    if outputs[0] is not None:
        result["out_dtype"] = int(outputs[0].dtype)
        result["want_dtype"] = int(torch_type_to_ge_type(ids_dtype))
    return result


def _view_case(op_name):
    """``load`` a view of a per-layer buffer (``state.load[layer]``): what functionalization
    passes for it is an as_strided view of the base (size, stride, storage offset). Sizes and
    strides are lists: torchair turns the FX graph's tuples into lists before calling a
    converter (``npu_fx_compiler.py:187-192``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchair._ge_concrete_graph.auto_functionalized_v2 import conveter_auto_functionalize_v2
    from torchair._ge_concrete_graph.fx2ge_converter import torch_type_to_ge_type
    from torchair.ge._ge_graph import Data, GeGraph

    op = getattr(torch.ops.eplb_graph, op_name).default
    tensors = _inputs(torch.int64, torch.int64)
    slots = tensors["load"].shape[0]
    mode = FakeTensorMode()
    with GeGraph() as graph, mode:
        kwargs = {}
        for index, arg in enumerate(op._schema.arguments):
            value = (
                torch.zeros(3, slots, dtype=torch.int64)
                if arg.name == "load"
                else tensors[arg.name]
            )
            node = Data(
                index=index,
                dtype=torch_type_to_ge_type(value.dtype),
                shape=list(value.shape),
                placement="NPU",
            )
            node.set_meta(mode.from_tensor(value))
            kwargs[arg.name] = node
        base = kwargs.pop("load")
        first = len(graph._proto.op)
        outputs = conveter_auto_functionalize_v2(
            op,
            _all_bases=[base],
            _load_base_index=0,
            _load_size=[slots],
            _load_stride=[1],
            _load_storage_offset=slots,
            **kwargs,
        )
        built = list(graph._proto.op)[first:]
    update = outputs[-1].node
    written = next(o for o in reversed(built) if o.type == "InplaceIndexAdd")
    return {
        "ops": [o.type for o in built],
        "load_from": update.type,
        # The update copies the as_strided view the ref op wrote back into the base.
        "copies_the_written_view": written.input[0] in list(update.input),
    }


def main(source_root: str, wheel: str) -> None:
    warnings = _Warnings()
    torchair = surface_tool.import_torchair(Path(source_root))
    logging.getLogger().addHandler(warnings)
    torchair.logger.addHandler(warnings)
    import torchair.ge as public
    from torchair._ge_concrete_graph import ge_apis
    from torchair.ge import _ge_graph

    import eplb_graph  # noqa: F401 - defines the ops
    from eplb_graph.ops import npu

    try:
        surface = surface_tool.extract(torchair, Path(wheel))
    except AttributeError as error:  # a name the converters use is missing from the wheel
        surface = {"error": f"{type(error).__name__}: {error}"}
    report = {
        "surface": surface,
        "public_has": {n: hasattr(public, n) for n in ("Range", "GatherV2", "Shape", "Cast")},
        "builders_count": sum(1 for n in dir(ge_apis) if n[:1].isupper()),
        "tensor_getitem": hasattr(_ge_graph.Tensor, "__getitem__"),
        "registered": npu.register_torchair_converters(torchair),
        "has_converter": {
            name: hasattr(getattr(torch.ops.eplb_graph, name).default, "_ge_converter")
            for name in ("map_to_physical", "record_load", "map_and_record")
        },
        "cases": {},
    }
    for op_name in ("map_to_physical", "record_load", "map_and_record"):
        for ids_dtype, table_dtype in ((torch.int64, torch.int64), (torch.int32, torch.int64)):
            key = f"{op_name}/{ids_dtype}/{table_dtype}"
            try:
                report["cases"][key] = _case(op_name, ids_dtype, table_dtype)
            except Exception as error:  # reported, and failed on, by the test
                report["cases"][key] = {"error": f"{type(error).__name__}: {error}"}
    for op_name in ("record_load", "map_and_record"):
        try:
            report["cases"][f"{op_name}/view"] = _view_case(op_name)
        except Exception as error:
            report["cases"][f"{op_name}/view"] = {"error": f"{type(error).__name__}: {error}"}
    report["warnings"] = warnings.messages
    sys.stdout.write("\nREPORT " + json.dumps(report) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])

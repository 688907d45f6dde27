"""The torchair GE converters (``eplb_graph.ops.npu_ge``) against torchair's real API.

Two layers, both in the default run:
- a fake generated from ``eplb_graph/ops/torchair_surface.json`` (``tests/torchair_fake.py``)
  that refuses anything the pinned torchair lacks and computes each Ascend IR op on CPU, so the
  converters' graphs are checked value for value against the reference kernels;
- the real torchair Python modules from the pinned ``torch-npu`` wheel (C extension stubbed, in
  a subprocess): the surface file must equal what the wheel has, and the converters must build
  a real GE graph through torchair's own ``auto_functionalized_v2`` path, with ``load`` updated
  by a ref op. Skipped, with the reason, only when the wheel cannot be downloaded.

No NPU and no CANN are involved: whether Ascend compiles and runs these graphs is not tested.
"""

from __future__ import annotations

import inspect
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eplb_graph.ops import npu, npu_ge
from eplb_graph.ops.registration import SCHEMAS
from tests import torchair_fake
from tests.test_op_kernels_agree import (
    ARGS,
    EDGE_SHAPES,
    FAMILIES,
    REFERENCE,
    general_case,
    random_inputs,
    run_kernel,
)
from tools import extract_torchair_surface as surface_tool

ROOT = Path(__file__).resolve().parents[1]
OPS = ("map_to_physical", "record_load", "map_and_record")
SURFACE = torchair_fake.SURFACE


@pytest.fixture
def fake(monkeypatch):
    """The fake torchair, importable by the real module paths; converters registered on it."""
    torchair, modules, recorder, converters = torchair_fake.make_torchair()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(npu, "_registered", {})  # install()'s memo stays as it was
    names = npu.register_torchair_converters(torchair)
    return torchair, recorder, converters, names


# -- the surface file ----------------------------------------------------------------------------


def test_surface_covers_every_name_the_converters_use():
    used = surface_tool.used_names()
    assert set(used["ops"]) == set(SURFACE["builders"]["functions"]), "rerun the extract tool"
    assert set(used["ge"]) - {"DataType"} <= set(SURFACE["public"]["functions"])
    assert set(used["ge"]) <= set(SURFACE["public"]["all"])
    assert SURFACE["public"]["module"] == npu_ge.PUBLIC_MODULE
    assert SURFACE["builders"]["module"] == npu_ge.BUILDERS_MODULE
    assert SURFACE["register"]["name"] == npu_ge.REGISTER_NAME
    assert SURFACE["source"]["sha256"] == surface_tool.WHEEL_SHA256


# -- the fake refuses what torchair lacks ---------------------------------------------------------


def test_fake_refuses_what_torchair_does_not_have(fake):
    ge, ops = sys.modules[npu_ge.PUBLIC_MODULE], sys.modules[npu_ge.BUILDERS_MODULE]
    x = torchair_fake.data(torch.arange(4, dtype=torch.int64))
    for missing in ("Range", "GatherV2", "Shape", "Select", "BitwiseAnd"):
        with pytest.raises(AttributeError):
            getattr(ge, missing)
    with pytest.raises(AttributeError, match="extract_torchair_surface"):
        ops.GatherV3(x, x, x)
    with pytest.raises(TypeError, match="DataType"):
        ge.Cast(x, dst_type=torch.int64)
    with pytest.raises(TypeError):
        ge.Cast(x, torchair_fake.DATA_TYPE.DT_INT32)  # dst_type is keyword-only
    with pytest.raises(TypeError):
        ops.GatherV2(x, x, ge.Const(0, dtype=ge.DataType.DT_INT64), batch_dim=0)
    with pytest.raises(TypeError):
        ops.Shape(x)[0]
    with pytest.raises(TypeError):
        ops.InplaceIndexAdd(x, x, x, None)  # axis is a required keyword
    flags = torchair_fake.data(torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="not in"):
        ops.InplaceIndexAdd(x, flags, x, None, axis=0)  # indices: int32/int64 only
    with pytest.raises(TypeError, match="share a dtype"):
        ops.Add(x, torchair_fake.data(torch.arange(4, dtype=torch.int32)))
    assert x.dtype == ge.DataType.DT_INT64 and x.dtype != torch.int64


def test_all_three_ops_get_a_converter_with_the_schema_parameter_names(fake):
    _, _, converters, names = fake
    assert names == list(OPS)
    for name in OPS:
        converter = converters[getattr(torch.ops.eplb_graph, name).default]
        schema_names = [
            a.name for a in getattr(torch.ops.eplb_graph, name).default._schema.arguments
        ]
        # auto_functionalized_v2 calls the inner converter with these as keywords only.
        assert list(inspect.signature(converter).parameters) == schema_names
        assert "meta_outputs" not in inspect.signature(converter).parameters


# -- the converters' graphs compute the reference ------------------------------------------------


def _convert(converters, recorder, op, inputs):
    """Run the converter on private copies; returns (output tensor or None, load or None)."""
    names = ARGS[op]
    copies = {n: inputs[n].clone() for n in names}
    converter = converters[getattr(torch.ops.eplb_graph, op).default]
    recorder.ops.clear()
    out = converter(**{n: torchair_fake.data(copies[n]) for n in names})
    if "Tensor(a!)" in SCHEMAS[op]:
        last_type, last_inputs = recorder.ops[-1]
        # auto_functionalized_v2 reads the update from the last op's ref output named like
        # its input: InplaceIndexAdd's "var", which must be load itself.
        assert last_type == "InplaceIndexAdd" and last_inputs["var"].value is copies["load"]
    if op == "record_load":
        assert out is None
    return (None if out is None else out.value), copies.get("load")


def _expected(op, inputs):
    outcome = run_kernel(REFERENCE[op], op, inputs)
    assert outcome.error is None, outcome.error
    return outcome


@pytest.mark.parametrize("op", OPS)
def test_converter_graphs_equal_the_reference_on_random_hostile_inputs(fake, op):
    _, recorder, converters, _ = fake
    rng = random.Random(f"{op}-ge-converter")
    cases = [general_case(rng, family) for family in FAMILIES for _ in range(25)]
    cases += [random_inputs(rng, "int64", **shape) for shape in EDGE_SHAPES]
    for inputs in cases:
        expected = _expected(op, inputs)
        out, load = _convert(converters, recorder, op, inputs)
        got_out = (
            None if out is None else (out.dtype, tuple(out.shape), tuple(out.reshape(-1).tolist()))
        )
        got_load = None if load is None else (load.dtype, tuple(load.shape), tuple(load.tolist()))
        assert (got_out, got_load) == (expected.output, expected.load)


def test_converters_use_no_shift():
    used = surface_tool.used_names()
    assert not [name for name in used["ops"] if "Shift" in name]


# -- the real torchair modules from the pinned wheel ----------------------------------------------


@pytest.fixture(scope="session")
def real_torchair_report(tmp_path_factory):
    try:
        wheel = surface_tool.fetch_wheel()
    except RuntimeError as error:
        pytest.skip(f"pinned torch-npu wheel unavailable: {error}")
    source = surface_tool.unpack_torchair(wheel)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests/torchair_real_check.py"), str(source), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


def test_surface_file_equals_the_pinned_wheel(real_torchair_report):
    assert real_torchair_report["surface"] == SURFACE


def test_issue_facts_hold_in_the_real_torchair(real_torchair_report):
    report = real_torchair_report
    assert report["public_has"] == {"Range": False, "GatherV2": False, "Shape": False, "Cast": True}
    assert report["builders_count"] >= 1700
    assert report["tensor_getitem"] is False


def test_real_torchair_registers_and_converts_all_three_ops(real_torchair_report):
    report = real_torchair_report
    assert report["registered"] == list(OPS)
    assert report["has_converter"] == dict.fromkeys(OPS, True)
    allowed = set(SURFACE["builders"]["functions"]) | {"Const", "Cast", "TensorMove"}
    undefined = SURFACE["DataType"]["DT_UNDEFINED"]
    assert len(report["cases"]) == 8
    for key, case in report["cases"].items():
        assert "error" not in case, (key, case.get("error"))
        assert not [op for op in case["ops"] if "Shift" in op], key
        if key.endswith("/view"):
            # load = buffer[layer]: torchair regenerates the view (AsStrided), the converter's
            # ref op writes it, and ViewCopy copies exactly that view back into the buffer.
            assert case["load_from"] == "ViewCopy" and case["copies_the_written_view"], key
            assert "InplaceIndexAdd" in case["ops"], key
            continue
        assert set(case["ops"]) <= allowed, (key, set(case["ops"]) - allowed)
        if key.startswith(("record_load", "map_and_record")):
            # torchair found the updated load on the ref output of the last op, not an Identity.
            assert case["load_from"] == "InplaceIndexAdd" and case["load_output_name"] == "var"
            assert case["ops"][-1] == "InplaceIndexAdd", key
        if key.startswith("record_load"):
            assert case["outputs"][0] is None
        else:
            # A builder's output has no dtype yet (the fake models this): torchair sets it later.
            assert case["out_dtype"] == undefined
    assert not [w for w in report["warnings"] if "ref relation" in w], report["warnings"]

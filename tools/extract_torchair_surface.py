"""Extract the torchair API surface the GE converters use from the pinned torch-npu wheel.

``python tools/extract_torchair_surface.py`` downloads ``torch-npu==2.14.0`` (once, into
``$EPLB_GRAPH_WHEEL_CACHE`` or ``~/.cache/eplb_graph/wheels``; never installed), unpacks its
``torch_npu/dynamo/torchair`` Python sources, imports them with the C extension
``torchair.core._torchair`` stubbed (the Python graph-building code needs no CANN), and writes
``eplb_graph/ops/torchair_surface.json``: for every name ``eplb_graph/ops/npu_ge.py`` uses, the
module it comes from, its parameter list and (for op builders) the Ascend IR inputs, outputs and
attributes of its REG_OP docstring; the ``DataType`` members; the attributes of a GE ``Tensor``;
and the wheel's file name and sha256. The test fake of torchair is generated from that file.

The same helpers serve the tests that import the real modules
(``tests/test_torchair_converters.py``).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SURFACE_FILE = ROOT / "eplb_graph" / "ops" / "torchair_surface.json"
CONVERTERS_FILE = ROOT / "eplb_graph" / "ops" / "npu_ge.py"
PACKAGE = "torch-npu==2.14.0"
#: One exact file, whatever Python runs this (the torchair sources are pure Python).
WHEEL_NAME = "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "7736f7d82cf9f16c7dfc4537f7e7c638153da760273a193455e70857f912189e"
TORCHAIR_PREFIX = "torch_npu/dynamo/"
PUBLIC_MODULE = "torchair.ge"
BUILDERS_MODULE = "torchair._ge_concrete_graph.ge_apis"
REGISTER_MODULE = "torchair"
REGISTER_NAME = "register_fx_node_ge_converter"


def cache_dir() -> Path:
    return Path(os.environ.get("EPLB_GRAPH_WHEEL_CACHE", Path.home() / ".cache/eplb_graph/wheels"))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(cache: Path | None = None, timeout: float = 300) -> Path:
    """The pinned wheel, downloaded with ``pip download --no-deps`` if not cached.

    Raises ``RuntimeError`` with pip's output when it cannot be had (no network, ...), or when
    the file is not the pinned one.
    """
    cache = cache or cache_dir()
    wheel = cache / WHEEL_NAME
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        command = [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
            *("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"),
            *("-d", str(cache), PACKAGE),
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"pip download {PACKAGE} timed out after {timeout}s") from error
        if result.returncode != 0 or not wheel.is_file():
            tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"pip download {PACKAGE} failed: {' / '.join(tail)}")
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected the pinned {WHEEL_SHA256}")
    return wheel


def unpack_torchair(wheel: Path, cache: Path | None = None) -> Path:
    """Unpack ``torch_npu/dynamo/torchair`` (Python sources only) once; returns the directory
    to put on ``sys.path`` so that ``import torchair`` finds it."""
    target = (cache or cache_dir()) / f"{wheel.stem}-torchair"
    marker = target / ".complete"
    if not marker.is_file():
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith(TORCHAIR_PREFIX + "torchair/") and not name.endswith(".so"):
                    archive.extract(name, target)
        marker.write_text(wheel.name)
    return target / TORCHAIR_PREFIX


class _StubMeta(type):
    """Any attribute of the stubbed C extension is a class whose attributes are classes too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _stub(name: str) -> type:
    return _StubMeta(
        name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda *a: None}
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def import_torchair(source_root: Path) -> types.ModuleType:
    """Import the real torchair Python package from ``source_root`` with its C extension
    stubbed. It patches torch (collective remaps): do this in a subprocess, never in a test
    process that goes on to do other things."""
    if "torch_npu" in sys.modules:
        raise RuntimeError("torch_npu is imported: the stubbed torchair must not meet it")
    sys.path.insert(0, str(source_root))
    sys.modules["torchair.core._torchair"] = _StubModule("torchair.core._torchair")
    import torchair

    return torchair


def used_names(source: Path = CONVERTERS_FILE) -> dict[str, list[str]]:
    """What the converters reach for: attributes read off ``ops`` (builders) and ``ge``
    (public module), found with ``ast`` in ``npu_ge.py``."""
    found: dict[str, set[str]] = {"ops": set(), "ge": set()}
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if owner_name in found and node.attr[:1].isupper():
            found[owner_name].add(node.attr)
    return {key: sorted(value) for key, value in found.items()}


def signature_of(function) -> list[dict]:
    params = []
    for param in inspect.signature(function).parameters.values():
        entry = {"name": param.name, "kind": param.kind.name}
        if param.default is not inspect.Parameter.empty:
            entry["default"] = repr(param.default)
        params.append(entry)
    return params


_REG_LINE = re.compile(
    r"\.(INPUT|OPTIONAL_INPUT|DYNAMIC_INPUT|OUTPUT|DYNAMIC_OUTPUT)\((\w+), (.*)\)"
)
_ATTR_LINE = re.compile(r"\.(ATTR|REQUIRED_ATTR)\((\w+), (\w+)")


def ir_of(function) -> dict:
    """The REG_OP of an op builder's docstring: inputs/outputs (name, type spec), attributes."""
    ir: dict = {"inputs": [], "outputs": [], "attrs": []}
    for line in (function.__doc__ or "").splitlines():
        line = line.strip().removesuffix("\\n").strip()
        if match := _REG_LINE.match(line):
            kind, name, spec = match.groups()
            key = "outputs" if "OUTPUT" in kind else "inputs"
            ir[key].append({"name": name, "kind": kind, "types": _dtypes_of(spec), "spec": spec})
        elif match := _ATTR_LINE.match(line):
            ir["attrs"].append({"name": match.group(2), "type": match.group(3)})
    return ir


def _dtypes_of(spec: str) -> list[str] | None:
    """The explicit dtype list of a type spec, or None for a named set (BasicType(), ...)."""
    if "TensorType({" not in spec or "Type()" in spec:
        return None
    return re.findall(r"DT_\w+", spec)


def extract(torchair: types.ModuleType, wheel: Path) -> dict:
    import importlib

    public = importlib.import_module(PUBLIC_MODULE)
    builders = importlib.import_module(BUILDERS_MODULE)
    from torchair.ge import _ge_graph

    names = used_names()
    data_type = public.DataType
    tensor = _ge_graph.Tensor
    return {
        "source": {"package": PACKAGE, "wheel": wheel.name, "sha256": sha256(wheel)},
        "register": {
            "module": REGISTER_MODULE,
            "name": REGISTER_NAME,
            "params": signature_of(getattr(torchair, REGISTER_NAME)),
        },
        "public": {
            "module": PUBLIC_MODULE,
            "all": list(public.__all__),
            "functions": {
                n: signature_of(getattr(public, n)) for n in names["ge"] if n != "DataType"
            },
        },
        "builders": {
            "module": BUILDERS_MODULE,
            "count": sum(
                1 for n in dir(builders) if n[:1].isupper() and callable(getattr(builders, n))
            ),
            "functions": {
                n: {"params": signature_of(getattr(builders, n)), "ir": ir_of(getattr(builders, n))}
                for n in names["ops"]
            },
        },
        "DataType": {n: v for n, v in vars(data_type).items() if n.startswith("DT_")},
        "Tensor": {
            "class": f"{tensor.__module__}.{tensor.__qualname__}",
            "attributes": sorted(n for n in dir(tensor) if not n.startswith("__")),
            "getitem": hasattr(tensor, "__getitem__"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a local copy of the pinned wheel")
    parser.add_argument("--out", type=Path, default=SURFACE_FILE)
    args = parser.parse_args(argv)
    wheel = args.wheel or fetch_wheel()
    if sha256(wheel) != WHEEL_SHA256:
        parser.error(f"{wheel} is not the pinned {WHEEL_NAME}")
    torchair = import_torchair(unpack_torchair(wheel))
    surface = extract(torchair, wheel)
    args.out.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    sys.stdout.write(f"wrote {args.out} ({len(surface['builders']['functions'])} builders)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

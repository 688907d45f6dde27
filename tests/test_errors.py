"""Every exception class the package defines derives from ``eplb_graph.EplbError``.

Walks every module of the package (the vLLM integration too: it imports vLLM only when vLLM
loads it), so a new error class added anywhere without the common base fails here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import eplb_graph
from eplb_graph.errors import EplbError


def _package_modules():
    for info in pkgutil.walk_packages(eplb_graph.__path__, prefix="eplb_graph."):
        if info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def test_every_package_error_derives_from_the_common_base():
    defined = {
        (module.__name__, name): cls
        for module in _package_modules()
        for name, cls in vars(module).items()
        if inspect.isclass(cls)
        and issubclass(cls, BaseException)
        and cls.__module__ == module.__name__
    }
    assert len(defined) >= 18, sorted(defined)  # the walk really found the package's errors
    orphans = sorted(
        f"{module}.{name}"
        for (module, name), cls in defined.items()
        if not issubclass(cls, EplbError)
    )
    assert orphans == []


def test_the_base_is_exported_from_the_front_door():
    assert eplb_graph.EplbError is EplbError

"""Lazy public names for a package's ``__init__`` (PEP 562 module ``__getattr__``).

Why: importing torch takes seconds, and the command line must answer ``--help`` and usage
errors without it. A package whose ``__init__`` imported its torch-using modules eagerly would
make every ``from eplb_graph.<package>.<light module> import ...`` pay for torch, because Python
runs the package's ``__init__`` first. With these helpers a package lists each public name and
the module defining it; the module is imported on the name's first use, and the name is then
cached in the package's namespace (later lookups are plain attribute reads).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], public: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``public`` (name -> module).

    A name that is not public but is a submodule of ``package`` imports it, as attribute access
    to an already imported submodule always did.
    """

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__

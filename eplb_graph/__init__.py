"""eplb-graph: a graph-capture-first Expert Parallelism Load Balancer for MoE inference.

The front door: everything a model-runner integration needs is importable from here.
Importing this package registers ``torch.ops.eplb_graph.*`` (see ``eplb_graph.ops``).

- ``Placement``: which logical expert sits in every physical slot (a value; expert-map files);
- ``EplbState``: the tensors a compiled graph reads, with stable addresses, committed in place;
- ``EplbRuntime``: what a runner calls around every forward (``begin_step`` / ``end_step``);
- ``RuntimeSettings``: its settings, one plain value (what to plan, when, how to move);
- ``GroupRing``: the gloo groups EPLB moves weights over (never the serving group);
- ``make_expert_view``: the weight view of one layer's experts, by format;
- ``parse_cli_args``, ``resolve_eplb_config``: vLLM / vllm-ascend EPLB settings, validated once
  and turned into ``RuntimeSettings`` (with the model's starting placement);
- ``EplbError``: the base of every error the package raises on purpose.

Why the names load lazily: importing torch takes seconds, and ``eplb-graph --help`` or a usage
error must not pay them (nor must a process that only reads an expert-map summary). Each public
name is imported on first use (module ``__getattr__``), and so is any submodule reached as an
attribute (``eplb_graph.policy``). The ops still register whenever torch is there: at once if
torch was imported first, else the moment torch is imported (``_ops_on_torch_import``), so
``import eplb_graph`` followed by ``torch.ops.eplb_graph.map_and_record`` works in either order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from eplb_graph.errors import EplbError
from eplb_graph.lazy_exports import lazy_exports

#: Public name -> the module that defines it.
_PUBLIC = {
    "ConfigError": "eplb_graph.integrations.settings",
    "EplbConfig": "eplb_graph.integrations.settings",
    "EplbRuntime": "eplb_graph.runtime",
    "EplbState": "eplb_graph.state",
    "ExpertMapError": "eplb_graph.expert_map",
    "GroupRing": "eplb_graph.movement.transport",
    "LegacyEplbConfig": "eplb_graph.integrations.settings",
    "Placement": "eplb_graph.placement",
    "PlacementError": "eplb_graph.tables",
    "RuntimeSettings": "eplb_graph.settings",
    "make_expert_view": "eplb_graph.movement.views",
    "parse_cli_args": "eplb_graph.integrations.settings",
    "resolve_eplb_config": "eplb_graph.integrations.settings",
    "supported_formats": "eplb_graph.movement.views",
}

__all__ = [
    "ConfigError",
    "EplbConfig",
    "EplbError",
    "EplbRuntime",
    "EplbState",
    "ExpertMapError",
    "GroupRing",
    "LegacyEplbConfig",
    "Placement",
    "PlacementError",
    "RuntimeSettings",
    "make_expert_view",
    "parse_cli_args",
    "resolve_eplb_config",
    "supported_formats",
]
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)


class _OpsOnTorchImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers ``torch.ops.eplb_graph`` right after ``torch`` itself finishes importing.

    Used only when ``eplb_graph`` is imported before torch. It finds torch's spec with the other
    finders, runs torch's own loader, then imports ``eplb_graph.ops``; it removes itself first,
    so it acts once and never sees another module.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        self._remove()
        spec = importlib.util.find_spec(fullname)  # the other finders (this one is gone)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # torch's own, from now on
        self._loader.exec_module(module)
        importlib.import_module("eplb_graph.ops")

    def _remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


if "torch" in sys.modules:
    from eplb_graph import ops as _ops  # noqa: F401  (registers torch.ops.eplb_graph)
else:
    sys.meta_path.insert(0, _OpsOnTorchImport())

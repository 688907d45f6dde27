"""eplb-graph's EPLB on vllm-ascend's Model Runner V2 (pinned: vllm-ascend 0.30.0rc2).

vllm-ascend's Model Runner V2 uses upstream vLLM's EPLB with a thin Ascend layer (a per-router
mapping, load recorded after compute, ``AscendEplbState`` / ``AscendEPLBController``, Gloo
staged movement). With ``enable_eplb`` and ``additional_config={"eplb_graph": {...}}``, this
attach puts eplb-graph there instead:

- :mod:`.facts`: every vllm-ascend name the attach relies on, checked at load (one message on a
  mismatch) and in the tests against the pinned release's source;
- :mod:`.routing`: per-router ``_apply_eplb_mapping`` -> ``torch.ops.eplb_graph.map_and_record``,
  vllm-ascend's post-compute recording off for those routers, recording rank by MoE comm method;
- :mod:`.weights`: views over ``get_eplb_weight_views`` (W8A8, W4A8, unquantized; stacked or
  per-expert lists);
- :mod:`.controller`: :class:`EplbGraphController` where ``AscendEPLBController`` stands;
- the worker's shutdown (``NPUWorker.shutdown``) closes eplb-graph's runtime first, as the CPU
  plugin's runner shutdown does.

:func:`install` is called by eplb-graph's vLLM plugin on a non-CPU platform. It changes nothing
until vllm-ascend's Model Runner V2 module is imported, and then only wraps the controller class
global, which keeps building vllm-ascend's own controller unless eplb-graph is asked for, and
the worker's shutdown, which closes nothing unless that controller is eplb-graph's.
Never run on an NPU: see docs/vllm.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["install"]

RUNNER_MODULE = "vllm_ascend.worker.v2.model_runner"
ROUTED_EXPERTS_MODULE = "vllm_ascend.ops.fused_moe.routed_experts"
WORKER_MODULE = "vllm_ascend.worker.worker"
CONTROLLER_MODULE = "eplb_graph.integrations.vllm_ascend.controller"

_installed = False


def install() -> None:
    """Wrap vllm-ascend's controller global and recording function when they are imported."""
    global _installed
    if _installed:
        return
    _after_import(RUNNER_MODULE, _wrap_controller)
    _after_import(ROUTED_EXPERTS_MODULE, _switch_recording)
    _after_import(WORKER_MODULE, _wrap_worker_shutdown)
    _installed = True


def _wrap_controller(module: Any) -> None:
    original = module.AscendEPLBController
    if getattr(original, "_eplb_graph_factory", False):
        return

    @functools.wraps(original, updated=())
    def controller(parallel_config, device, ascend_eplb_config=None):
        from vllm.config import get_current_vllm_config

        from eplb_graph.integrations.vllm.settings import plugin_section

        vllm_config = get_current_vllm_config()
        if not parallel_config.enable_eplb or plugin_section(vllm_config) is None:
            return original(parallel_config, device, ascend_eplb_config)
        from eplb_graph.integrations.vllm_ascend.controller import EplbGraphController
        from eplb_graph.integrations.vllm_ascend.facts import check_vllm_ascend

        check_vllm_ascend()
        return EplbGraphController(
            parallel_config, device, ascend_eplb_config, vllm_config=vllm_config
        )

    controller._eplb_graph_factory = True
    module.AscendEPLBController = controller


def _wrap_worker_shutdown(module: Any) -> None:
    """``NPUWorker.shutdown`` closes eplb-graph's runtime, then runs as written.

    vLLM's worker process calls the worker's shutdown, then destroys the distributed environment
    (every process group, eplb-graph's movement groups too). As on vLLM's CPU runner, eplb-graph
    closes first: its movement worker thread is stopped before its groups go, and with
    ``metrics_path`` the rank file gets its final counts and ``closed: true``.
    """
    worker = module.NPUWorker
    shutdown = worker.shutdown
    if getattr(shutdown, "_eplb_graph_closes", False):
        return

    @functools.wraps(shutdown)
    def shutdown_with_eplb(self):
        close_eplb_graph(getattr(self, "model_runner", None))
        return shutdown(self)

    shutdown_with_eplb._eplb_graph_closes = True
    worker.shutdown = shutdown_with_eplb


def close_eplb_graph(model_runner: Any) -> bool:
    """Close the runner's EPLB controller if it is eplb-graph's (idempotent); whether it was.

    Imports nothing: a controller of eplb-graph's exists only once its module was imported.
    """
    controller = sys.modules.get(CONTROLLER_MODULE)
    eplb = getattr(model_runner, "eplb", None)
    if controller is None or not isinstance(eplb, controller.EplbGraphController):
        return False
    eplb.close()
    return True


def _switch_recording(module: Any) -> None:
    from eplb_graph.integrations.vllm_ascend.routing import install_recording_switch

    install_recording_switch(module)


def _after_import(name: str, patch: Callable[[Any], None]) -> None:
    """Run ``patch(module)`` now if ``name`` is imported, else right after it is."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    sys.meta_path.insert(0, _PatchAfterImport(name, patch))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of one module to patch it once executed."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec

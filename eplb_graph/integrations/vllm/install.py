"""What ``register()`` does in every vLLM process: check, then patch, each patch once.

vLLM loads general plugins in the process that parses the configuration, in the engine core and
in every worker, before any of them builds a config or a model; patching module attributes here
therefore reaches every process. The plugin attaches to vLLM's CPU platform only: on another
platform vLLM's own EPLB (or vllm-ascend's) is in charge, so nothing is patched there, and a
request for eplb-graph's settings is refused at engine start.
"""

from __future__ import annotations

import functools
import logging

from eplb_graph.integrations.vllm import (
    compat,
    expert_parallel,
    gate,
    gpt_oss,
    llama4_loading,
    routing,
)
from eplb_graph.integrations.vllm.options import PREFIX

logger = logging.getLogger(__name__)

_installed = False


def install() -> None:
    """Check the vLLM found here and install every patch (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    _log_through_vllm()
    if on_cpu:
        compat.check_vllm()
        gate.install()
        routing.install()
        expert_parallel.install()
        llama4_loading.install()
        gpt_oss.install()
        _install_runner_hooks()
    _install_engine_config_check(on_cpu)
    _installed = True
    logger.debug("eplb-graph vLLM plugin installed (CPU platform: %s)", on_cpu)


def _log_through_vllm() -> None:
    """Send eplb-graph's INFO lines where vLLM's go (its handlers, every process).

    vLLM configures handlers on its own ``vllm`` logger only; without this, the attach and
    rearrangement lines of eplb-graph would be dropped in every worker. Nothing is changed
    when the application configured ``eplb_graph`` or the root logger itself, or when vLLM's
    logging is off (``VLLM_CONFIGURE_LOGGING=0``: no handlers to borrow).
    """
    ours, theirs = logging.getLogger("eplb_graph"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    ours.propagate = False


def _install_runner_hooks() -> None:
    from eplb_graph.integrations.vllm.runner import VllmEplbAdapter, attach

    owner, name, load_model = compat.CPU_LOAD_MODEL.owner_and_value()

    @functools.wraps(load_model)
    def load_model_with_eplb(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if self.parallel_config.enable_eplb:
            attach(self)
        return result

    setattr(owner, name, load_model_with_eplb)

    owner, name, shutdown = compat.RUNNER_SHUTDOWN.owner_and_value()

    @functools.wraps(shutdown)
    def shutdown_with_eplb(self):
        adapter = getattr(self, "eplb_state", None)
        if isinstance(adapter, VllmEplbAdapter):
            adapter.close()
        return shutdown(self)

    setattr(owner, name, shutdown_with_eplb)


def _install_engine_config_check(on_cpu: bool) -> None:
    """Check eplb-graph's settings where vLLM builds its config, so ``LLM(...)`` or the server
    fails at start-up with the named field (not later, inside a worker)."""
    from eplb_graph.integrations.settings import ConfigError
    from eplb_graph.integrations.vllm.metrics import register_prometheus_collector
    from eplb_graph.integrations.vllm.settings import eplb_settings, plugin_section

    owner, name, create_engine_config = compat.CREATE_ENGINE_CONFIG.owner_and_value()

    @functools.wraps(create_engine_config)
    def create_engine_config_checked(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        if not on_cpu:
            if plugin_section(config) is not None:
                raise ConfigError(
                    PREFIX,
                    "eplb-graph's vLLM plugin runs on vLLM's CPU platform only (verified there); "
                    "on this platform use vLLM's own EPLB, or vllm-ascend's on Ascend",
                )
            return config
        settings = eplb_settings(config)
        if settings is not None and settings.metrics_path is not None:
            register_prometheus_collector(settings.metrics_path)
        return config

    setattr(owner, name, create_engine_config_checked)

"""What ``register()`` does in every vLLM process: check, then patch, each patch once.

vLLM loads general plugins in the process that parses the configuration, in the engine core and
in every worker, before any of them builds a config or a model; patching module attributes here
therefore reaches every process. The plugin attaches to vLLM's CPU platform only: on another
platform vLLM's own EPLB is in charge, so nothing is patched there, and a request for
eplb-graph's settings is refused at engine start. On vllm-ascend's NPU platform the attach of
:mod:`eplb_graph.integrations.vllm_ascend` is installed instead (it acts only on request).
"""

from __future__ import annotations

import functools
import logging

from eplb_graph.integrations.vllm import (
    closing,
    compat,
    expert_parallel,
    gate,
    gpt_oss,
    llama4_loading,
    quantized,
    routing,
)
from eplb_graph.integrations.vllm.logs import log_through_vllm
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
    on_ascend = _is_ascend(current_platform)
    log_through_vllm()
    if on_ascend:
        from eplb_graph.integrations import vllm_ascend

        vllm_ascend.install()
    if on_cpu:
        compat.check_vllm()
        gate.install()
        routing.install()
        expert_parallel.install()
        llama4_loading.install()
        quantized.install()
        gpt_oss.install()
        _install_runner_hooks()
        closing.install()
    _install_engine_config_check(on_cpu or on_ascend)
    _installed = True
    logger.debug("eplb-graph vLLM plugin installed (CPU platform: %s)", on_cpu)


def _is_ascend(platform: object) -> bool:
    """vllm-ascend's platform (device type ``npu``)."""
    return getattr(platform, "device_type", None) == "npu"


def _install_runner_hooks() -> None:
    from eplb_graph.integrations.vllm.attach import attach
    from eplb_graph.integrations.vllm.runner import VllmEplbAdapter

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


def _install_engine_config_check(supported: bool) -> None:
    """Check eplb-graph's settings where vLLM builds its config, so ``LLM(...)`` or the server
    fails at start-up with the named field (not later, inside a worker)."""
    from eplb_graph.integrations.settings import ConfigError
    from eplb_graph.integrations.vllm.metrics import register_prometheus_collector
    from eplb_graph.integrations.vllm.settings import eplb_settings, plugin_section

    owner, name, create_engine_config = compat.CREATE_ENGINE_CONFIG.owner_and_value()

    @functools.wraps(create_engine_config)
    def create_engine_config_checked(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        if not supported:
            if plugin_section(config) is not None:
                raise ConfigError(
                    PREFIX,
                    "eplb-graph's vLLM plugin runs on vLLM's CPU platform (verified there) and "
                    "vllm-ascend's NPU platform only; on this platform use vLLM's own EPLB",
                )
            return config
        settings = eplb_settings(config)
        if settings is not None and settings.metrics_path is not None:
            register_prometheus_collector(settings.metrics_path)
            closing.watch(settings.metrics_path)
        return config

    setattr(owner, name, create_engine_config_checked)

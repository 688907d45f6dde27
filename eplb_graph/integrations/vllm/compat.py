"""Which vLLM this plugin attaches to, and the exact shape of everything it patches.

The plugin replaces private vLLM names (the routing hook, a CPU kernel wrapper's method, the CPU
model runner's model loader, a config-validation global). That is the accepted practice for
out-of-tree platform work, but only safe when the names still mean what they meant: so before
patching anything the plugin checks the vLLM version and the parameter list of every target, and
refuses with one message that lists every difference, instead of half-patching a vLLM it does
not know.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from eplb_graph.errors import EplbError

SUPPORTED_VLLM = "0.32.0"
"""The one vLLM release the plugin is verified against (``pip install 'eplb-graph[vllm]'``)."""


class VllmPluginError(EplbError, RuntimeError):
    """The plugin cannot attach to this vLLM (wrong version, changed internals, wrong platform)."""


@dataclass(frozen=True)
class PatchTarget:
    """One vLLM callable the plugin replaces or wraps, with the parameters it must have."""

    module: str
    attribute: str  # dotted inside the module, e.g. "CPUUnquantizedExperts.apply"
    parameters: tuple[str, ...]
    partial: bool = False  # True: the target must have at least these parameters, in this order

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def owner_and_value(self) -> tuple[object, str, object]:
        """``(object holding the attribute, attribute name, current value)``."""
        owner: object = importlib.import_module(self.module)
        *path, last = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, last, getattr(owner, last)

    def problem(self) -> str | None:
        """Why this target does not match, or ``None``."""
        try:
            _, _, value = self.owner_and_value()
        except (ImportError, AttributeError) as error:
            return f"{self.name} is missing ({type(error).__name__}: {error})"
        original = getattr(value, "__wrapped__", value)
        if isinstance(original, property):  # a read-only attribute: check its getter
            original = original.fget
        found = tuple(inspect.signature(original).parameters)
        kept = tuple(p for p in found if p in self.parameters) if self.partial else found
        if kept != self.parameters:
            return f"{self.name} has parameters {list(found)}, expected {list(self.parameters)}"
        return None


ROUTING_HOOK = PatchTarget(
    "vllm.model_executor.layers.fused_moe.router.base_router",
    "eplb_map_to_physical_and_record",
    (
        "topk_ids",
        "expert_load_view",
        "logical_to_physical_map",
        "logical_replica_count",
        "record_enabled",
        "num_unpadded_tokens",
    ),
)
CPU_EXPERTS_APPLY = PatchTarget(
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
    "CPUUnquantizedExperts.apply",
    (
        "self",
        "output",
        "hidden_states",
        "w1",
        "w2",
        "topk_weights",
        "topk_ids",
        "activation",
        "global_num_experts",
        "expert_map",
        "a1q_scale",
        "a2_scale",
        "workspace13",
        "workspace2",
        "expert_tokens_meta",
        "apply_router_weight_on_input",
    ),
)
CPU_INT8_EXPERTS_APPLY = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsInt8.apply", CPU_EXPERTS_APPLY.parameters
)
CPU_INT8_EXPERTS_DEVICE = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsInt8._supports_current_device", ()
)
W8A8_INT8_SUPPORTS_EPLB = PatchTarget(
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
    "compressed_tensors_moe_w8a8_int8",
    "CompressedTensorsW8A8Int8MoEMethod.supports_eplb",
    ("self",),
)
CPU_INT4_EXPERTS_APPLY = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsInt4.apply", CPU_EXPERTS_APPLY.parameters
)
CPU_INT4_EXPERTS_DEVICE = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsInt4._supports_current_device", ()
)
WNA16_SUPPORTS_EPLB = PatchTarget(
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
    "compressed_tensors_moe_wna16",
    "CompressedTensorsWNA16MoEMethod.supports_eplb",
    ("self",),
)
GPTQ_SUPPORTS_EPLB = PatchTarget(
    "vllm.model_executor.layers.quantization.auto_gptq",
    "AutoGPTQMoEMethod.supports_eplb",
    ("self",),
)
AWQ_SUPPORTS_EPLB = PatchTarget(
    "vllm.model_executor.layers.quantization.auto_awq",
    "AutoAWQMoEMethod.supports_eplb",
    ("self",),
)
CPU_LOAD_MODEL = PatchTarget(
    "vllm.v1.worker.cpu_model_runner", "CPUModelRunner.load_model", ("self", "load_dummy_weights")
)
RUNNER_SHUTDOWN = PatchTarget(
    "vllm.v1.worker.cpu_model_runner", "CPUModelRunner.shutdown", ("self",)
)
RUNNER_EPLB_STEP = PatchTarget(
    "vllm.v1.worker.gpu_model_runner",
    "GPUModelRunner.eplb_step",
    ("self", "is_dummy", "is_profile"),
)
CREATE_ENGINE_CONFIG = PatchTarget(
    "vllm.engine.arg_utils",
    "EngineArgs.create_engine_config",
    ("self", "usage_context", "headless"),
)
SET_EPLB_STATE = PatchTarget(
    "vllm.model_executor.models.interfaces",
    "MixtureOfExperts.set_eplb_state",
    ("self", "expert_load_view", "logical_to_physical_map", "logical_replica_count"),
)
LLAMA4_LOAD_EXPERTS = PatchTarget(
    "vllm.model_executor.models.llama4",
    "Llama4Model.load_moe_expert_weights",
    (
        "self",
        "name",
        "loaded_weight",
        "params_dict",
        "loaded_params",
        "expert_params_mapping",
        "fused",
    ),
)
ENGINE_PROCS_SHUTDOWN = PatchTarget("vllm.v1.engine.utils", "shutdown", ("procs", "timeout"))
GPT_OSS_FACTORY = PatchTarget(
    "vllm.model_executor.models.gpt_oss",
    "FusedMoEFactory",
    ("num_experts", "enable_eplb", "num_redundant_experts"),
    partial=True,
)
GPT_OSS_LOAD = PatchTarget(
    "vllm.model_executor.models.gpt_oss", "GptOssModel.load_weights", ("self", "weights")
)
GPT_OSS_LOAD_OTHER = PatchTarget(
    "vllm.model_executor.models.gpt_oss",
    "GptOssModel._load_weights_other",
    (
        "self",
        "ep_rank_end",
        "ep_rank_start",
        "heads_per_rank",
        "head_start",
        "weights",
        "stacked_params_mapping",
    ),
)
CPU_FP8_EXPERTS_APPLY = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsFp8.apply", CPU_EXPERTS_APPLY.parameters
)
CPU_FP8_EXPERTS_DEVICE = PatchTarget(
    CPU_EXPERTS_APPLY.module, "CPUExpertsFp8._supports_current_device", ()
)
TARGETS = (
    ROUTING_HOOK,
    CPU_EXPERTS_APPLY,
    CPU_LOAD_MODEL,
    RUNNER_SHUTDOWN,
    RUNNER_EPLB_STEP,
    CREATE_ENGINE_CONFIG,
    SET_EPLB_STATE,
    LLAMA4_LOAD_EXPERTS,
    CPU_INT8_EXPERTS_APPLY,
    CPU_INT8_EXPERTS_DEVICE,
    W8A8_INT8_SUPPORTS_EPLB,
    CPU_INT4_EXPERTS_APPLY,
    CPU_INT4_EXPERTS_DEVICE,
    WNA16_SUPPORTS_EPLB,
    GPTQ_SUPPORTS_EPLB,
    AWQ_SUPPORTS_EPLB,
    ENGINE_PROCS_SHUTDOWN,
    GPT_OSS_FACTORY,
    GPT_OSS_LOAD,
    GPT_OSS_LOAD_OTHER,
    CPU_FP8_EXPERTS_APPLY,
    CPU_FP8_EXPERTS_DEVICE,
)

_PLATFORM_GATE_MODULE = "vllm.config.parallel"
_PLATFORM_GATE_CALL = "is_cuda_alike()"


def platform_gate_problem() -> str | None:
    """The CPU gate patch swaps ``current_platform`` in ``vllm.config.parallel`` for a proxy
    whose ``is_cuda_alike()`` is true; that is only safe while the module asks exactly once."""
    module = importlib.import_module(_PLATFORM_GATE_MODULE)
    calls = inspect.getsource(module).count(_PLATFORM_GATE_CALL)
    if calls != 1:
        return (
            f"{_PLATFORM_GATE_MODULE} calls current_platform.{_PLATFORM_GATE_CALL} {calls} "
            "times, expected once (the EPLB platform check)"
        )
    return None


def check_vllm() -> None:
    """Raise :class:`VllmPluginError` unless this is the vLLM the plugin knows, unchanged."""
    import vllm

    problems = []
    if vllm.__version__ != SUPPORTED_VLLM:
        problems.append(
            f"vLLM {vllm.__version__} is installed, the plugin supports {SUPPORTED_VLLM}"
        )
    else:
        problems += [p for p in (t.problem() for t in TARGETS) if p is not None]
        gate = platform_gate_problem()
        if gate is not None:
            problems.append(gate)
    if problems:
        raise VllmPluginError(
            "eplb-graph's vLLM plugin refuses to load: "
            + "; ".join(problems)
            + f". Install the supported vLLM (pip install 'eplb-graph[vllm]': vLLM "
            f"{SUPPORTED_VLLM}), or keep vLLM from loading this plugin (VLLM_PLUGINS=<the other "
            "plugins>, or uninstall eplb-graph)."
        )

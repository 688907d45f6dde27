"""Everything the vllm-ascend attach assumes about vllm-ascend, as one table, and its checker.

The attach replaces private vllm-ascend names (a per-router method, a module-level recording
function, the model runner's EPLB controller class). That is only safe while those names still
mean what they meant in the release the attach was written against, so every assumption is one
row of :data:`FACTS`, and :func:`fact_problems` checks every row against Python source with
``ast``. The same function runs twice:

- at load (:func:`check_vllm_ascend`), over the installed vllm-ascend's own source, so a changed
  vllm-ascend is refused with one message listing every difference, before anything is patched;
- in the tests, over the source of the pinned release's sdist from the package index, so the
  table (and with it the attach) cannot drift from the real code without a failing test.

Pinned release: vllm-ascend 0.30.0rc2 (paired with vLLM 0.30.0). It is the newest release on the
package index that carries Model Runner V2's EPLB at all; 0.23.0.post1, 0.25.1rc1 and 0.26.0rc1
carry none of it (their sdists have no ``_adapt_eplb_router``, no ``AscendEplbState``, no
``get_eplb_weight_views``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from eplb_graph.integrations.vllm.compat import VllmPluginError

SUPPORTED_VLLM_ASCEND = "0.30.0rc2"
"""The one vllm-ascend release the attach is written and checked against."""

SDIST_NAME = f"vllm_ascend-{SUPPORTED_VLLM_ASCEND}.tar.gz"
SDIST_SHA256 = "05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f"
"""The package index's sha256 of that sdist (the tests refuse a download that differs)."""


class VllmAscendPluginError(VllmPluginError):
    """The attach cannot work with this vllm-ascend (wrong release, changed internals)."""


@dataclass(frozen=True)
class SourceFact:
    """One assumption about a definition in vllm-ascend's source.

    Attributes:
        module: dotted module (its file is ``module.replace('.', '/') + '.py'``).
        name: ``func``, ``Class``, ``Class.method`` or a module-level ``CONSTANT``.
        parameters: the exact parameter names of a function (``None``: not checked).
        uses: names the definition's body must mention (a call, an attribute read, an import,
            or a string such as ``getattr(layer, "name")``).
        attributes: for a class, ``self.<attribute>`` its methods must assign.
        value: for a constant, its string value.
        why: what the attach does with it (shown on a mismatch).
    """

    module: str
    name: str
    why: str
    parameters: tuple[str, ...] | None = None
    uses: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    value: str | None = None

    @property
    def path(self) -> str:
        return self.module.replace(".", "/") + ".py"


_FUSED_MOE_PATCH = "vllm_ascend.patch.platform.patch_fused_moe"
_ROUTED_EXPERTS = "vllm_ascend.ops.fused_moe.routed_experts"
_EPLB_STATE = "vllm_ascend.distributed.eplb.eplb_state"
_CONTROLLER = "vllm_ascend.worker.v2.eplb"
_RUNNER = "vllm_ascend.worker.v2.model_runner"
_WORKER = "vllm_ascend.worker.worker"
_CONTEXT = "vllm_ascend.ascend_forward_context"
_W8A8 = "vllm_ascend.quantization.methods.w8a8.w8a8_dynamic"
_W4A8 = "vllm_ascend.quantization.methods.w4a8.w4a8"

FACTS: tuple[SourceFact, ...] = (
    # -- routing: a per-instance method on each router, not a module global ----------------------
    SourceFact(
        _FUSED_MOE_PATCH,
        "_adapt_eplb_router",
        "vllm-ascend binds its mapping onto each router instance; eplb-graph binds its own after",
        parameters=("router", "enable_eplb"),
        uses=("MethodType", "_apply_eplb_mapping", "_EPLB_ROUTER_ADAPTED", "signature"),
    ),
    SourceFact(
        _FUSED_MOE_PATCH,
        "_ascend_apply_eplb_mapping",
        "the per-router mapping eplb-graph's adapter replaces (same parameters)",
        parameters=("self", "topk_ids"),
        uses=("ascend_eplb_map_to_physical", "_validate_eplb_state", "eplb_state"),
    ),
    SourceFact(
        _FUSED_MOE_PATCH,
        "_EPLB_ROUTER_ADAPTED",
        "the marker that keeps vllm-ascend from rebinding an adapted router",
        value="_vllm_ascend_eplb_router_adapted",
    ),
    # -- load: recorded after compute, through one module global -------------------------------
    SourceFact(
        _ROUTED_EXPERTS,
        "_record_v2_eplb_load",
        "post-compute load recording, switched off for eplb-graph's routers (no double count)",
        parameters=("router", "result"),
        uses=("ascend_eplb_record_expert_tokens", "expert_tokens", "local_expert_start"),
    ),
    SourceFact(
        _ROUTED_EXPERTS,
        "AscendRoutedExperts.forward_impl",
        "calls the module global _record_v2_eplb_load by name at every forward",
        parameters=("self", "hidden_states", "router_logits", "input_ids"),
        uses=("_record_v2_eplb_load", "_select_experts", "get_moe_comm_method"),
    ),
    SourceFact(
        _ROUTED_EXPERTS,
        "AscendRoutedExperts.get_expert_weights",
        "the weight-view contract: quant_method.get_eplb_weight_views(layer)",
        parameters=("self",),
        uses=("get_eplb_weight_views", "local_num_experts"),
    ),
    SourceFact(
        _ROUTED_EXPERTS,
        "AscendRoutedExperts",
        "each MoE layer's routed experts hold their router and quant method",
        attributes=("router",),
    ),
    # -- state and controller eplb-graph stands in for ------------------------------------------
    SourceFact(
        _EPLB_STATE,
        "AscendEplbLayerState",
        "the router's layer state (upstream EplbLayerState fields plus Ascend's routing table)",
        attributes=("expert_replica_routing_table", "local_expert_start", "local_expert_count"),
    ),
    SourceFact(_EPLB_STATE, "AscendEplbState", "the EPLB state eplb-graph's EplbState replaces"),
    SourceFact(
        _CONTROLLER,
        "AscendEPLBController.__init__",
        "eplb-graph's controller is constructed where this one is, with the same arguments",
        parameters=("self", "parallel_config", "device", "ascend_eplb_config"),
    ),
    SourceFact(
        _CONTROLLER,
        "AscendEPLBController.set_batch_phase",
        "the runner reports each batch's phase through this method",
        parameters=("self", "batch_has_prefill"),
    ),
    SourceFact(
        _CONTROLLER,
        "AscendEPLBController.prepare_forward",
        "called before every forward with the unpadded token count",
        parameters=("self", "model_config", "num_unpadded_tokens", "ubatch_slices"),
    ),
    SourceFact(
        _RUNNER,
        "NPUModelRunner.__init__",
        "the runner builds its controller from the module global AscendEPLBController",
        uses=("AscendEPLBController", "eplb"),
    ),
    SourceFact(
        _RUNNER,
        "NPUModelRunner.prepare_inputs",
        "reports the batch phase (set_batch_phase) once per batch",
        uses=("set_batch_phase",),
    ),
    # -- shutdown: the worker's, which reaches the runner (no controller hook exists) ------------
    SourceFact(
        _WORKER,
        "NPUWorker.init_device",
        "the worker keeps Model Runner V2 (its .eplb is the controller) as self.model_runner",
        uses=("NPUModelRunnerV2", "model_runner"),
    ),
    SourceFact(
        _WORKER,
        "NPUWorker.shutdown",
        "vLLM's worker process calls it before destroying the process groups; eplb-graph's "
        "wrapper closes its runtime first, then runs it (it shuts the model runner down)",
        parameters=("self",),
        uses=("model_runner", "shutdown"),
    ),
    # -- which rank sees which tokens: the MoE communication method ------------------------------
    SourceFact(
        _CONTEXT,
        "MoECommType",
        "all-gather (every rank routes every token) versus MC2 / all-to-all (each its own)",
        uses=("ALLGATHER", "MC2", "ALLTOALL", "FUSED_MC2"),
    ),
    SourceFact(
        _CONTEXT,
        "_ExtraForwardContextProxy",
        "_EXTRA_CTX.moe_comm_type names this forward's communication method",
        uses=("moe_comm_type",),
    ),
    # -- weights --------------------------------------------------------------------------------
    SourceFact(
        _W8A8,
        "AscendW8A8DynamicFusedMoEMethod.get_eplb_weight_views",
        "W8A8: weights, fp32/int scales and fused-MC2 scales, stacked or per-expert lists",
        parameters=("layer",),
        uses=(
            "w13_weight_list",
            "w2_weight_list",
            "w13_weight_scale_fp32_list",
            "w2_weight_scale_list",
            "fused_w1_scale_list",
            "fused_w2_scale_list",
            "w13_weight",
            "w2_weight",
            "w13_weight_scale_fp32",
            "w2_weight_scale",
            "fused_w1_scale",
            "fused_w2_scale",
        ),
    ),
    SourceFact(
        _W4A8,
        "AscendW4A8DynamicFusedMoEMethod.get_eplb_weight_views",
        "W4A8: W8A8's tensors plus the scale biases",
        parameters=("layer",),
        uses=("w13_weight_list", "w13_scale_bias_list", "w13_scale_bias", "w2_scale_bias"),
    ),
    SourceFact(
        "vllm_ascend.quantization.method_adapters",
        "AscendFusedMoEMethod.get_eplb_weight_views",
        "the layer's quant method forwards to its scheme",
        parameters=("self", "layer"),
        uses=("quant_method",),
    ),
)


_BASE_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_UPSTREAM_CONTROLLER = "vllm.v1.worker.gpu.eplb_utils"

UPSTREAM_FACTS: tuple[SourceFact, ...] = (
    SourceFact(
        _BASE_ROUTER,
        "BaseRouter",
        "upstream routers validate the layer state, then call self._apply_eplb_mapping",
        uses=("_validate_eplb_state", "_apply_eplb_mapping", "num_unpadded_tokens_tensors"),
    ),
    SourceFact(
        "vllm.distributed.eplb.eplb_state",
        "EplbLayerState",
        "the fields eplb-graph points at its own rows",
        uses=(
            "expert_load_view",
            "logical_to_physical_map",
            "logical_replica_count",
            "should_record_tensor",
            "num_unpadded_tokens_tensors",
        ),
    ),
    *(
        SourceFact(_UPSTREAM_CONTROLLER, f"EPLBController.{name}", why, parameters=parameters)
        for name, parameters, why in (
            ("prepare_load", ("self",), "called before the model is loaded"),
            ("maybe_register_model", ("self", "model", "model_config"), "builds the EPLB"),
            (
                "maybe_register_speculator",
                ("self", "speculator", "speculative_config", "load_dummy_weights"),
                "a draft model",
            ),
            (
                "maybe_start_async_loop",
                ("self", "eplb_models_added", "load_dummy_weights"),
                "starts the async worker",
            ),
            ("step", ("self", "is_dummy", "is_profile"), "after every forward and dummy run"),
        )
    ),
)
"""Upstream vLLM names the attach relies on (checked at load against the installed vLLM)."""


def fact_problems(
    read_source: Callable[[str], str | None], facts: tuple[SourceFact, ...] = FACTS
) -> list[str]:
    """Every row of ``facts`` that the source given by ``read_source(module)`` breaks.

    ``read_source`` returns a module's source text, or ``None`` when there is no such module.
    """
    problems: list[str] = []
    trees: dict[str, ast.Module | None] = {}
    for fact in facts:
        if fact.module not in trees:
            source = read_source(fact.module)
            trees[fact.module] = None if source is None else ast.parse(source)
        tree = trees[fact.module]
        where = f"{fact.module}.{fact.name}"
        if tree is None:
            problems.append(f"{where}: module {fact.module} is missing ({fact.why})")
            continue
        node = _find(tree, fact.name)
        if node is None:
            problems.append(f"{where} is missing ({fact.why})")
            continue
        problems += [f"{where} {problem} ({fact.why})" for problem in _node_problems(fact, node)]
    return problems


def _find(tree: ast.Module, dotted: str) -> ast.AST | None:
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in dotted.split("."):
        node = next((n for n in scope if _defines(n, part)), None)
        if node is None:
            return None
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return node


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _node_problems(fact: SourceFact, node: ast.AST) -> Iterator[str]:
    if fact.parameters is not None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "is not a function"
        else:
            args = node.args
            found = tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))
            if found != fact.parameters:
                yield f"has parameters {list(found)}, expected {list(fact.parameters)}"
    if fact.value is not None:
        value = getattr(node, "value", None)
        found_value = value.value if isinstance(value, ast.Constant) else None
        if found_value != fact.value:
            yield f"is {found_value!r}, expected {fact.value!r}"
    if fact.uses:
        mentioned = _mentioned(node)
        missing = [name for name in fact.uses if name not in mentioned]
        if missing:
            yield f"no longer mentions {missing}"
    if fact.attributes:
        assigned = _self_assigned(node)
        missing = [name for name in fact.attributes if name not in assigned]
        if missing:
            yield f"no longer assigns self.{', self.'.join(missing)}"


def _mentioned(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute):
            names.add(child.attr)
        elif isinstance(child, (ast.FunctionDef, ast.ClassDef)) and child is not node:
            names.add(child.name)
        elif isinstance(child, ast.alias):
            names.add(child.asname or child.name)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            names.add(child.value)  # getattr(layer, "name", None), attribute-name tuples
    return names


def _self_assigned(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for child in ast.walk(node):
        targets = child.targets if isinstance(child, ast.Assign) else []
        if isinstance(child, ast.AnnAssign):
            targets = [child.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


def installed_source(module: str) -> str | None:
    """The installed module's source (what :func:`check_vllm_ascend` reads)."""
    try:
        return inspect.getsource(importlib.import_module(module))
    except ImportError:
        return None


def check_vllm_ascend() -> None:
    """Raise :class:`VllmAscendPluginError` unless this is the vllm-ascend the attach knows."""
    import vllm_ascend

    version = getattr(vllm_ascend, "__version__", None)
    if version is None:
        from importlib import metadata

        version = metadata.version("vllm-ascend")
    if version != SUPPORTED_VLLM_ASCEND:
        problems = [
            f"vllm-ascend {version} is installed, the attach supports {SUPPORTED_VLLM_ASCEND}"
        ]
    else:
        problems = fact_problems(installed_source, FACTS + UPSTREAM_FACTS)
    if problems:
        raise VllmAscendPluginError(
            "eplb-graph's vllm-ascend attach refuses to load: "
            + "; ".join(problems)
            + f". Install vllm-ascend {SUPPORTED_VLLM_ASCEND}, or leave "
            "additional_config['eplb_graph'] unset to use vllm-ascend's own EPLB."
        )

"""The vllm-ascend attach: its fact table against the pinned release's real source (read with
``ast`` from the sdist on the package index), and its behaviour with fakes shaped by that table.

No NPU and no vllm-ascend install: the source test downloads the pinned sdist once (cached under
``$EPLB_GRAPH_CACHE`` or ``~/.cache/eplb-graph``, checked against the index's sha256) and is
skipped, with the reason, only where it cannot be had.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import types
import urllib.request
from pathlib import Path

import pytest
import torch

import eplb_graph.ops  # noqa: F401  (registers torch.ops.eplb_graph)
from eplb_graph.integrations.vllm import routing as vllm_routing
from eplb_graph.integrations.vllm_ascend import facts
from eplb_graph.integrations.vllm_ascend.facts import (
    FACTS,
    SDIST_NAME,
    SDIST_SHA256,
    SUPPORTED_VLLM_ASCEND,
    UPSTREAM_FACTS,
    VllmAscendPluginError,
    fact_problems,
)
from eplb_graph.integrations.vllm_ascend.routing import (
    ADAPTED,
    RouterRecording,
    adapt_router,
    install_recording_switch,
)
from eplb_graph.integrations.vllm_ascend.weights import layer_view
from eplb_graph.movement.views import UnsupportedWeightFormat
from eplb_graph.placement import Placement
from eplb_graph.state import EplbState
from tests.vllm_ascend_fakes import (
    ASCEND_MARKER,
    AscendFusedMoEMethod,
    AscendW4A8DynamicFusedMoEMethod,
    FakeLayerState,
    FakeResult,
    FakeRoutedExperts,
    FakeRouter,
    RouterWithOtherSignature,
    expert_of,
    recording_module,
    w8a8_layer,
)

INDEX = "https://pypi.org/simple/vllm-ascend/"


def _sdist() -> Path:
    cache = Path(os.environ.get("EPLB_GRAPH_CACHE", Path.home() / ".cache" / "eplb-graph"))
    path = cache / SDIST_NAME
    if not path.exists():
        request = urllib.request.Request(
            INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        url = next(f["url"] for f in files if f["filename"] == SDIST_NAME)
        with urllib.request.urlopen(url, timeout=600) as response:
            data = response.read()
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise AssertionError(f"{path} has sha256 {digest}, the index lists {SDIST_SHA256}")
    return path


@pytest.fixture(scope="session")
def ascend_sources() -> dict[str, str]:
    """The pinned release's source of every module the fact table names."""
    try:
        path = _sdist()
    except (OSError, StopIteration, ValueError) as error:
        pytest.skip(f"the vllm-ascend {SUPPORTED_VLLM_ASCEND} sdist cannot be had: {error}")
    prefix = f"vllm_ascend-{SUPPORTED_VLLM_ASCEND}/"
    wanted = {prefix + fact.path: fact.module for fact in FACTS}
    sources = {}
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if member.name in wanted:
                sources[wanted[member.name]] = archive.extractfile(member).read().decode()
    return sources


# -- the facts, against the real source -----------------------------------------------------------
def test_every_fact_the_attach_relies_on_holds_in_the_pinned_release(ascend_sources):
    assert {fact.module for fact in FACTS} <= set(ascend_sources)
    assert fact_problems(ascend_sources.get) == []


def test_a_changed_name_parameter_or_call_is_reported(ascend_sources):
    changed = dict(ascend_sources)
    routing_module = "vllm_ascend.patch.platform.patch_fused_moe"
    changed[routing_module] = changed[routing_module].replace(
        "def _ascend_apply_eplb_mapping(self, topk_ids", "def _ascend_apply_eplb_mapping(self, ids"
    )
    experts_module = "vllm_ascend.ops.fused_moe.routed_experts"
    changed[experts_module] = changed[experts_module].replace(
        "_record_v2_eplb_load(self.router", "_record_load(self.router"
    )
    worker_module = "vllm_ascend.worker.worker"
    changed[worker_module] = changed[worker_module].replace(
        "def shutdown(self) -> None:", "def close(self) -> None:"
    )
    del changed["vllm_ascend.worker.v2.eplb"]
    problems = "\n".join(fact_problems(changed.get))
    assert "_ascend_apply_eplb_mapping has parameters ['self', 'ids']" in problems
    assert "forward_impl no longer mentions ['_record_v2_eplb_load']" in problems
    assert "module vllm_ascend.worker.v2.eplb is missing" in problems
    assert "vllm_ascend.worker.worker.NPUWorker.shutdown is missing" in problems
    assert len(fact_problems(changed.get)) == 3 + 3  # the three controller rows


def test_the_upstream_vllm_facts_hold_in_the_installed_vllm():
    pytest.importorskip("vllm")
    assert fact_problems(facts.installed_source, UPSTREAM_FACTS) == []


def test_the_attach_refuses_another_release_with_one_message(monkeypatch, ascend_sources):
    fake = types.ModuleType("vllm_ascend")
    fake.__version__ = "0.23.0.post1"
    monkeypatch.setitem(sys.modules, "vllm_ascend", fake)
    with pytest.raises(VllmAscendPluginError, match=r"vllm-ascend 0\.23\.0\.post1 is installed"):
        facts.check_vllm_ascend()
    fake.__version__ = SUPPORTED_VLLM_ASCEND
    monkeypatch.setattr(facts, "installed_source", lambda module: ascend_sources.get(module))
    with pytest.raises(VllmAscendPluginError) as refused:
        facts.check_vllm_ascend()  # the vLLM rows are not in the vllm-ascend sdist
    assert str(refused.value).count("module vllm.") == len(UPSTREAM_FACTS)
    assert "Install vllm-ascend 0.30.0rc2" in str(refused.value)


def test_the_pinned_workers_own_shutdown_closes_eplb_graph_first_once_wrapped(ascend_sources):
    """The release's ``NPUWorker.shutdown``, compiled from the sdist as written, wrapped by the
    attach: eplb-graph's controller is closed before the worker shuts its runner down; a runner
    without eplb-graph's controller is left alone (the gloo ranks test the real close)."""
    import ast
    import textwrap
    from types import SimpleNamespace

    from eplb_graph.integrations import vllm_ascend
    from eplb_graph.integrations.vllm_ascend.controller import EplbGraphController
    from tests.vllm_ascend_fakes import FakeModelRunner, fake_vllm_config

    source = ascend_sources["vllm_ascend.worker.worker"]
    worker_class = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and node.name == "NPUWorker"
    )
    method = next(n for n in worker_class.body if getattr(n, "name", None) == "shutdown")
    namespace: dict = {"ensure_kv_transfer_shutdown": None}  # no KV transfer configured
    exec(textwrap.dedent(ast.get_source_segment(source, method)), namespace)
    module = types.ModuleType("pinned_worker")
    module.NPUWorker = type("NPUWorker", (), {"shutdown": namespace["shutdown"]})
    vllm_ascend._wrap_worker_shutdown(module)
    wrapped = module.NPUWorker.shutdown
    vllm_ascend._wrap_worker_shutdown(module)  # idempotent
    assert module.NPUWorker.shutdown is wrapped

    class Adapter:  # VllmEplbAdapter's close: once
        closed = False
        closes = 0

        def close(self):
            self.closes += 1
            self.closed = True

    config = fake_vllm_config(4, 2, 2, use_async=True)
    controller = EplbGraphController(config.parallel_config, "cpu", None, vllm_config=config)
    controller.state = Adapter()
    worker = module.NPUWorker()
    worker.profiler, worker.model_runner = None, FakeModelRunner(controller)
    worker.shutdown()
    assert worker.model_runner.shutdowns == [True]  # closed before the runner's shutdown
    assert controller.state.closes == 1

    other = module.NPUWorker()  # vllm-ascend's own controller: not eplb-graph's to close
    other.profiler, other.model_runner = None, FakeModelRunner(SimpleNamespace(state=None))
    other.shutdown()
    assert other.model_runner.shutdowns == [False]


# -- routing, with fakes --------------------------------------------------------------------------
def _state(rank: int = 0, num_logical: int = 4, redundant: int = 2, ranks: int = 2) -> EplbState:
    placement = Placement.default(1, num_logical, redundant, ranks)
    return EplbState(placement, rank=rank, offset_seed=0)


def _adapted(state: EplbState, rank: int, replicated) -> FakeRoutedExperts:
    layer_state = FakeLayerState()
    per_rank = state.num_slots // state.num_ranks
    layer_state.local_expert_start, layer_state.local_expert_count = rank * per_rank, per_rank
    router = FakeRouter(layer_state)
    adapt_router(router, 0, state, RouterRecording(state, rank, replicated), ASCEND_MARKER)
    vllm_routing.bind_offset(state.offset)
    return FakeRoutedExperts(router, None, per_rank)


def test_an_adapted_router_routes_through_map_and_record_and_records_once():
    state = _state()
    module = recording_module()
    install_recording_switch(module)
    experts = _adapted(state, 0, lambda: False)
    topk = torch.randint(0, 4, (40, 2), generator=torch.Generator().manual_seed(1))
    state.set_step_inputs_(30, True)  # 10 padding rows
    load, offset = state.load[0].clone(), state.offset.clone()
    expected = torch.ops.eplb_graph.map_and_record(
        topk,
        state.log2phy[0],
        state.replica_count[0],
        offset,
        load,
        state.num_valid_tokens,
        state.record_enabled,
    )
    slots = experts.forward(topk, module, ep_rank=0)
    assert torch.equal(slots, expected)
    assert torch.equal(state.load[0], load)  # once: the post-compute recording was skipped
    assert int(load.sum()) == 30 * 2
    assert torch.equal(state.committed_snapshot()[1][0][slots], topk)
    assert getattr(experts.router, ASCEND_MARKER) is True

    other = FakeRouter(FakeLayerState())  # not adapted: vllm-ascend's recording still runs
    other.eplb_state.expert_load_view = torch.zeros(6, dtype=torch.int64)
    other.eplb_state.should_record_tensor = torch.ones((), dtype=torch.bool)
    other.eplb_state.local_expert_count = 3
    module._record_v2_eplb_load(other, FakeResult(torch.tensor([1, 2, 3])))
    assert other.eplb_state.expert_load_view.tolist() == [1, 2, 3, 0, 0, 0]


@pytest.mark.parametrize("all_gather", [True, False])
def test_which_rank_records_follows_the_moe_communication_method(all_gather):
    module = recording_module()
    install_recording_switch(module)
    topk = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(2))
    recorded = []
    for rank in (0, 1):
        state = _state(rank)
        experts = _adapted(state, rank, lambda: all_gather)
        state.set_step_inputs_(16, True)
        experts.forward(topk, module, ep_rank=rank)
        recorded.append(int(state.load.sum()))
    # all-gather: both ranks route the same tokens, rank 0 alone counts them
    assert recorded == ([32, 0] if all_gather else [32, 32])


def test_a_router_the_attach_does_not_know_is_refused():
    state = _state()
    recording = RouterRecording(state, 0, lambda: False)
    with pytest.raises(VllmAscendPluginError, match=r"parameters \['self', 'ids'\]"):
        adapt_router(RouterWithOtherSignature(FakeLayerState()), 0, state, recording, "m")
    with pytest.raises(VllmAscendPluginError, match="has no EPLB layer state"):
        adapt_router(FakeRouter(None), 0, state, recording, "m")
    router = FakeRouter(FakeLayerState())
    assert not hasattr(router, ADAPTED)


# -- weights, with fakes --------------------------------------------------------------------------
@pytest.mark.parametrize("lists", [True, False], ids=["per-expert lists", "stacked"])
def test_w8a8_views_move_each_expert_with_its_scales(lists):
    layer = w8a8_layer([5, 6, 7], lists=lists)
    view = layer_view(layer, 3)
    addresses = view.data_ptrs()
    assert len(view.sections) == 6  # weights, fp32 scales, fused-MC2 int64 scales
    payload = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    view.pack_slot(2, payload)
    view.unpack_slot_(0, payload)
    assert [expert_of(layer, s) for s in range(3)] == [{7}, {6}, {7}]
    assert view.data_ptrs() == addresses


def test_w8a8_without_fused_mc2_and_w4a8_move_what_get_eplb_weight_views_returns():
    layer = w8a8_layer([0, 1], lists=True)
    layer.fused_w1_scale_list = layer.fused_w2_scale_list = None
    assert [s.name for s in layer_view(layer, 2).sections] == ["w13", "w2", "w13_scale", "w2_scale"]

    w4a8 = FakeRoutedExperts(None, AscendFusedMoEMethod(AscendW4A8DynamicFusedMoEMethod()), 2)
    w4a8.w13_weight = torch.randint(-8, 8, (2, 8, 4), dtype=torch.int8)
    w4a8.w2_weight = torch.randint(-8, 8, (2, 2, 8), dtype=torch.int8)
    w4a8.w13_weight_scale, w4a8.w2_weight_scale = torch.rand(2, 4), torch.rand(2, 8)
    w4a8.w13_scale_bias, w4a8.w2_scale_bias = torch.rand(2, 4), torch.rand(2, 8)
    view = layer_view(w4a8, 2)
    assert [s.name for s in view.sections][-2:] == ["w13_scale_bias", "w2_scale_bias"]
    payload = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    bias = w4a8.w13_scale_bias[1].clone()
    view.pack_slot(1, payload)
    view.unpack_slot_(0, payload)
    assert torch.equal(w4a8.w13_scale_bias[0], bias)


def test_weights_the_attach_cannot_move_are_refused_when_the_view_is_built():
    layer = w8a8_layer([0, 1], lists=True)
    with pytest.raises(UnsupportedWeightFormat, match="expected 3 slots"):
        layer_view(layer, 3)
    layer.fused_w2_scale_list = None  # five tensors: the real scheme raises; the view does too
    with pytest.raises(UnsupportedWeightFormat, match="returned 5 tensors"):
        layer_view(layer, 2)
    mixed = w8a8_layer([0, 1], lists=True)
    mixed.w2_weight_list = torch.stack(mixed.w2_weight_list)
    with pytest.raises(UnsupportedWeightFormat, match="some tensors are per-expert lists"):
        layer_view(mixed, 2)
    unknown = FakeRoutedExperts(None, AscendFusedMoEMethod(object()), 2)
    with pytest.raises(UnsupportedWeightFormat, match="moves vllm-ascend's"):
        layer_view(unknown, 2)

"""The vllm-ascend attach end to end on two gloo ranks, with fakes of vllm-ascend's layers.

eplb-graph's controller stands where ``AscendEPLBController`` stands and is driven by Model
Runner V2's call sites (``set_batch_phase``, ``prepare_forward``, ``step``); the routers are fake
vllm-ascend routers adapted to ``map_and_record``; the weights are W8A8 per-expert lists (what
vllm-ascend builds on Model Runner V2 with EPLB) moved by eplb-graph's own movement plane.
"""

from __future__ import annotations

import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

from eplb_graph.integrations import vllm_ascend
from eplb_graph.integrations.vllm_ascend.facts import VllmAscendPluginError
from tests.distributed import run_ranks

NUM_LOGICAL, REDUNDANT, LAYERS, STEPS = 4, 2, 2, 24


def _serve(rank: int, world_size: int, use_async: bool) -> dict:
    from eplb_graph.integrations.vllm_ascend.controller import EplbGraphController, attach_to
    from eplb_graph.integrations.vllm_ascend.routing import install_recording_switch
    from eplb_graph.placement import Placement
    from tests.vllm_ascend_fakes import (
        ASCEND_MARKER,
        FakeLayerState,
        FakeRouter,
        expert_of,
        fake_vllm_config,
        recording_module,
        w8a8_layer,
    )

    per_rank = (NUM_LOGICAL + REDUNDANT) // world_size
    start = Placement.default(LAYERS, NUM_LOGICAL, REDUNDANT, world_size).phy2log
    config = fake_vllm_config(NUM_LOGICAL, REDUNDANT, world_size, use_async)
    controller = EplbGraphController(config.parallel_config, "cpu", None, vllm_config=config)
    layers = []
    for layer in range(LAYERS):
        layer_state = FakeLayerState()
        layer_state.local_expert_start, layer_state.local_expert_count = rank * per_rank, per_rank
        experts = [int(e) for e in start[layer, rank * per_rank : (rank + 1) * per_rank]]
        layers.append(w8a8_layer(experts, lists=True, router=FakeRouter(layer_state)))
    moe = SimpleNamespace(
        num_moe_layers=LAYERS,
        num_logical_experts=NUM_LOGICAL,
        num_redundant_experts=REDUNDANT,
        num_expert_groups=1,
        moe_layers=[SimpleNamespace(routed_experts=layer) for layer in layers],
    )
    model_config = SimpleNamespace(model="fake")
    group = SimpleNamespace(
        rank_in_group=rank, world_size=world_size, ranks=list(range(world_size))
    )
    controller.state = attach_to(
        controller, moe, model_config, group, replicated=lambda: False, ascend_marker=ASCEND_MARKER
    )
    state = controller.state.state
    module = recording_module()
    install_recording_switch(module)
    generator = torch.Generator().manual_seed(rank)
    routed_ok = True
    for _ in range(STEPS):
        controller.set_batch_phase(True)
        controller.prepare_forward(model_config, 24)
        hot = torch.rand(24, 2, generator=generator) < 0.7
        topk = torch.where(hot, 3, torch.randint(0, NUM_LOGICAL, (24, 2), generator=generator))
        for index, layer in enumerate(layers):
            slots = layer.forward(topk, module, rank)
            routed_ok &= bool(torch.equal(state.committed_snapshot()[1][index][slots], topk))
        controller.step()
        controller.step(is_dummy=True)  # a dummy run between steps changes nothing
        if use_async:
            time.sleep(0.02)
    version, phy2log = state.committed_snapshot()
    own = phy2log[:, rank * per_rank : (rank + 1) * per_rank]
    weights_ok = all(
        expert_of(layer, s) == {int(own[index, s])}
        for index, layer in enumerate(layers)
        for s in range(per_rank)
    )
    controller.close()
    return {
        "version": version,
        "phy2log": phy2log.tolist(),
        "weights_ok": weights_ok,
        "routed_ok": routed_ok,
        "steps": controller.state.steps,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_controller_rebalances_vllm_ascend_layers_and_moves_weights_with_scales(use_async):
    results = run_ranks(_serve, 2, use_async, timeout_s=240)
    assert results[0]["phy2log"] == results[1]["phy2log"]
    for result in results:
        assert result["version"] > 0  # rearranged at least once
        assert result["weights_ok"]  # every weight and scale of every slot is its expert's
        assert result["routed_ok"]  # every routed slot held the token's expert
        assert result["steps"] == STEPS  # dummy runs are not steps
    for layer in results[0]["phy2log"]:
        assert layer.count(3) >= 2  # the hot expert got a second replica


# -- install: patches only what vllm-ascend imports, only on request ------------------------------
def test_install_wraps_the_controller_global_once_the_runner_module_is_imported(monkeypatch):
    runner = types.ModuleType(vllm_ascend.RUNNER_MODULE)

    class AscendEPLBController:
        def __init__(self, parallel_config, device, ascend_eplb_config=None):
            self.args = (parallel_config, device, ascend_eplb_config)

    runner.AscendEPLBController = AscendEPLBController
    monkeypatch.setitem(sys.modules, vllm_ascend.RUNNER_MODULE, runner)
    vllm_ascend._after_import(vllm_ascend.RUNNER_MODULE, vllm_ascend._wrap_controller)
    factory = runner.AscendEPLBController
    assert factory is not AscendEPLBController
    vllm_ascend._wrap_controller(runner)  # idempotent
    assert runner.AscendEPLBController is factory

    import vllm.config

    config = SimpleNamespace(additional_config=None)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)
    parallel = SimpleNamespace(enable_eplb=True)
    assert isinstance(factory(parallel, "npu", None), AscendEPLBController)  # not requested
    config.additional_config = {"eplb_graph": {}}
    monkeypatch.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
    monkeypatch.setattr(sys.modules["vllm_ascend"], "__version__", "0.26.0rc1", raising=False)
    with pytest.raises(VllmAscendPluginError, match=r"0\.26\.0rc1 is installed"):
        factory(parallel, "npu", None)


def test_a_module_imported_later_is_patched_right_after_it_runs(tmp_path, monkeypatch):
    (tmp_path / "later_ascend_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    vllm_ascend._after_import("later_ascend_module", lambda module: seen.append(module.VALUE))
    import later_ascend_module  # noqa: F401

    assert seen == [1]
    monkeypatch.delitem(sys.modules, "later_ascend_module")

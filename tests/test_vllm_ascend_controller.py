"""The vllm-ascend attach end to end on two gloo ranks, with fakes of vllm-ascend's layers.

eplb-graph's controller stands where ``AscendEPLBController`` stands and is driven by Model
Runner V2's call sites (``set_batch_phase``, ``prepare_forward``, ``step``); the routers are fake
vllm-ascend routers adapted to ``map_and_record``; the weights are W8A8 per-expert lists (what
vllm-ascend builds on Model Runner V2 with EPLB) moved by eplb-graph's own movement plane.
Serving ends as in vLLM's worker process: the worker's shutdown (wrapped by the attach), then the
distributed environment destroyed.
"""

from __future__ import annotations

import json
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


def _serve(rank: int, world_size: int, use_async: bool, metrics_path: str) -> dict:
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
    config = fake_vllm_config(NUM_LOGICAL, REDUNDANT, world_size, use_async, metrics_path)
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
    closed = _shut_down(controller)
    return {
        "version": version,
        "phy2log": phy2log.tolist(),
        "weights_ok": weights_ok,
        "routed_ok": routed_ok,
        "steps": controller.state.steps,
        **closed,
    }


def _shut_down(controller) -> dict:
    """What vLLM's worker process does at the end: ``worker.shutdown()`` (the pinned release's,
    wrapped by the attach; called twice here, as a second shutdown path may), then the
    distributed environment destroyed, every process group with it."""
    import logging

    import torch.distributed as dist

    from eplb_graph.integrations.vllm.metrics import rank_file
    from tests.vllm_ascend_fakes import FakeModelRunner, NPUWorker

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    lines = Lines()
    runner_logger = logging.getLogger("eplb_graph.integrations.vllm.runner")
    runner_logger.addHandler(lines)
    runner_logger.setLevel(logging.INFO)

    vllm_ascend._wrap_worker_shutdown(sys.modules[NPUWorker.__module__])
    adapter = controller.state
    movement_worker = adapter.runtime.worker
    path = rank_file(adapter.settings.metrics_path, adapter.ep_rank)
    open_before = json.loads(path.read_text())["closed"]
    runner = FakeModelRunner(controller)
    worker = NPUWorker(runner)
    worker.shutdown()
    after_first = path.read_text()
    worker.shutdown()  # a second shutdown closes nothing again
    dist.destroy_process_group()  # vLLM's destroy_distributed_environment, after the worker's
    if movement_worker is not None and movement_worker._thread is not None:
        # close() asked the thread to stop and waited 5 s; on a loaded machine a job still
        # finishing its exchange may take longer. Stopped means it ends, not that it ended
        # within 5 s: a thread nobody stopped would still be alive after this bound.
        movement_worker._thread.join(60)
    return {
        "open_before": open_before,
        "worker_thread": None if movement_worker is None else movement_worker.alive,
        "metrics": json.loads(path.read_text()),
        "rewritten": path.read_text() != after_first,
        "closing_lines": sum(m.startswith("eplb-graph closing on EP rank") for m in lines.messages),
        "runner_shutdowns": runner.shutdowns,
        "groups_destroyed": not dist.is_initialized(),
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each mode served once on 2 gloo ranks (sync, async), for the tests that read it."""
    results: dict[bool, list] = {}

    def serve(use_async: bool) -> list:
        if use_async not in results:
            metrics_path = str(tmp_path_factory.mktemp("metrics"))
            results[use_async] = run_ranks(_serve, 2, use_async, metrics_path, timeout_s=240)
        return results[use_async]

    return serve


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_controller_rebalances_vllm_ascend_layers_and_moves_weights_with_scales(
    use_async, served
):
    results = served(use_async)
    assert results[0]["phy2log"] == results[1]["phy2log"]
    for result in results:
        assert result["version"] > 0  # rearranged at least once
        assert result["weights_ok"]  # every weight and scale of every slot is its expert's
        assert result["routed_ok"]  # every routed slot held the token's expert
        assert result["steps"] == STEPS  # dummy runs are not steps
    for layer in results[0]["phy2log"]:
        assert layer.count(3) >= 2  # the hot expert got a second replica


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_workers_shutdown_closes_the_runtime_once_before_the_groups_go(use_async, served):
    """As on vLLM's CPU runner: the movement thread stopped, the final figures written with
    ``closed: true`` (one closing line, no rewrite on a second shutdown), the runner shut down
    after that, then the process groups destroyed."""
    for rank, result in enumerate(served(use_async)):
        assert result["open_before"] is False  # serving: the file said open
        if use_async:
            assert result["worker_thread"] is False  # started with the runtime, now stopped
        else:
            assert result["worker_thread"] is None  # sync: no thread
        metrics = result["metrics"]
        assert metrics["closed"] is True and metrics["closed_by"] == "worker", metrics
        assert metrics["rank"] == rank and metrics["steps"] == STEPS
        assert metrics["placement_version"] == result["version"]  # the final counts
        assert result["closing_lines"] == 1 and result["rewritten"] is False
        assert result["runner_shutdowns"] == [True, True]  # vllm-ascend's own shutdown still ran
        assert result["groups_destroyed"]


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

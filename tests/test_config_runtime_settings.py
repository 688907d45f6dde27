"""From a host's configuration to the core's settings: every validated field is consumed."""

from __future__ import annotations

import ast
from pathlib import Path

import eplb_graph
from eplb_graph import Placement, RuntimeSettings
from eplb_graph.control import CollectionPhase
from eplb_graph.integrations.settings.runtime_settings import settings_from_legacy, settings_from_v2
from tests.config_helpers import control, legacy, raises, resolve, write_map

ROOT = Path(__file__).resolve().parents[1]
#: The library core: it takes plain settings and must not know any host's vocabulary.
CORE = (
    "control",
    "movement",
    "policy",
    "runtime.py",
    "settings.py",
    "placement.py",
    "state.py",
    "expert_map.py",
)


def test_settings_from_v2_config_cap_the_window_at_the_interval():
    config = eplb_graph.EplbConfig(
        window_size=500, step_interval=200, policy="default", load_collection_phase="decode"
    )
    settings = settings_from_v2(
        config, num_experts=8, ep_size=2, num_layers=None, num_groups=4, num_nodes=2
    )
    assert settings.effective_window_size == 200
    assert settings.load_collection_phase is CollectionPhase.DECODE
    assert (settings.num_groups, settings.num_nodes) == (4, 2)


def test_settings_from_a_legacy_config_follow_its_collection_cycle():
    legacy_config = eplb_graph.LegacyEplbConfig(
        dynamic_eplb=True,
        expert_heat_collection_interval=400,
        algorithm_execution_interval=50,
        eplb_policy_type=1,
        eplb_heat_collection_stage="decode",
    )
    settings = settings_from_legacy(legacy_config, None, num_experts=8, ep_size=2, num_layers=1)
    assert (settings.window_size, settings.step_interval) == (400, 450)
    assert settings.policy == "default"
    assert settings.load_collection_phase is CollectionPhase.DECODE
    assert settings.rebalances and settings.initial_placement == Placement.default(1, 8, 0, 2)
    static = settings_from_legacy(
        eplb_graph.LegacyEplbConfig(), None, num_experts=8, ep_size=2, num_layers=1
    )
    assert not static.rebalances  # a static map is served as loaded: no runtime


def test_v2_runtime_settings_consume_every_field():
    settings = resolve(
        enable_eplb=True,
        eplb_config={
            "window_size": 40,
            "step_interval": 50,
            "num_redundant_experts": 16,
            "log_balancedness": True,
            "log_balancedness_interval": 5,
            "use_async": False,
            "policy": "flash_lb",
            "communicator": "torch_gloo",
        },
        additional_config={"eplb_config": {"load_collection_phase": "prefill"}},
        num_layers=3,
        num_groups=8,
        num_nodes=2,
        time_samples=4,
    )
    assert control(settings) == control(
        RuntimeSettings(
            window_size=40,
            step_interval=50,
            load_collection_phase=CollectionPhase.PREFILL,
            policy="flash_lb",
            num_groups=8,
            num_nodes=2,
            log_balancedness=True,
            log_balancedness_interval=5,
            time_samples=4,
        )
    )
    assert settings.rebalances and settings.use_async is False
    assert settings.record_map_path is None and settings.communicator == "torch_gloo"
    assert settings.initial_placement == Placement.default(3, 64, 16, 4)


def test_v2_automatic_communicator_is_gloo_staging():
    settings = resolve(enable_eplb=True, num_layers=1)
    assert settings.communicator == "torch_gloo" and settings.use_async


def test_legacy_dynamic_runtime_settings_follow_the_cycle():
    settings = resolve(
        additional_config=legacy(
            dynamic_eplb=True,
            expert_heat_collection_interval=100,
            algorithm_execution_interval=20,
            eplb_policy_type=3,
            num_redundant_experts=4,
            eplb_heat_collection_stage="decode",
        ),
        num_layers=2,
    )
    assert (settings.window_size, settings.step_interval) == (100, 120)
    assert settings.policy == "flash_lb"
    assert settings.load_collection_phase is CollectionPhase.DECODE
    assert settings.use_async and settings.record_map_path is None
    assert settings.initial_placement == Placement.default(2, 64, 4, 4)


def test_legacy_record_mode_passes_the_record_path(tmp_path):
    target = str(tmp_path / "record.json")
    settings = resolve(additional_config=legacy(expert_map_record_path=target), num_layers=1)
    assert settings.record_map_path == target and settings.use_async and settings.rebalances


def test_legacy_map_is_the_initial_placement(tmp_path):
    rotated = [*range(4, 64), *range(4), *range(30, 34)]
    placement = Placement.default(2, 64, 4, 4).with_layer(0, rotated)
    path = write_map(tmp_path / "map.json", placement)
    static = resolve(additional_config=legacy(expert_map_path=path), num_layers=2)
    assert static.initial_placement == placement and not static.rebalances
    dynamic = resolve(
        additional_config=legacy(expert_map_path=path, dynamic_eplb=True), num_layers=2
    )
    assert dynamic.initial_placement == placement and dynamic.rebalances
    with raises("expert_map_path", "the map has 2 MoE layers but the model has 3"):
        resolve(additional_config=legacy(expert_map_path=path), num_layers=3)


def test_disabled_eplb_has_no_runtime_settings():
    assert resolve(num_layers=1) is None


def _core_modules():
    package = ROOT / "eplb_graph"
    for name in CORE:
        path = package / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_core_modules_do_not_import_the_integration_layer():
    offenders = []
    for path in _core_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if name.startswith("eplb_graph.integrations")
            ]
    assert offenders == []

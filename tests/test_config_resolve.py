"""Resolution: which configuration world a run uses, and the checks that need context."""

from __future__ import annotations

import logging

import pytest

from eplb_graph import Placement, RuntimeSettings
from eplb_graph.integrations.settings import EplbConfig, LegacyEplbConfig, known_policy_names
from tests.config_helpers import NAMES, control, legacy, raises, resolve, write_map


def test_resolve_v2_happy_path_isolated_from_legacy():
    resolved = resolve(
        enable_eplb=True,
        eplb_config={"window_size": 50, "step_interval": 50, "num_redundant_experts": 16},
        additional_config={"eplb_config": {"load_collection_phase": "prefill"}, "other": 1},
    )
    assert control(resolved) == control(
        RuntimeSettings(
            window_size=50, step_interval=50, load_collection_phase="prefill", policy="default"
        )
    )
    assert resolved.num_physical_experts == 80 and resolved.record_map_path is None
    assert resolved.initial_placement is None  # no layer count given: no model yet


def test_resolve_v2_with_defaults_only():
    resolved = resolve(enable_eplb=True, num_layers=2)
    defaults = EplbConfig()
    assert control(resolved) == control(
        RuntimeSettings(window_size=defaults.window_size, step_interval=defaults.step_interval)
    )
    assert resolved.num_redundant_experts == 0 and resolved.use_async
    assert resolved.initial_placement == Placement.default(2, 64, 0, 4)


def test_resolve_v2_unknown_policy_is_rejected_with_suggestion():
    with raises("eplb_config.policy", r"unknown policy 'swift_balnce' \(did you mean"):
        resolve(enable_eplb=True, eplb_config={"policy": "swift_balnce"})
    with raises("eplb_config.policy", "choose one of: default, mine"):
        resolve(
            enable_eplb=True, eplb_config={"policy": "flash_lb"}, policy_names=["default", "mine"]
        )


def test_policy_names_come_from_the_registry():
    import eplb_graph.policy as policy

    assert known_policy_names() == tuple(policy.policy_names())
    assert known_policy_names(["x"]) == ("x",)


def test_policy_names_are_read_from_the_registry_at_call_time(monkeypatch):
    """A policy registered after import is accepted; nothing keeps a copy of the names."""
    from eplb_graph.policy import registry

    monkeypatch.setitem(registry._POLICIES, "late_policy", registry.get_policy("default"))
    assert "late_policy" in known_policy_names()
    resolved = resolve(enable_eplb=True, eplb_config={"policy": "late_policy"}, policy_names=None)
    assert resolved.policy == "late_policy"


@pytest.mark.parametrize("policy", NAMES)
def test_resolve_v2_async_is_accepted_with_every_policy(policy):
    resolved = resolve(enable_eplb=True, eplb_config={"use_async": True, "policy": policy})
    assert resolved.use_async and resolved.policy == policy


@pytest.mark.parametrize("ep_size", [1, 0])
def test_resolve_v2_rejects_no_expert_parallelism(ep_size):
    with raises("ep_size", "EPLB needs expert parallelism: ep_size must be > 1"):
        resolve(enable_eplb=True, ep_size=ep_size)


def test_resolve_rejects_bad_model_sizes():
    with raises("ep_size", "must be an integer, got true"):
        resolve(enable_eplb=True, ep_size=True)
    with raises("num_experts", "must be an integer >= 1, got 0"):
        resolve(enable_eplb=True, num_experts=0)


def test_resolve_model_sizes_have_documented_maxima():
    resolve(enable_eplb=True, num_experts=2**16, ep_size=2**16)
    with raises("num_experts", "must be <= 65536, got 65537"):
        resolve(enable_eplb=True, num_experts=2**16 + 1)
    with raises("ep_size", "must be <= 65536, got 65537"):
        resolve(enable_eplb=True, num_experts=2**16, ep_size=2**16 + 1)
    with raises("ep_size", "must be > 1, got -an integer of 16610 bits"):
        resolve(enable_eplb=True, ep_size=-(10**5000))


def test_resolve_v2_slots_must_divide_over_ep_ranks():
    with raises(
        "eplb_config.num_redundant_experts",
        r"64 \+ 3 = 67 is not divisible by ep_size=4 .*set num_redundant_experts to 0 or 4",
    ):
        resolve(enable_eplb=True, eplb_config={"num_redundant_experts": 3})
    with raises("eplb_config.num_redundant_experts", r"set num_redundant_experts to 2$"):
        resolve(enable_eplb=True, num_experts=6, eplb_config={})


def test_resolve_v2_window_larger_than_interval_is_capped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="eplb_graph.integrations.settings.resolve"):
        resolved = resolve(enable_eplb=True, eplb_config={"window_size": 500, "step_interval": 100})
    assert (resolved.window_size, resolved.step_interval) == (100, 100)
    assert "window_size=500 exceeds step_interval=100" in caplog.text
    assert EplbConfig(window_size=10, step_interval=100).effective_window_size == 10


def test_resolve_v2_field_under_additional_config_points_to_eplb_config():
    with raises(
        "additional_config.eplb_config.window_size",
        "EPLBConfig fields are not accepted in additional_config; pass --eplb-config.window_size",
    ):
        resolve(enable_eplb=True, additional_config=legacy(window_size=10))


def test_resolve_unknown_key_under_additional_config_eplb_config():
    with raises(
        "additional_config.eplb_config.load_colection_phase",
        r"unknown key \(did you mean 'load_collection_phase'\?\)",
    ):
        resolve(enable_eplb=True, additional_config=legacy(load_colection_phase="all"))


def test_resolve_mixing_enable_eplb_with_legacy_key_names_both():
    with raises(
        "additional_config.eplb_config.dynamic_eplb",
        r"legacy \(V1\) EPLB key cannot be combined with --enable-eplb \(V2\)",
    ):
        resolve(enable_eplb=True, additional_config=legacy(dynamic_eplb=True))
    with raises(
        "additional_config.eplb_config.num_redundant_experts",
        "--enable-eplb.*--eplb-config.num_redundant_experts",
    ):
        resolve(enable_eplb=True, additional_config=legacy(num_redundant_experts=4))


def test_resolve_mixing_eplb_config_with_top_level_legacy_key_names_both():
    with raises(
        "additional_config.expert_map_path",
        r"cannot be combined with --eplb-config.window_size \(V2\); V2 has no static map",
    ):
        resolve(eplb_config={"window_size": 5}, additional_config={"expert_map_path": "m.json"})


@pytest.mark.parametrize("flag", ["DYNAMIC_EPLB", "EXPERT_MAP_RECORD"])
def test_resolve_legacy_environment_switch_with_v2_is_rejected(flag):
    with raises(flag, rf"environment variable {flag} is a legacy .* --enable-eplb .*unset it"):
        resolve(enable_eplb=True, environ={flag: "true"})
    assert resolve(enable_eplb=True, environ={flag: "false"}).rebalances


def test_resolve_eplb_config_without_enable_eplb_is_rejected():
    with raises("eplb_config.window_size", "is set but EPLB is disabled; add --enable-eplb"):
        resolve(eplb_config={"window_size": 5})


def test_resolve_load_collection_phase_requires_enable_eplb():
    with raises("additional_config.eplb_config.load_collection_phase", "requires --enable-eplb"):
        resolve(additional_config=legacy(load_collection_phase="decode"))
    assert resolve(additional_config=legacy(load_collection_phase="all")) is None


def test_resolve_load_collection_phase_with_legacy_keys_points_to_heat_stage():
    with raises(
        "additional_config.eplb_config.load_collection_phase", "eplb_heat_collection_stage"
    ):
        resolve(additional_config=legacy(load_collection_phase="prefill", dynamic_eplb=True))


def test_resolve_load_collection_phase_value_is_checked():
    with raises("additional_config.eplb_config.load_collection_phase", "must be one of"):
        resolve(enable_eplb=True, additional_config=legacy(load_collection_phase="mixed"))


def test_resolve_rejects_non_mapping_inputs():
    with raises("enable_eplb", "expected true or false, got 1"):
        resolve(enable_eplb=1)
    with raises("eplb_config", "expected a JSON object"):
        resolve(enable_eplb=True, eplb_config=["window_size"])
    with raises("additional_config", "expected a JSON object"):
        resolve(additional_config="{}")
    with raises("additional_config.eplb_config", "expected a JSON object"):
        resolve(additional_config={"eplb_config": 3})


def test_resolve_disabled_ignores_model_sizes_and_unrelated_keys():
    assert resolve(ep_size=1, num_experts=3, additional_config={"ascend_scheduler": {}}) is None
    assert resolve(additional_config=legacy(dynamic_eplb=False)) is None


def test_resolve_legacy_dynamic_happy_path():
    resolved = resolve(
        additional_config=legacy(
            dynamic_eplb=True,
            expert_heat_collection_interval=100,
            algorithm_execution_interval=20,
            eplb_policy_type=2,
            num_redundant_experts=16,
            eplb_heat_collection_stage="prefill",
        )
    )
    # The legacy world's cycle: collect 100 steps, then 20 for the policy.
    assert control(resolved) == control(
        RuntimeSettings(
            window_size=100,
            step_interval=120,
            load_collection_phase="prefill",
            policy="swift_balance",
        )
    )
    assert resolved.num_physical_experts == 80 and resolved.record_map_path is None


def test_legacy_policy_type_must_select_a_registered_policy():
    with raises(
        "additional_config.eplb_config.eplb_policy_type",
        "selects policy 'swift_balance', which is not registered",
    ):
        resolve(additional_config=legacy(dynamic_eplb=True), policy_names=["default"])


def test_legacy_keys_without_enabling_are_rejected():
    with raises(
        "additional_config.eplb_config.num_redundant_experts",
        "is set but legacy EPLB is off; set dynamic_eplb: true",
    ):
        resolve(additional_config=legacy(dynamic_eplb=False, num_redundant_experts=4))


def test_legacy_top_level_spelling_is_accepted_and_named_in_errors():
    resolved = resolve(additional_config={"dynamic_eplb": True, "num_redundant_experts": 4})
    assert resolved.rebalances and resolved.num_redundant_experts == 4
    assert resolved.step_interval == 650  # the legacy cycle's defaults: 600 + 50
    with raises("additional_config.algorithm_execution_interval", "must be >= 1, got 0"):
        resolve(additional_config={"dynamic_eplb": True, "algorithm_execution_interval": 0})


def test_legacy_key_in_both_spellings_is_ambiguous():
    with raises("additional_config.dynamic_eplb", "also given as additional_config.eplb_config"):
        resolve(additional_config={"dynamic_eplb": True, "eplb_config": {"dynamic_eplb": True}})


def test_legacy_needs_expert_parallelism_and_divisible_slots():
    with raises("ep_size", "EPLB needs expert parallelism"):
        resolve(additional_config=legacy(dynamic_eplb=True), ep_size=1)
    with raises("additional_config.eplb_config.num_redundant_experts", "not divisible by ep_size"):
        resolve(additional_config=legacy(dynamic_eplb=True, num_redundant_experts=1))


def test_legacy_record_path_forces_dynamic_on(tmp_path, caplog):
    target = str(tmp_path / "record.json")
    resolved = resolve(additional_config=legacy(expert_map_record_path=target))
    assert resolved.rebalances and resolved.record_map_path == target
    with caplog.at_level(logging.WARNING, logger="eplb_graph.integrations.settings.resolve"):
        resolved = resolve(
            additional_config=legacy(dynamic_eplb=False, expert_map_record_path=target)
        )
    assert resolved.rebalances and "forces dynamic_eplb on" in caplog.text
    assert LegacyEplbConfig(expert_map_record_path=target).dynamic_eplb


def test_legacy_static_map_is_loaded_and_sets_redundancy(tmp_path):
    placement = Placement.default(2, 64, 4, 4)
    path = write_map(tmp_path / "map.json", placement)
    resolved = resolve(additional_config=legacy(expert_map_path=path))
    assert not resolved.rebalances and resolved.initial_placement == placement
    assert resolved.num_redundant_experts == 4
    resolved = resolve(additional_config=legacy(expert_map_path=path, num_redundant_experts=4))
    assert resolved.num_redundant_experts == 4


def test_legacy_static_map_content_is_validated_at_init(tmp_path):
    field = "additional_config.eplb_config.expert_map_path"
    path = tmp_path / "map.json"
    path.write_text('{"moe_layer_count": 1, "layer_list": [}')
    with raises(field, r"invalid expert map: .*malformed JSON at line 1"):
        resolve(additional_config=legacy(expert_map_path=str(path)))
    write_map(path, Placement.default(1, 64, 0, 4))
    with raises(field, r"invalid expert map: .*N=65 logical experts but a layer has only 64 slots"):
        resolve(additional_config=legacy(expert_map_path=str(path)), num_experts=65)


def test_legacy_static_map_must_match_ep_size_and_redundancy(tmp_path):
    path = write_map(tmp_path / "map.json", Placement.default(1, 64, 8, 8))
    with raises(
        "additional_config.eplb_config.expert_map_path", "places experts on 8 devices but ep_size=4"
    ):
        resolve(additional_config=legacy(expert_map_path=path))
    with raises(
        "additional_config.eplb_config.num_redundant_experts",
        "conflicting redundant expert counts: 16 here but the map .* has 8",
    ):
        resolve(additional_config=legacy(expert_map_path=path, num_redundant_experts=16), ep_size=8)

"""EPLB configuration rules: every rule asserts its message and the offending field."""

from __future__ import annotations

import json
import logging
import pickle
import sys
from typing import Any

import pytest

from eplb_graph import Placement
from eplb_graph.config import (
    FALLBACK_POLICY_NAMES,
    LEGACY_POLICY_TYPES,
    ConfigError,
    EplbConfig,
    EplbPath,
    LegacyEplbConfig,
    ResolvedEplbConfig,
    known_policy_names,
    parse_cli_args,
    resolve_eplb_config,
)

NAMES = FALLBACK_POLICY_NAMES


def resolve(**overrides: Any) -> ResolvedEplbConfig:
    """resolve_eplb_config with a fixed policy list and an empty environment (hermetic)."""
    arguments: dict[str, Any] = {
        "enable_eplb": False,
        "eplb_config": None,
        "additional_config": None,
        "num_experts": 64,
        "ep_size": 4,
        "policy_names": NAMES,
        "environ": {},
    }
    arguments.update(overrides)
    return resolve_eplb_config(**arguments)


def raises(field: str, match: str):
    """pytest.raises(ConfigError) that also pins the error's field."""

    class _Check:
        def __enter__(self):
            self._context = pytest.raises(ConfigError, match=match)
            self.info = self._context.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self._context.__exit__(*exc)
            assert self.info.value.field == field, self.info.value
            assert str(self.info.value).startswith(f"{field}: ")
            return suppressed

    return _Check()


def legacy(**keys: Any) -> dict[str, Any]:
    return {"eplb_config": keys}


# -- ConfigError ---------------------------------------------------------------------------------
def test_config_error_is_a_value_error_with_field_and_pickles():
    error = ConfigError("eplb_config.window_size", "must be >= 1, got 0")
    assert isinstance(error, ValueError)
    assert str(error) == "eplb_config.window_size: must be >= 1, got 0"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.field, copy.reason, str(copy)) == (error.field, error.reason, str(error))


# -- EplbConfig (V2) -----------------------------------------------------------------------------
def test_v2_defaults_match_upstream_eplbconfig():
    config = EplbConfig()
    assert (config.window_size, config.step_interval, config.num_redundant_experts) == (
        1000,
        3000,
        0,
    )
    assert (config.log_balancedness, config.log_balancedness_interval) == (False, 1)
    assert (config.use_async, config.policy, config.communicator) == (True, "default", None)
    assert config.load_collection_phase == "all"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("window_size", 0),
        ("step_interval", 0),
        ("num_redundant_experts", -1),
        ("log_balancedness_interval", 0),
    ],
)
def test_v2_numeric_ranges(key, value):
    minimum = 0 if key == "num_redundant_experts" else 1
    with raises(f"eplb_config.{key}", rf"must be >= {minimum}, got {value}"):
        EplbConfig(**{key: value})


def test_v2_bool_is_not_an_integer_and_integer_is_not_a_bool():
    with raises("eplb_config.window_size", r"expected an integer, got true \(boolean\)"):
        EplbConfig(window_size=True)
    with raises("eplb_config.window_size", r"expected an integer, got 1\.5 \(number\)"):
        EplbConfig(window_size=1.5)
    with raises("eplb_config.use_async", r"expected true or false, got 1 \(integer\)"):
        EplbConfig(use_async=1)


def test_v2_policy_must_be_a_non_empty_string():
    with raises("eplb_config.policy", "expected a string, got 3"):
        EplbConfig(policy=3)
    with raises("eplb_config.policy", "must be a non-empty policy name"):
        EplbConfig(policy="")


def test_v2_communicator_only_gloo_staging():
    assert EplbConfig(communicator="torch_gloo").communicator == "torch_gloo"
    with raises("eplb_config.communicator", r"must be one of null, 'torch_gloo', got 'torch_nccl'"):
        EplbConfig(communicator="torch_nccl")


def test_v2_load_collection_phase_choices():
    with raises("eplb_config.load_collection_phase", "must be one of 'all', 'prefill', 'decode'"):
        EplbConfig(load_collection_phase="both")


def test_v2_null_for_required_field_is_rejected():
    with raises("eplb_config.window_size", "expected an integer, got null; omit it"):
        EplbConfig.from_mapping({"window_size": None})


def test_v2_unknown_field_is_named_with_a_suggestion():
    with raises("eplb_config.windw_size", r"unknown EPLBConfig field \(did you mean 'window_size'"):
        EplbConfig.from_mapping({"windw_size": 10})


def test_v2_load_collection_phase_is_not_an_eplb_config_key():
    with raises("eplb_config.load_collection_phase", "--additional-config"):
        EplbConfig.from_mapping({"load_collection_phase": "prefill"})


def test_v2_legacy_key_in_eplb_config_points_to_the_v2_spelling():
    with raises("eplb_config.dynamic_eplb", "legacy additional_config key; V2 is switched on by"):
        EplbConfig.from_mapping({"dynamic_eplb": True})
    with raises("eplb_config.eplb_policy_type", "--eplb-config.policy"):
        EplbConfig.from_mapping({"eplb_policy_type": 2})


def test_v2_json_values_are_not_guessed_from_strings():
    with raises("eplb_config.window_size", "expected an integer, got '100'"):
        EplbConfig.from_mapping({"window_size": "100"})


# -- resolve: V2 ---------------------------------------------------------------------------------
def test_resolve_v2_happy_path_isolated_from_legacy():
    resolved = resolve(
        enable_eplb=True,
        eplb_config={"window_size": 50, "step_interval": 50, "num_redundant_experts": 16},
        additional_config={"eplb_config": {"load_collection_phase": "prefill"}, "other": 1},
    )
    assert resolved.path is EplbPath.V2 and resolved.enabled
    assert resolved.legacy is None and resolved.expert_map is None
    assert resolved.v2 == EplbConfig(
        window_size=50, step_interval=50, num_redundant_experts=16, load_collection_phase="prefill"
    )
    assert (resolved.num_physical_experts, resolved.policy) == (80, "default")


def test_resolve_v2_with_defaults_only():
    resolved = resolve(enable_eplb=True)
    assert resolved.v2 == EplbConfig() and resolved.num_redundant_experts == 0


def test_resolve_v2_unknown_policy_is_rejected_with_suggestion():
    with raises("eplb_config.policy", r"unknown policy 'swift_balnce' \(did you mean"):
        resolve(enable_eplb=True, eplb_config={"policy": "swift_balnce"})
    with raises("eplb_config.policy", "choose one of: default, mine"):
        resolve(
            enable_eplb=True, eplb_config={"policy": "flash_lb"}, policy_names=["default", "mine"]
        )


def test_policy_names_come_from_the_registry_when_importable():
    import eplb_graph.policy as policy

    assert known_policy_names() == tuple(policy.policy_names()) or not policy.policy_names()
    assert known_policy_names(["x"]) == ("x",)


def test_policy_names_fall_back_when_the_registry_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "eplb_graph.policy", None)  # makes the import fail
    assert known_policy_names() == FALLBACK_POLICY_NAMES
    resolved = resolve(enable_eplb=True, eplb_config={"policy": "churn_aware"}, policy_names=None)
    assert resolved.policy == "churn_aware"


@pytest.mark.parametrize("policy", NAMES)
def test_resolve_v2_async_is_accepted_with_every_policy(policy):
    resolved = resolve(enable_eplb=True, eplb_config={"use_async": True, "policy": policy})
    assert resolved.v2.use_async and resolved.policy == policy


@pytest.mark.parametrize("ep_size", [1, 0])
def test_resolve_v2_rejects_no_expert_parallelism(ep_size):
    with raises("ep_size", "EPLB needs expert parallelism: ep_size must be > 1"):
        resolve(enable_eplb=True, ep_size=ep_size)


def test_resolve_rejects_bad_model_sizes():
    with raises("ep_size", "must be an integer, got true"):
        resolve(enable_eplb=True, ep_size=True)
    with raises("num_experts", "must be an integer >= 1, got 0"):
        resolve(enable_eplb=True, num_experts=0)


def test_resolve_v2_slots_must_divide_over_ep_ranks():
    with raises(
        "eplb_config.num_redundant_experts",
        r"64 \+ 3 = 67 is not divisible by ep_size=4 .*set num_redundant_experts to 0 or 4",
    ):
        resolve(enable_eplb=True, eplb_config={"num_redundant_experts": 3})
    with raises("eplb_config.num_redundant_experts", r"set num_redundant_experts to 2$"):
        resolve(enable_eplb=True, num_experts=6, eplb_config={})


def test_resolve_v2_window_larger_than_interval_is_capped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="eplb_graph.config"):
        resolved = resolve(enable_eplb=True, eplb_config={"window_size": 500, "step_interval": 100})
    assert resolved.v2.window_size == 500 and resolved.v2.effective_window_size == 100
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
    assert resolve(enable_eplb=True, environ={flag: "false"}).path is EplbPath.V2


def test_resolve_eplb_config_without_enable_eplb_is_rejected():
    with raises("eplb_config.window_size", "is set but EPLB is disabled; add --enable-eplb"):
        resolve(eplb_config={"window_size": 5})


def test_resolve_load_collection_phase_requires_enable_eplb():
    with raises("additional_config.eplb_config.load_collection_phase", "requires --enable-eplb"):
        resolve(additional_config=legacy(load_collection_phase="decode"))
    assert resolve(additional_config=legacy(load_collection_phase="all")).path is EplbPath.DISABLED


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


# -- resolve: disabled ---------------------------------------------------------------------------
def test_resolve_disabled_ignores_model_sizes_and_unrelated_keys():
    resolved = resolve(ep_size=1, num_experts=3, additional_config={"ascend_scheduler": {}})
    assert resolved.path is EplbPath.DISABLED and not resolved.enabled
    assert (resolved.v2, resolved.legacy, resolved.policy, resolved.num_redundant_experts) == (
        None,
        None,
        None,
        0,
    )
    assert resolve(additional_config=legacy(dynamic_eplb=False)).path is EplbPath.DISABLED


def test_resolved_config_carries_only_its_own_path():
    with pytest.raises(ValueError, match="must carry only its config"):
        ResolvedEplbConfig(EplbPath.V2, 8, 2, v2=EplbConfig(), legacy=LegacyEplbConfig())
    with pytest.raises(ValueError, match="must carry only its config"):
        ResolvedEplbConfig(EplbPath.DISABLED, 8, 2, v2=EplbConfig())


# -- resolve: legacy -----------------------------------------------------------------------------
def test_legacy_defaults_match_vllm_ascend():
    config = LegacyEplbConfig()
    assert (config.dynamic_eplb, config.expert_heat_collection_interval) == (False, 600)
    assert (config.algorithm_execution_interval, config.eplb_policy_type) == (50, 2)
    assert (config.num_redundant_experts, config.eplb_heat_collection_stage) == (0, "all")
    assert (config.expert_map_path, config.expert_map_record_path) == (None, None)
    assert (config.mode, config.enabled) == ("off", False)


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
    assert resolved.path is EplbPath.LEGACY and resolved.v2 is None
    assert resolved.legacy.mode == "dynamic" and resolved.policy == "swift_balance"
    assert resolved.num_physical_experts == 80


@pytest.mark.parametrize(("policy_type", "name"), sorted(LEGACY_POLICY_TYPES.items()))
def test_legacy_policy_type_maps_to_registered_names(policy_type, name):
    config = resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=policy_type))
    assert config.policy == name


def test_legacy_policy_type_mapping_is_vllm_ascends():
    assert LEGACY_POLICY_TYPES == {0: "random", 1: "default", 2: "swift_balance", 3: "flash_lb"}


def test_legacy_policy_type_range_and_type():
    with raises("additional_config.eplb_config.eplb_policy_type", r"0 \(random\).*got 4"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=4))
    with raises("additional_config.eplb_config.eplb_policy_type", "expected an integer, got true"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=True))


def test_legacy_policy_type_must_select_a_registered_policy():
    with raises(
        "additional_config.eplb_config.eplb_policy_type",
        "selects policy 'swift_balance', which is not registered",
    ):
        resolve(additional_config=legacy(dynamic_eplb=True), policy_names=["default"])


@pytest.mark.parametrize(
    ("key", "value", "minimum"),
    [
        ("expert_heat_collection_interval", 0, 1),
        ("algorithm_execution_interval", 0, 1),
        ("num_redundant_experts", -2, 0),
    ],
)
def test_legacy_numeric_ranges(key, value, minimum):
    with raises(f"additional_config.eplb_config.{key}", f"must be >= {minimum}, got {value}"):
        resolve(additional_config=legacy(dynamic_eplb=True, **{key: value}))


def test_legacy_types_are_checked():
    with raises("additional_config.eplb_config.dynamic_eplb", "expected true or false, got 'true'"):
        resolve(additional_config=legacy(dynamic_eplb="true"))
    with raises(
        "additional_config.eplb_config.expert_heat_collection_interval", "expected an integer"
    ):
        resolve(additional_config=legacy(dynamic_eplb=True, expert_heat_collection_interval="600"))


def test_legacy_heat_collection_stage_choices():
    with raises("additional_config.eplb_config.eplb_heat_collection_stage", "must be one of 'all'"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_heat_collection_stage="both"))


def test_legacy_keys_without_enabling_are_rejected():
    with raises(
        "additional_config.eplb_config.num_redundant_experts",
        "is set but legacy EPLB is off; set dynamic_eplb: true",
    ):
        resolve(additional_config=legacy(dynamic_eplb=False, num_redundant_experts=4))


def test_legacy_top_level_spelling_is_accepted_and_named_in_errors():
    resolved = resolve(additional_config={"dynamic_eplb": True, "num_redundant_experts": 4})
    assert resolved.path is EplbPath.LEGACY and resolved.num_redundant_experts == 4
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
    assert resolved.legacy.dynamic_eplb and resolved.legacy.mode == "record"
    with caplog.at_level(logging.WARNING, logger="eplb_graph.config"):
        resolved = resolve(
            additional_config=legacy(dynamic_eplb=False, expert_map_record_path=target)
        )
    assert resolved.legacy.dynamic_eplb and "forces dynamic_eplb on" in caplog.text
    assert LegacyEplbConfig(expert_map_record_path=target).dynamic_eplb


def test_legacy_record_path_rules(tmp_path):
    field = "additional_config.eplb_config.expert_map_record_path"
    with raises(field, r"must end in \.json"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "map.txt")))
    with raises(field, "must be a non-empty path"):
        resolve(additional_config=legacy(expert_map_record_path=" "))
    with raises(field, "does not exist; create it first"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "no/map.json")))
    (tmp_path / "dir.json").mkdir()
    with raises(field, "is a directory"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "dir.json")))


def test_legacy_record_directory_must_be_writable(tmp_path, monkeypatch):
    monkeypatch.setattr("eplb_graph.config.os.access", lambda *_args: False)
    with raises("additional_config.eplb_config.expert_map_record_path", "is not writable"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "m.json")))


def _write_map(path, placement: Placement) -> str:
    placement.save_expert_map(path)
    return str(path)


def test_legacy_static_map_is_loaded_and_sets_redundancy(tmp_path):
    placement = Placement.default(2, 64, 4, 4)
    path = _write_map(tmp_path / "map.json", placement)
    resolved = resolve(additional_config=legacy(expert_map_path=path))
    assert resolved.legacy.mode == "static" and resolved.expert_map == placement
    assert resolved.num_redundant_experts == 4 and resolved.policy == "swift_balance"
    resolved = resolve(additional_config=legacy(expert_map_path=path, num_redundant_experts=4))
    assert resolved.legacy.num_redundant_experts == 4


def test_legacy_static_map_path_rules(tmp_path, monkeypatch):
    field = "additional_config.eplb_config.expert_map_path"
    with raises(field, r"must end in \.json .*got 'map\.yaml'"):
        resolve(additional_config=legacy(expert_map_path="map.yaml"))
    with raises(field, "does not exist; record a map first or fix the path"):
        resolve(additional_config=legacy(expert_map_path=str(tmp_path / "missing.json")))
    (tmp_path / "dir.json").mkdir()
    with raises(field, "is not a regular file"):
        resolve(additional_config=legacy(expert_map_path=str(tmp_path / "dir.json")))
    path = _write_map(tmp_path / "map.json", Placement.default(1, 64, 0, 4))
    monkeypatch.setattr("eplb_graph.config.os.access", lambda *_args: False)
    with raises(field, "is not readable"):
        resolve(additional_config=legacy(expert_map_path=path))


def test_legacy_static_map_content_is_validated_at_init(tmp_path):
    field = "additional_config.eplb_config.expert_map_path"
    path = tmp_path / "map.json"
    path.write_text('{"moe_layer_count": 1, "layer_list": [}')
    with raises(field, r"invalid expert map: .*malformed JSON at line 1"):
        resolve(additional_config=legacy(expert_map_path=str(path)))
    _write_map(path, Placement.default(1, 64, 0, 4))
    with raises(field, r"invalid expert map: .*logical expert 64 is on no device"):
        resolve(additional_config=legacy(expert_map_path=str(path)), num_experts=65)


def test_legacy_static_map_must_match_ep_size_and_redundancy(tmp_path):
    path = _write_map(tmp_path / "map.json", Placement.default(1, 64, 8, 8))
    with raises(
        "additional_config.eplb_config.expert_map_path", "places experts on 8 devices but ep_size=4"
    ):
        resolve(additional_config=legacy(expert_map_path=path))
    with raises(
        "additional_config.eplb_config.num_redundant_experts",
        "conflicting redundant expert counts: 16 here but the map .* has 8",
    ):
        resolve(additional_config=legacy(expert_map_path=path, num_redundant_experts=16), ep_size=8)


# -- parse_cli_args --------------------------------------------------------------------------------
def test_parse_dotted_keys_with_space_and_equals():
    args = parse_cli_args(
        [
            "serve",
            "model",
            "--enable-eplb",
            "--eplb-config.window_size",
            "50",
            "--eplb-config.step_interval=60",
            "--eplb-config.use_async",
            "false",
            "--eplb-config.log-balancedness=TRUE",
            "--tensor-parallel-size",
            "16",
        ]
    )
    assert args.enable_eplb
    assert args.eplb_config == {
        "window_size": 50,
        "step_interval": 60,
        "use_async": False,
        "log_balancedness": True,
    }
    assert args.rest == ("serve", "model", "--tensor-parallel-size", "16")


def test_parse_json_eplb_config_and_additional_config():
    args = parse_cli_args(
        [
            "--enable_eplb",
            "--eplb-config",
            '{"window_size": 100, "policy": "default"}',
            "--additional-config",
            '{"eplb_config": {"load_collection_phase": "prefill"}, "other": true}',
        ]
    )
    assert args.eplb_config == {"window_size": 100, "policy": "default"}
    assert args.additional_config["eplb_config"] == {"load_collection_phase": "prefill"}
    resolved = args.resolve(num_experts=128, ep_size=16, policy_names=NAMES, environ={})
    assert resolved.v2.window_size == 100 and resolved.v2.load_collection_phase == "prefill"


def test_parse_user_guide_command_line_resolves():
    command = (
        "--tensor-parallel-size 16 --enable-expert-parallel --enable-eplb "
        "--eplb-config.window_size 50 --eplb-config.step_interval 50 "
        "--eplb-config.num_redundant_experts 16 --eplb-config.use_async true "
        "--eplb-config.log_balancedness true --eplb-config.log_balancedness_interval 1"
    )
    argv = [
        *command.split(" "),
        "--additional-config",
        '{"eplb_config":{"load_collection_phase":"all"}}',
    ]
    resolved = parse_cli_args(argv).resolve(
        num_experts=128, ep_size=16, policy_names=NAMES, environ={}
    )
    assert resolved.v2 == EplbConfig(
        window_size=50,
        step_interval=50,
        num_redundant_experts=16,
        use_async=True,
        log_balancedness=True,
    )


def test_parse_legacy_additional_config_resolves_to_legacy():
    args = parse_cli_args(
        ["--additional-config", json.dumps(legacy(dynamic_eplb=True, eplb_policy_type=3))]
    )
    assert not args.enable_eplb and args.eplb_config is None
    resolved = args.resolve(num_experts=64, ep_size=4, policy_names=NAMES, environ={})
    assert resolved.path is EplbPath.LEGACY and resolved.policy == "flash_lb"


def test_parse_coercion_errors_name_the_field():
    with raises("eplb_config.window_size", "expected an integer, got 'abc'"):
        parse_cli_args(["--eplb-config.window_size", "abc"])
    with raises("eplb_config.use_async", "expected true or false, got 'maybe'"):
        parse_cli_args(["--eplb-config.use_async=maybe"])
    with raises("eplb_config.window_size", "must be >= 1, got -5"):
        parse_cli_args(["--eplb-config.window_size", "-5"])
    with raises("enable_eplb", "expected true or false, got 'sure'"):
        parse_cli_args(["--enable-eplb=sure"])


def test_parse_text_none_clears_optional_field_and_enable_eplb_false():
    args = parse_cli_args(["--enable-eplb=false", "--eplb-config.communicator", "none"])
    assert not args.enable_eplb and args.eplb_config == {"communicator": None}


def test_parse_unknown_or_misplaced_dotted_key():
    with raises("eplb_config.windowsize", r"did you mean 'window_size'"):
        parse_cli_args(["--eplb-config.windowsize", "5"])
    with raises("eplb_config.load_collection_phase", "--additional-config"):
        parse_cli_args(["--eplb-config.load_collection_phase", "prefill"])
    with raises("eplb_config.dynamic_eplb", "legacy additional_config key"):
        parse_cli_args(["--eplb-config", '{"dynamic_eplb": true}'])


def test_parse_json_values_are_typed_strictly():
    with raises("eplb_config.window_size", "expected an integer, got '100'"):
        parse_cli_args(["--eplb-config", '{"window_size": "100"}'])


def test_parse_same_field_twice_is_rejected():
    with raises("eplb_config.window_size", r"given twice \(--eplb-config JSON and --eplb-config"):
        parse_cli_args(["--eplb-config", '{"window_size": 5}', "--eplb-config.window_size", "6"])
    with raises("additional_config", "given twice"):
        parse_cli_args(["--additional-config", "{}", "--additional-config", "{}"])


def test_parse_malformed_json_reports_line_and_column():
    with raises("eplb_config", r"not valid JSON \(line 1, column 16: Expecting value\)"):
        parse_cli_args(["--eplb-config", '{"window_size":}'])
    with raises("eplb_config", "must be a JSON object"):
        parse_cli_args(["--eplb-config", "[1]"])
    with raises("additional_config", "not valid JSON"):
        parse_cli_args(["--additional-config={eplb_config: 1}"])


def test_parse_missing_values_and_dotted_additional_config():
    with raises("eplb_config.window_size", "needs a value"):
        parse_cli_args(["--eplb-config.window_size"])
    with raises("eplb_config.use_async", "needs a value"):
        parse_cli_args(["--eplb-config.use_async", "--enable-eplb"])
    with raises("additional_config", "needs a value"):
        parse_cli_args(["--additional-config"])
    with raises("additional_config.eplb_config", "one JSON object"):
        parse_cli_args(["--additional-config.eplb_config", "{}"])
    with raises("enable_eplb", "takes no field"):
        parse_cli_args(["--enable-eplb.window_size", "5"])


def test_parse_stops_at_double_dash():
    args = parse_cli_args(["--enable-eplb", "--", "--eplb-config.window_size", "x"])
    assert args.enable_eplb and args.eplb_config is None
    assert args.rest == ("--", "--eplb-config.window_size", "x")

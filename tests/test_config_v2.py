"""V2 settings (EplbConfig): types, ranges, choices and where each key belongs."""

from __future__ import annotations

import pytest

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.integrations.settings import EplbConfig
from tests.config_helpers import raises


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


def test_v2_phase_choices_are_the_control_planes_collection_phases():
    choices = EplbConfig.__dataclass_fields__["load_collection_phase"].metadata["choices"]
    assert choices == tuple(phase.value for phase in CollectionPhase)


@pytest.mark.parametrize(
    ("key", "maximum"),
    [
        ("window_size", 2**20),
        ("step_interval", 2**31 - 1),
        ("num_redundant_experts", 2**16),
        ("log_balancedness_interval", 2**31 - 1),
    ],
)
def test_v2_every_integer_has_a_documented_maximum(key, maximum):
    """An unbounded value is accepted at initialization and fails later, far from its cause."""
    assert getattr(EplbConfig(**{key: maximum}), key) == maximum
    with raises(f"eplb_config.{key}", rf"must be <= {maximum}, got {maximum + 1}$"):
        EplbConfig(**{key: maximum + 1})
    with raises(f"eplb_config.{key}", rf"must be <= {maximum}, got {10**30}$"):
        EplbConfig.from_mapping({key: 10**30})
    # str() of an integer past 4300 digits raises; the message describes it instead.
    with raises(f"eplb_config.{key}", rf"must be <= {maximum}, got an integer of 16610 bits$"):
        EplbConfig.from_mapping({key: 10**5000})


def test_v2_window_and_interval_of_ten_to_the_thirty_are_rejected_at_construction():
    with raises("eplb_config.window_size", "must be <= 1048576"):
        EplbConfig(window_size=10**30, step_interval=10**30)
    with raises("eplb_config.step_interval", "must be <= 2147483647"):
        EplbConfig(step_interval=10**30)


def test_v2_maxima_are_the_documented_constants():
    from eplb_graph.integrations.settings import fields

    assert (fields.MAX_STEPS, fields.MAX_WINDOW_STEPS, fields.MAX_EXPERTS) == (
        2**31 - 1,
        2**20,
        2**16,
    )
    for key, maximum in [
        ("window_size", fields.MAX_WINDOW_STEPS),
        ("step_interval", fields.MAX_STEPS),
        ("num_redundant_experts", fields.MAX_EXPERTS),
        ("log_balancedness_interval", fields.MAX_STEPS),
    ]:
        assert EplbConfig.__dataclass_fields__[key].metadata["maximum"] == maximum

"""Shared helpers of the configuration tests: a hermetic resolve and a field-pinning raises."""

from __future__ import annotations

from typing import Any

import pytest

from eplb_graph import Placement, RuntimeSettings
from eplb_graph.integrations.settings import ConfigError, resolve_eplb_config
from eplb_graph.policy import policy_names

#: The control plane's fields of ``RuntimeSettings``: what a host's window, interval, phase
#: and policy settings become.
CONTROL_FIELDS = (
    "window_size",
    "step_interval",
    "load_collection_phase",
    "policy",
    "policy_options",
    "num_groups",
    "num_nodes",
    "log_balancedness",
    "log_balancedness_interval",
    "time_samples",
    "min_gain_percent",
    "rearrange",
    "windows_path",
)

#: The policies registered when the tests start; passed explicitly so a resolve is hermetic.
NAMES: tuple[str, ...] = tuple(policy_names())


def resolve(**overrides: Any) -> RuntimeSettings | None:
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


def control(settings: RuntimeSettings) -> dict[str, Any]:
    """The control plane's fields of ``settings``, to compare with another's."""
    return {name: getattr(settings, name) for name in CONTROL_FIELDS}


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


def write_map(path, placement: Placement) -> str:
    placement.save_expert_map(path)
    return str(path)

"""eplb-graph's own settings under vLLM: ``additional_config["eplb_graph"]``, typed and checked.

vLLM's ``--eplb-config`` holds upstream's fields only (its ``policy`` accepts ``"default"``
alone), so everything eplb-graph adds comes through its own section of ``--additional-config``,
where vLLM passes it through untouched to every worker. The section is checked key by key at
engine start: an unknown or misspelled key, a value of the wrong type, or a path that cannot
work is a :class:`~eplb_graph.ConfigError` naming ``additional_config.eplb_graph.<key>``.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.integrations.settings.fields import (
    ConfigError,
    Validated,
    enum_values,
    option,
    show_value,
    suggest,
)
from eplb_graph.integrations.settings.paths import (
    check_directory_path,
    check_map_path,
    check_record_path,
)
from eplb_graph.integrations.settings.resolve import check_policy_name
from eplb_graph.settings import DEFAULT_STAGING_BUDGET_BYTES

SECTION = "eplb_graph"
PREFIX = f"additional_config.{SECTION}"


def _check_policy(name: str, value: str) -> None:
    check_policy_name(value, name)


def _check_options(name: str, value: Any) -> None:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ConfigError(
            name, f"expected a JSON object of policy options, got {show_value(value)}"
        )


@dataclass(frozen=True)
class PluginOptions(Validated):
    """The ``additional_config["eplb_graph"]`` section (every key optional)."""

    _PREFIX: typing.ClassVar[str] = PREFIX

    policy: str | None = option(
        None, check=_check_policy, doc="registered eplb-graph policy; overrides eplb_config.policy"
    )
    policy_options: Mapping[str, Any] | None = option(
        None, check=_check_options, doc="keyword options of the policy"
    )
    load_collection_phase: str | None = option(
        None, choices=(None, *enum_values(CollectionPhase)), doc="batches whose load is collected"
    )
    expert_map_path: str | None = option(
        None, check=check_map_path, doc="start from this expert map (moved to at start-up)"
    )
    record_map_path: str | None = option(
        None, check=check_record_path, doc="record every agreed plan here and apply none"
    )
    metrics_path: str | None = option(
        None, check=check_directory_path, doc="directory of the per-rank metrics files"
    )
    weight_digests: bool = option(
        False, doc="hash every local slot's kernel tensors at attach and after each commit"
    )
    record_windows: bool = option(
        False, doc="write every window's inputs and decision to windows.jsonl (simulate --windows)"
    )
    layers_per_step: int = option(
        1, minimum=1, maximum=1 << 16, doc="layers committed together (capped by the model's)"
    )
    staging_budget_mib: int = option(
        DEFAULT_STAGING_BUDGET_BYTES >> 20,
        minimum=1,
        maximum=1 << 30,
        doc="most CPU memory the staging blocks may take per worker, in MiB",
    )
    commit_margin_steps: int = option(8, minimum=1, maximum=1 << 20, doc="fence distance")
    time_samples: int = option(8, minimum=1, maximum=1 << 16, doc="time buckets for the policy")
    min_gain_percent: int = option(
        0, minimum=0, maximum=99, doc="apply a plan only if it cuts the busiest rank's load by this"
    )
    rearrange: str | None = option(
        None,
        choices=(None, "always", "when_it_pays"),
        doc="when_it_pays (vLLM's default): only plans predicted to repay their move, and undo "
        "one that made steps slower; always: every plan that differs, as upstream",
    )

    def __post_init__(self) -> None:
        self._validate_all()
        if self.expert_map_path is not None and self.record_map_path is not None:
            raise ConfigError(
                f"{PREFIX}.record_map_path",
                "cannot be combined with expert_map_path: record mode never moves weights, so "
                "it cannot start from another map; keep one of the two",
            )
        if self.record_windows and self.metrics_path is None:
            raise ConfigError(
                f"{PREFIX}.record_windows",
                "needs metrics_path: the windows are written into its directory",
            )
        if self.weight_digests and self.metrics_path is None:
            raise ConfigError(
                f"{PREFIX}.weight_digests",
                "needs metrics_path: the digests are written into the per-rank metrics files",
            )
        if self.policy_options and self.policy is None:
            raise ConfigError(
                f"{PREFIX}.policy_options",
                f"given without a policy; name the policy they belong to with {PREFIX}.policy",
            )

    @classmethod
    def from_section(cls, section: Any) -> PluginOptions:
        """Build from the section as vLLM passed it (``None``: every default)."""
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise ConfigError(PREFIX, f"expected a JSON object, got {show_value(section)}")
        known = cls.field_names()
        values: dict[str, Any] = {}
        for key, value in section.items():
            if key not in known:
                raise ConfigError(
                    f"{PREFIX}.{key}",
                    f"unknown key{suggest(str(key), known)}; accepted keys: {', '.join(known)}",
                )
            values[key] = cls.coerce_field(key, value)
        return cls(**values)

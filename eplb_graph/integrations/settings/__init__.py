"""vLLM / vllm-ascend EPLB settings: validated once, then converted into the core's settings.

A host integration feeds the values it holds (vLLM's ``enable_eplb``, the fields of
``ParallelConfig.eplb_config``, the ``additional_config`` dict) to :func:`resolve_eplb_config`,
which checks every setting at initialization, decides the world (V2 or legacy) and returns
:class:`RuntimeSettings`, what ``EplbState`` and ``EplbRuntime`` take (``None``: EPLB is off).
:func:`parse_cli_args` gives its arguments from a command line. Every rejection is a
:class:`ConfigError` naming the field as the user spelled it. Reference: docs/configuration.md.

Modules, by job: ``fields`` (typed field machinery, :class:`ConfigError`), ``v2``
(:class:`EplbConfig`), ``legacy`` (:class:`LegacyEplbConfig`), ``resolve`` (which world a run
uses, every check), ``cli_args`` (command-line spellings), ``runtime_settings`` (the
conversion to the core's :class:`~eplb_graph.settings.RuntimeSettings`).
"""

from eplb_graph.integrations.settings.cli_args import parse_cli_args
from eplb_graph.integrations.settings.fields import ConfigError
from eplb_graph.integrations.settings.legacy import LEGACY_POLICY_TYPES, LegacyEplbConfig
from eplb_graph.integrations.settings.resolve import known_policy_names, resolve_eplb_config
from eplb_graph.integrations.settings.v2 import SUPPORTED_COMMUNICATORS, EplbConfig
from eplb_graph.settings import RuntimeSettings

__all__ = [
    "LEGACY_POLICY_TYPES",
    "SUPPORTED_COMMUNICATORS",
    "ConfigError",
    "EplbConfig",
    "LegacyEplbConfig",
    "RuntimeSettings",
    "known_policy_names",
    "parse_cli_args",
    "resolve_eplb_config",
]

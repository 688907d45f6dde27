"""``RuntimeSettings``: everything one rank's EPLB takes from its configuration, as plain values.

One value, because one path leads to it: a host's spellings are typed and checked by their
schema (vLLM's V2 ``EplbConfig``, vllm-ascend's ``LegacyEplbConfig``, the vLLM plugin's
``PluginOptions``), ``resolve_eplb_config`` turns the one world a run uses into this, and
``EplbRuntime`` reads it; the control plane (window, interval, policy, gate) and the movement
plane (staging, fences, timeouts) each read their fields of it. A runner that builds it from
literals needs only the fields it changes::

    RuntimeSettings(window_size=4, step_interval=8, use_async=False)

The core knows nothing of vLLM's or vllm-ascend's option names
(``eplb_graph.integrations.settings`` maps them), and every field is checked here, at
construction, so a bad value fails before any runtime exists (``SettingsError``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from eplb_graph.arguments import SettingsError, as_flag, as_int, as_seconds
from eplb_graph.control.phases import CollectionPhase
from eplb_graph.placement import Placement

DEFAULT_STAGING_BUDGET_BYTES = 16 << 30
#: The weight-transfer backend eplb-graph implements: gloo CPU staging.
GLOO_COMMUNICATOR = "torch_gloo"

_POSITIVE = (
    "window_size",
    "step_interval",
    "log_balancedness_interval",
    "time_samples",
    "num_groups",
    "num_nodes",
    "layers_per_step",
    "commit_margin_steps",
    "max_batch_ops",
)
_FLAGS = ("log_balancedness", "rebalances", "use_async", "weight_digests")


@dataclass(frozen=True)
class RuntimeSettings:
    """What one rank's EPLB does, how it moves weights, and the model it does it for.

    The model (filled by ``resolve_eplb_config``; ``EplbRuntime`` checks them against its
    state when given):
        num_experts: logical experts N of the model; ``None``: take the state's.
        ep_size: expert-parallel ranks; ``None``: take the state's.
        num_redundant_experts: redundant slots over the logical experts.
        initial_placement: the placement to build ``EplbState`` from (a legacy map, else the
            default one); ``None`` where the model's layer count is not known yet (vLLM checks
            its settings where it builds its config, before any model is loaded).
        move_to: start from this placement: the weights, loaded in ``initial_placement``, are
            moved there before serving (the vLLM plugin's ``expert_map_path``).

    The control plane (what to plan, when, and whether it pays):
        window_size, step_interval: steps of load a plan sees, steps between window closes;
            the window used is :attr:`effective_window_size`.
        load_collection_phase: which batches' load is collected (prefill, decode, all).
        policy, policy_options: the registered rebalance policy and its keyword options.
        num_groups, num_nodes: the model's expert groups and the cluster's nodes (the
            hierarchical ``default`` policy).
        log_balancedness, log_balancedness_interval: log the balancedness every n steps.
        time_samples: time buckets of the window the policy sees.
        min_gain_percent: keep the placement unless a plan cuts the predicted busiest-rank
            load (summed over layers: what a step waits for) by at least this many percent; 0
            applies every plan that differs, as upstream EPLB does.
        rearrange: ``always``: apply every plan that differs (upstream's behaviour).
            ``when_it_pays``: apply a plan only when the expert cost model, fitted on the
            running engine, predicts its saving over the next interval exceeds its movement
            cost, and go back from a placement measured or predicted slower than the starting
            one or the one before it under the load served (``eplb_graph.control.payback``).
        windows_path: append every closed window's reduced inputs and the decision made on them
            to this file (JSON lines, one rank writes it) for ``eplb-graph simulate --windows``.
        rebalances: whether an ``EplbRuntime`` runs at all (false only for a legacy static
            map, served as loaded).
        use_async: plan and move on the worker thread (default) or inline at the window close.
        record_map_path: record mode: every agreed plan is written to this expert-map file and
            none is applied.

    The movement plane (how weights are staged, agreed and committed):
        layers_per_step: layers committed together at one agreed step.
        commit_margin_steps: fence distance: serving steps a commit decision may take before
            the main thread vetoes it. The smallest distance: after a veto the worker doubles it
            (up to 64 times this), and every commit shrinks it back by an eighth.
        exchange_timeout_s: longest wait for a peer in a point-to-point batch.
        agree_timeout_s: longest wait for a collective (window reduction, group probe) and,
            with ``exchange_timeout_s``, for the votes of a decision.
        install_wait_s: longest the worker waits for *its own* main thread to install earlier
            layers. That wait ends when serving reaches the agreed commit steps, so it is sized
            in serving time, not in peer latency: a slow step rate must not abort a healthy
            rearrangement.
        max_batch_ops: transfers per exchange batch across the whole group.
        staging_blocks: staging blocks (default ``2 x layers_per_step``: stage ahead of commit).
        staging_budget_bytes: the most CPU memory the staging blocks may take. Each block holds
            ``2 x slots_per_rank x slot_nbytes`` bytes, allocated once at start-up; a runtime
            whose blocks would exceed this fails there with ``StagingBudgetError`` (never an
            out-of-memory kill later). The default, 16 GiB, holds the default two blocks of a
            DeepSeek-V3-sized bf16 layer at 8 EP ranks (about 12 GB).
        communicator: the weight-transfer backend the runner's group provider must use;
            ``"torch_gloo"``, the only one eplb-graph implements.

    What the host writes (the vLLM plugin):
        metrics_path: directory of the per-rank metrics files (``None``: none written).
        weight_digests: hash every local slot's kernel tensors at attach and after each commit.
    """

    num_experts: int | None = None
    ep_size: int | None = None
    num_redundant_experts: int = 0
    initial_placement: Placement | None = None
    move_to: Placement | None = None

    window_size: int = 1000
    step_interval: int = 3000
    load_collection_phase: CollectionPhase = CollectionPhase.ALL
    policy: str = "default"
    policy_options: dict = field(default_factory=dict)
    num_groups: int = 1
    num_nodes: int = 1
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    time_samples: int = 8
    min_gain_percent: int = 0
    rearrange: str = "always"
    windows_path: str | None = None
    rebalances: bool = True
    use_async: bool = True
    record_map_path: str | None = None

    layers_per_step: int = 1
    commit_margin_steps: int = 8
    exchange_timeout_s: float = 30.0
    agree_timeout_s: float = 30.0
    install_wait_s: float = 120.0
    max_batch_ops: int = 32
    staging_blocks: int | None = None
    staging_budget_bytes: int = DEFAULT_STAGING_BUDGET_BYTES
    communicator: str = GLOO_COMMUNICATOR

    metrics_path: str | None = None
    weight_digests: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "load_collection_phase", CollectionPhase.parse(self.load_collection_phase)
        )
        for name in _POSITIVE:
            as_int(name, getattr(self, name), minimum=1, error=SettingsError)
        for name in ("num_experts", "ep_size", "staging_blocks"):
            if getattr(self, name) is not None:
                as_int(name, getattr(self, name), minimum=1, error=SettingsError)
        as_int("num_redundant_experts", self.num_redundant_experts, minimum=0, error=SettingsError)
        as_int("min_gain_percent", self.min_gain_percent, minimum=0, error=SettingsError)
        if self.min_gain_percent > 99:
            raise SettingsError(
                f"min_gain_percent must be 0-99 (a plan cannot cut the load by 100% or more), "
                f"got {self.min_gain_percent}"
            )
        as_int(
            "staging_budget_bytes",
            self.staging_budget_bytes,
            minimum=1,
            maximum=None,
            error=SettingsError,
        )
        for name in ("exchange_timeout_s", "agree_timeout_s", "install_wait_s"):
            as_seconds(name, getattr(self, name), error=SettingsError)
        for name in _FLAGS:
            as_flag(name, getattr(self, name), error=SettingsError)
        if self.communicator != GLOO_COMMUNICATOR:
            raise SettingsError(
                f"communicator must be {GLOO_COMMUNICATOR!r} (the only weight transfer "
                f"eplb-graph implements), got {self.communicator!r}"
            )
        if self.rearrange not in ("always", "when_it_pays"):
            raise SettingsError(
                f"rearrange must be 'always' or 'when_it_pays', got {self.rearrange!r}"
            )
        if not isinstance(self.policy, str) or not self.policy:
            raise SettingsError(f"policy must be a policy name, got {self.policy!r}")
        if not isinstance(self.policy_options, dict) or not all(
            isinstance(key, str) for key in self.policy_options
        ):
            raise SettingsError(
                f"policy_options must be a dict of keyword options, got {self.policy_options!r}"
            )
        for name in ("initial_placement", "move_to"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Placement):
                raise SettingsError(f"{name} must be a Placement or None, got {value!r}")

    @property
    def effective_window_size(self) -> int:
        """Load older than the previous rearrangement cannot inform the next one."""
        return min(self.window_size, self.step_interval)

    @property
    def num_physical_experts(self) -> int | None:
        """Physical slots P over all ranks (``None`` while the experts are not given)."""
        if self.num_experts is None:
            return None
        return self.num_experts + self.num_redundant_experts

    @property
    def num_staging_blocks(self) -> int:
        return self.staging_blocks or 2 * self.layers_per_step

    def for_layers(self, num_layers: int) -> RuntimeSettings:
        """These settings capped by a model of ``num_layers`` MoE layers.

        A chunk never holds more layers than the model has, and a rearrangement stages each
        changed layer once, so more than ``num_layers`` blocks would never be used: a
        ``layers_per_step`` of 65536 on a 2-layer model must not allocate 131072 blocks.
        """
        as_int("num_layers", num_layers, minimum=1, error=SettingsError)
        layers = min(self.layers_per_step, num_layers)
        blocks = min(self.staging_blocks or 2 * layers, num_layers)
        return dataclasses.replace(self, layers_per_step=layers, staging_blocks=max(blocks, layers))

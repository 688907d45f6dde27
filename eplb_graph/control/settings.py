"""``ControlSettings``: what the per-step state machine and the planner need, as plain values.

The library core takes this object, never a host engine's configuration: the integration layer
(``eplb_graph.integrations``) validates the host's settings and builds one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eplb_graph.arguments import SettingsError, as_flag, as_int
from eplb_graph.control.phases import CollectionPhase


@dataclass(frozen=True)
class ControlSettings:
    """What the state machine needs from the validated configuration."""

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
    """Keep the placement unless a plan cuts the predicted busiest-rank load (summed over
    layers: what a step waits for) by at least this many percent. 0 = apply every plan that
    differs, as upstream EPLB does; a few percent stops rearranging on noise, which costs
    movement and gains nothing (see :class:`PolicyPlanner`)."""
    rearrange: str = "always"
    """``always``: apply every plan that differs (upstream's behaviour). ``when_it_pays``: apply
    a plan only when the expert cost model, fitted on the running engine, predicts its saving
    over the next interval exceeds its movement cost, and go back from a placement measured or
    predicted slower than the starting one or the one before it under the load served
    (``eplb_graph.control.payback``)."""
    windows_path: str | None = None
    """Append every closed window's reduced inputs and the decision made on them to this file
    (JSON lines, one rank writes it), so ``eplb-graph simulate --windows`` can replay them."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "load_collection_phase", CollectionPhase.parse(self.load_collection_phase)
        )
        for name in (
            "window_size",
            "step_interval",
            "log_balancedness_interval",
            "time_samples",
            "num_groups",
            "num_nodes",
        ):
            as_int(name, getattr(self, name), minimum=1, error=SettingsError)
        as_int("min_gain_percent", self.min_gain_percent, minimum=0, error=SettingsError)
        if self.min_gain_percent > 99:
            raise SettingsError(
                f"min_gain_percent must be 0-99 (a plan cannot cut the load by 100% or more), "
                f"got {self.min_gain_percent}"
            )
        if self.rearrange not in ("always", "when_it_pays"):
            raise SettingsError(
                f"rearrange must be 'always' or 'when_it_pays', got {self.rearrange!r}"
            )
        as_flag("log_balancedness", self.log_balancedness, error=SettingsError)
        if not isinstance(self.policy, str) or not self.policy:
            raise SettingsError(f"policy must be a policy name, got {self.policy!r}")
        if not isinstance(self.policy_options, dict) or not all(
            isinstance(key, str) for key in self.policy_options
        ):
            raise SettingsError(
                f"policy_options must be a dict of keyword options, got {self.policy_options!r}"
            )

    @property
    def effective_window_size(self) -> int:
        """Load older than the previous rearrangement cannot inform the next one."""
        return min(self.window_size, self.step_interval)

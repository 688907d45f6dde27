"""Turns a closed window's load into a new placement through a registered policy.

Shared by the live runtime (run on the movement worker's thread in async mode) and the
simulator, so a policy tuned in simulation behaves the same in serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eplb_graph.control.controller import WindowLoad


@dataclass
class PolicyPlanner:
    """Callable ``WindowLoad -> phy2log [L, P] | None`` (``None``: keep the placement).

    Args:
        policy: registered policy name (``eplb_graph.policy.policy_names()``).
        num_replicas, num_groups, num_nodes, num_ranks: the cluster shape the policy plans for.
        options: policy-specific keyword options.
    """

    policy: str
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_ranks: int
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        import inspect

        from eplb_graph.policy import get_policy

        policy = get_policy(self.policy)  # unknown names fail at start-up, not at a window
        parameters = inspect.signature(policy).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            known = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
            unknown = sorted(set(self.options) - known)
            if unknown:
                raise TypeError(
                    f"policy {self.policy!r} has no option(s) {unknown}; "
                    f"its options are {sorted(known) or 'none'}"
                )

    def __call__(self, load: WindowLoad) -> torch.Tensor | None:
        from eplb_graph.policy import rebalance

        if float(load.logical.sum()) == 0.0:
            return None  # nothing was recorded: no evidence to plan on
        new_phy2log = rebalance(
            self.policy,
            load.logical,
            self.num_replicas,
            self.num_groups,
            self.num_nodes,
            self.num_ranks,
            old_phy2log=load.committed,
            **self.options,
        )
        if torch.equal(new_phy2log, load.committed):
            return None
        return new_phy2log

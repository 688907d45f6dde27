"""Rebalance policies (a registry of pure functions), balance metrics and churn-saving post-passes.

Entry points:

- :func:`rebalance_experts`: DeepSeek hierarchical / global EPLB with upstream's semantics;
- :func:`rebalance`: run any registered policy by name (``policy_names()`` lists them);
- :func:`balancedness`, :func:`rank_load`, :func:`expert_hotness`: balance metrics;
- :func:`preserve_slots`, :func:`relabel_ranks`: post-passes any policy can use.
"""

from __future__ import annotations

# Policy modules register themselves with @register_policy on import. Import every further policy
# module here, unconditionally.
from eplb_graph.policy import churn_aware as _churn_aware  # noqa: F401  ("churn_aware")
from eplb_graph.policy import deepseek as _deepseek  # noqa: F401  ("default")
from eplb_graph.policy import flash_lb as _flash_lb  # noqa: F401  ("flash_lb")
from eplb_graph.policy import random_policy as _random_policy  # noqa: F401  ("random", tests)
from eplb_graph.policy import swift_balance as _swift_balance  # noqa: F401  ("swift_balance")

# Public API.
from eplb_graph.policy.deepseek import rebalance_experts
from eplb_graph.policy.metrics import balancedness, expert_hotness, rank_load
from eplb_graph.policy.preserve import (
    preserve_slots,
    relabel_ranks,
    slots_changed,
    transfers_needed,
)
from eplb_graph.policy.registry import (
    PolicyProblem,
    get_policy,
    policy_names,
    rebalance,
    register_policy,
)

__all__ = [
    "PolicyProblem",
    "balancedness",
    "expert_hotness",
    "get_policy",
    "policy_names",
    "preserve_slots",
    "rank_load",
    "rebalance",
    "rebalance_experts",
    "register_policy",
    "relabel_ranks",
    "slots_changed",
    "transfers_needed",
]

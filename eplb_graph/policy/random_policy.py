"""Policy ``"random"``: a seeded random valid placement. FOR TESTS ONLY, never for production.

It ignores the load entirely; its use is to drive the movement plane and the commit path with
arbitrary (but valid and reproducible) placements, including large reshuffles.
"""

from __future__ import annotations

import torch

from eplb_graph.policy.registry import PolicyProblem, register_policy


@register_policy("random")
def random_policy(
    problem: PolicyProblem,
    *,
    seed: int = 0,
) -> torch.Tensor:
    """Every expert once plus ``P - N`` uniformly random extra copies, shuffled over all slots.

    Args:
        problem: only its shape is used.
        seed: generator seed; the same seed and shape give the same placement.

    Returns:
        ``phy2log [L, P]`` int64 in which every expert appears at least once.
    """
    _, num_layers, num_logical = problem.weight.shape
    num_replicas = problem.num_replicas
    generator = torch.Generator().manual_seed(seed)
    base = torch.arange(num_logical, dtype=torch.int64).expand(num_layers, -1)
    extra = torch.randint(
        num_logical, (num_layers, num_replicas - num_logical), generator=generator
    )
    slots = torch.cat([base, extra], dim=1)
    shuffle = torch.rand(num_layers, num_replicas, generator=generator).argsort(dim=1)
    return slots.gather(1, shuffle)

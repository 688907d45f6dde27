"""Policy ``"flash_lb"``: variance-aware replication and packing (legacy ``eplb_policy_type`` 3).

Why: a window's total load hides *when* the tokens came. Two experts with the same mean load per
time sample are not equally risky if one of them arrives in bursts: a rank holding the bursty one
peaks whenever the burst comes. FlashLB sizes replicas on a high quantile of each expert's load
instead of its mean, then packs them onto ranks so that every rank's *risk* (mean plus a multiple
of its standard deviation over the samples) stays low.

Algorithm (semantics after vllm-ascend's FlashLB, written from its description; no search over
group splits and no covariance terms, which the upstream tree search adds):

1. Per expert, over the S time samples of the window: mean ``mu`` and standard deviation
   ``sigma`` (0 with one sample). Risk weight ``w = mu + z * sigma`` (``z = 0.674``: the 75th
   percentile of a normal).
2. Replica counts: DeepSeek's replication on ``w`` (one slot each, then every spare slot to the
   expert with the highest ``w / count``), so the largest per-replica *risk* is minimal.
3. LPT placement: replicas, heaviest per-replica risk first (``w / count``), each onto the rank
   with a free slot, not yet holding that expert, whose risk after adding it is lowest, where a
   rank's risk is ``sum mu / count + z * sqrt(sum sigma^2 / count^2)`` (replica loads treated as
   independent). Every step runs for all layers at once.
4. With an old placement: optionally renumber ranks to keep the most (expert, rank) pairs
   (:func:`eplb_graph.policy.preserve.relabel_ranks`) and keep staying experts in their slots
   (:func:`eplb_graph.policy.preserve.preserve_slots`). Both leave every rank's contents intact.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.policy import preserve
from eplb_graph.policy.deepseek import replicate_experts
from eplb_graph.policy.registry import PolicyProblem, register_policy

__all__ = ["flash_lb_policy", "lpt_place", "risk_weight"]


def risk_weight(samples: np.ndarray, z: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-expert mean, standard deviation and risk ``mean + z * std`` over time samples.

    Args:
        samples: ``[S, L, N]`` load samples.
        z: quantile multiplier (>= 0).

    Returns:
        ``mean``, ``std`` and ``risk``, each ``[L, N]`` float64.
    """
    mean = samples.mean(axis=0)
    std = samples.std(axis=0)
    return mean, std, mean + z * std


def lpt_place(
    count: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    num_ranks: int,
    z: float,
) -> np.ndarray:
    """Place ``count[e]`` replicas of every expert onto ranks, largest per-replica risk first.

    Args:
        count: ``[L, N]`` int64 replicas per expert (>= 1, summing to ``P`` per layer).
        mean, std: ``[L, N]`` per-expert load mean and standard deviation over time.
        num_ranks: EP ranks; ``P % num_ranks == 0``.
        z: weight of the standard deviation in the rank risk.

    Returns:
        ``phy2log [L, P]`` int64; rank ``r`` holds slots ``[r * P / ranks, (r + 1) * P / ranks)``.
    """
    num_layers, num_logical = count.shape
    num_slots = int(count[0].sum())
    per_rank = num_slots // num_ranks
    layers = np.arange(num_layers)
    # Replica list per layer: expert ids repeated by count, ordered by per-replica risk.
    item_expert = np.repeat(np.tile(np.arange(num_logical), num_layers), count.reshape(-1))
    item_expert = item_expert.reshape(num_layers, num_slots)
    item_count = np.take_along_axis(count, item_expert, 1)
    item_mean = np.take_along_axis(mean, item_expert, 1) / item_count
    item_var = (np.take_along_axis(std, item_expert, 1) / item_count) ** 2
    order = np.argsort(-(item_mean + z * np.sqrt(item_var)), axis=1, kind="stable")

    rank_mean = np.zeros((num_layers, num_ranks))
    rank_var = np.zeros((num_layers, num_ranks))
    fill = np.zeros((num_layers, num_ranks), dtype=np.int64)
    holds = np.zeros((num_layers, num_logical, num_ranks), dtype=bool)
    phy2log = np.empty((num_layers, num_slots), dtype=np.int64)
    for step in range(num_slots):
        item = order[:, step]
        expert = item_expert[layers, item]
        add_mean = item_mean[layers, item][:, None]
        add_var = item_var[layers, item][:, None]
        risk = rank_mean + add_mean + z * np.sqrt(rank_var + add_var)
        # Never a full rank; a rank already holding the expert only if every rank with room
        # does (then the duplicate is unavoidable).
        room = fill < per_rank
        allowed = room & ~holds[layers, expert]
        forced = ~allowed.any(axis=1)
        allowed[forced] = room[forced]
        rank = np.argmin(np.where(allowed, risk, np.inf), axis=1)
        phy2log[layers, rank * per_rank + fill[layers, rank]] = expert
        fill[layers, rank] += 1
        rank_mean[layers, rank] += add_mean[:, 0]
        rank_var[layers, rank] += add_var[:, 0]
        holds[layers, expert, rank] = True
    return phy2log


@register_policy("flash_lb")
def flash_lb_policy(
    problem: PolicyProblem,
    *,
    z: float = 0.674,
    keep_slots: bool = True,
    relabel: bool = True,
) -> torch.Tensor:
    """Registered policy ``"flash_lb"`` (see the module docstring).

    Args:
        problem: the window's load samples (S >= 1) and the shape; groups and nodes are unused
            (placement is global over ranks).
        z: standard deviations added to the mean (risk quantile); 0 sizes on the mean alone.
        keep_slots: with an old placement, keep staying experts in their old slots.
        relabel: with an old placement, renumber ranks to keep the most (expert, rank) pairs.

    Returns:
        ``phy2log [L, P]`` int64.
    """
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    num_ranks, old_phy2log = problem.num_ranks, problem.old_phy2log
    mean, std, risk = risk_weight(problem.weight.numpy(), z)
    _, _, count = replicate_experts(risk, problem.num_replicas)
    phy2log = torch.from_numpy(lpt_place(count, mean, std, num_ranks, z))
    if old_phy2log is not None:
        if relabel:
            phy2log = preserve.relabel_ranks(old_phy2log, phy2log, num_ranks)
        if keep_slots:
            phy2log = preserve.preserve_slots(old_phy2log, phy2log, num_ranks)
    return phy2log

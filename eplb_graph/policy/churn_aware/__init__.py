"""Policy ``"churn_aware"``: the best balance a bounded migration budget can buy.

Why: DeepSeek's planner re-plans from scratch, so after a typical window-to-window drift it moves
nearly every expert to restore a balance that the next drift erodes again anyway
(``docs/benchmarks.md``, churn section). This policy starts from the installed placement and
edits it slot by slot, only while an edit lowers a layer's peak rank load, within a budget of
cross-rank transfers.

1. **Predictor** (:func:`predict_load`): the window's samples averaged with weights
   ``recency_decay ** age``, so recent samples count more when popularity drifts.
   **Drift hedge** (:mod:`eplb_graph.policy.drift`): the plan serves the *next* window, so with
   the previous planning window's load the policy measures the window-to-window log drift and
   plans on the load shrunk toward even shares by that much. Without drift nothing changes;
   without the hedge the budgeted search trails a fresh DeepSeek plan under drift.
2. **Replica counts**: DeepSeek's replication (one slot each, then every spare slot to the
   expert with the highest load per replica), on the load hedged ``replica_hedge`` times harder,
   gives the lowest achievable largest per-replica load ``u*``. An expert above
   ``u* (1 + replica_slack)`` gets replicas back first, from experts that can spare one. Why: the
   rank holding the largest single replica follows one expert's popularity, so it is the
   likeliest to turn hot; an expert that grew must not stay concentrated. Later edits respect the
   same cap when they drop a replica.
3. **Local search** (:mod:`eplb_graph.policy.churn_aware.search`, its edits in
   :mod:`eplb_graph.policy.churn_aware.edits`): per layer, swap / shed / spread edits around the
   hottest rank; the layer applies the edit with the largest peak reduction per transfer, and
   every edit strictly lowers the peak, so the search cannot cycle.
4. **Cost**: a transfer is exactly :func:`eplb_graph.policy.preserve.transfers_needed`; an edit
   that undoes an earlier one refunds it, and no expert moves between slots of one rank.
5. **Gating**: moving weights is not free, so a layer whose predicted balancedness (mean / max
   rank load) gains less than ``min_gain`` keeps its old row, and if the whole placement gains
   less than ``min_total_gain`` the old placement is returned unchanged.

Every expert keeps at least one slot, and edits never put a second copy of an expert on a rank
that already holds it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from eplb_graph.policy.churn_aware.search import local_search
from eplb_graph.policy.deepseek import deepseek_plan, replicate_experts
from eplb_graph.policy.drift import estimate_drift, hedge_load, shrinkage
from eplb_graph.policy.metrics import rank_load_numpy, replica_counts_numpy
from eplb_graph.policy.registry import PolicyProblem, normalize_weight, register_policy

__all__ = ["churn_aware_policy", "predict_load", "transfer_budget"]

logger = logging.getLogger(__name__)


def predict_load(weight: torch.Tensor | np.ndarray, recency_decay: float) -> np.ndarray:
    """Exponentially time-weighted mean load, the predictor of the next window's load.

    Args:
        weight: ``[S, L, N]`` load samples, oldest first.
        recency_decay: weight multiplier per sample of age, in ``(0, 1]``; 1.0 is the plain mean.

    Returns:
        ``[L, N]`` float64, on the scale of one sample.
    """
    if not 0.0 < recency_decay <= 1.0:
        raise ValueError(f"recency_decay must be in (0, 1], got {recency_decay}")
    samples = np.asarray(
        weight.numpy() if isinstance(weight, torch.Tensor) else weight, dtype=np.float64
    )
    age = np.arange(samples.shape[0] - 1, -1, -1, dtype=np.float64)
    weights = recency_decay**age
    return np.tensordot(weights / weights.sum(), samples, axes=1)


def transfer_budget(
    num_slots: int,
    max_transfer_fraction: float,
    max_bytes: int | None,
    expert_bytes: int | None,
) -> tuple[int, int | None]:
    """Per-layer and whole-placement transfer budgets from the options.

    Returns:
        ``(per_layer, total)``: ``floor(max_transfer_fraction * P)`` transfers per layer, and
        ``floor(max_bytes / expert_bytes)`` for all layers together (None without a byte budget).
    """
    if not 0.0 <= max_transfer_fraction <= 1.0:
        raise ValueError(f"max_transfer_fraction must be in [0, 1], got {max_transfer_fraction}")
    per_layer = int(np.floor(max_transfer_fraction * num_slots + 1e-9))
    if max_bytes is None:
        return per_layer, None
    if expert_bytes is None or expert_bytes <= 0:
        raise ValueError("max_bytes needs expert_bytes > 0 (the bytes of one expert's weights)")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return per_layer, int(max_bytes // expert_bytes)


def _mean_and_peak(
    phy2log: np.ndarray, load: np.ndarray, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """``[L]`` mean and max rank load (1 and 1 for a layer without load)."""
    rank_load = rank_load_numpy(phy2log, load, num_ranks)
    peak = rank_load.max(axis=1)
    idle = peak <= 0
    return np.where(idle, 1.0, rank_load.mean(axis=1)), np.where(idle, 1.0, peak)


@register_policy("churn_aware", bounded_moves=True)
def churn_aware_policy(
    problem: PolicyProblem,
    *,
    max_transfer_fraction: float = 0.15,
    max_bytes: int | None = None,
    expert_bytes: int | None = None,
    min_gain: float = 0.01,
    min_total_gain: float = 0.002,
    recency_decay: float = 0.5,
    replica_slack: float | None = 0.0,
    per_kind: int = 8,
    max_steps: int | None = None,
    previous_weight: torch.Tensor | None = None,
    drift_sigma: float | None = None,
    replica_hedge: float = 3.0,
) -> torch.Tensor:
    """Registered policy ``"churn_aware"`` (see the module docstring).

    Args:
        problem: the window's load samples (oldest first) and the placement in force. With no
            placement in force (first placement): DeepSeek's ``rebalance_experts`` on the
            predicted load, since there is nothing to keep (groups and nodes are used only then).
        max_transfer_fraction: at most ``floor(fraction * P)`` (expert, rank) transfers per layer.
            The default 0.15 is the migration target's ceiling, and under drift it keeps the next
            window's balance ahead of a fresh DeepSeek plan where 0.10 falls behind on one shape
            (``docs/benchmarks.md``, churn section).
        max_bytes, expert_bytes: optional budget for the whole rebalance in bytes, each transfer
            costing ``expert_bytes``.
        min_gain: a layer whose predicted balancedness gains less keeps its old row.
        min_total_gain: if the whole placement's predicted balancedness gains less, nothing
            changes (the old placement is returned).
        recency_decay: time weighting of the predictor (:func:`predict_load`).
        replica_slack: per-replica cap ``u* (1 + slack)`` of step 2; None disables step 2 and the
            cap (edits may then concentrate a grown expert, which costs balance under drift).
        per_kind: edits per kind scored exactly each step (more: slower, rarely better).
        max_steps: cap on local-search steps (:func:`local_search`).
        previous_weight: ``[L, N]`` or ``[S, L, N]`` load of the previous planning window;
            :class:`eplb_graph.control.planning.PolicyPlanner` passes it. With it, the drift
            between the two windows is measured and hedged (step 1).
        drift_sigma: the window-to-window log drift to hedge against; None measures it from
            ``previous_weight`` (0 without one); 0 turns the hedge off.
        replica_hedge: replica counts hedge as if the drift variance were this many times
            larger (step 2), since they decide which single replica can turn a rank hot; 1
            hedges them like the load, 0 not at all (the default 3 measured best,
            ``docs/benchmarks-log.md``, the drift hedge).

    Returns:
        ``phy2log [L, P]`` int64.
    """
    if not replica_hedge >= 0:  # also rejects NaN
        raise ValueError(f"replica_hedge must be >= 0, got {replica_hedge}")
    if drift_sigma is not None and not drift_sigma >= 0:
        raise ValueError(f"drift_sigma must be >= 0 or None, got {drift_sigma}")
    weight, num_replicas, num_ranks = problem.weight, problem.num_replicas, problem.num_ranks
    observed = predict_load(weight, recency_decay)
    if drift_sigma is None:
        drift_sigma = (
            0.0
            if previous_weight is None
            else estimate_drift(normalize_weight(previous_weight).numpy(), weight.numpy())
        )
    load = hedge_load(observed, shrinkage(observed, drift_sigma))
    replica_load = hedge_load(observed, shrinkage(observed, drift_sigma * replica_hedge**0.5))
    if problem.old_phy2log is None:
        return deepseek_plan(load, problem)
    old = problem.old_phy2log.numpy().astype(np.int64, copy=True)
    num_layers, num_logical = load.shape
    if (replica_counts_numpy(old, num_logical) == 0).any():
        raise ValueError("old_phy2log must hold every logical expert in every layer")
    per_layer, total = transfer_budget(num_replicas, max_transfer_fraction, max_bytes, expert_bytes)
    replica_cap = None
    if replica_slack is not None:
        if replica_slack < 0:
            raise ValueError(f"replica_slack must be >= 0 or None, got {replica_slack}")
        _, _, target = replicate_experts(replica_load, num_replicas)
        replica_cap = (replica_load / target).max(axis=1) * (1.0 + replica_slack)
    new = local_search(
        load, old, num_ranks, per_layer, total, replica_cap, per_kind, max_steps, replica_load
    )

    old_mean, old_peak = _mean_and_peak(old, load, num_ranks)
    new_mean, new_peak = _mean_and_peak(new, load, num_ranks)
    keep_old = new_mean / new_peak - old_mean / old_peak < min_gain
    new[keep_old] = old[keep_old]
    new_peak = np.where(keep_old, old_peak, new_peak)
    total_gain = old_mean.sum() / new_peak.sum() - old_mean.sum() / old_peak.sum()
    logger.debug(
        "churn_aware: %d of %d layers changed, predicted balancedness gain %.4f, "
        "drift sigma %.3f hedged",
        int((~keep_old).sum()),
        num_layers,
        total_gain,
        drift_sigma,
    )
    if total_gain < min_total_gain:
        return torch.from_numpy(old)
    return torch.from_numpy(new)

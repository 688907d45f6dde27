"""Balance metrics: the one home of the balancedness and per-rank load formulas.

All functions are pure and vectorized over layers. Two kinds of load reach them:

- *executed* slot load ``[L, P]`` (what the routing op counted), folded to ranks by
  :func:`fold_to_ranks`; :func:`balancedness_of_slots` is its balancedness;
- *estimated* rank load from a logical load ``[L, N]`` (:func:`rank_load`, and
  :func:`rank_load_numpy` for the policies, which compute in numpy), under the assumption the
  DeepSeek algorithm optimizes for: an expert's tokens split evenly over its replicas (the
  routing op's hash spreads rows uniformly over replicas).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from eplb_graph.tables import check_slots_per_rank, replica_counts

__all__ = [
    "HotnessReport",
    "balancedness",
    "balancedness_of_slots",
    "expert_hotness",
    "fold_to_ranks",
    "peak_to_mean",
    "rank_load",
    "rank_load_numpy",
    "replica_counts_numpy",
]


def balancedness(tokens_per_rank: torch.Tensor) -> float:
    """Load-weighted balancedness: ``sum_l mean_r(x[l]) / sum_l max_r(x[l])``.

    Weighting by layer totals (rather than averaging per-layer ratios) means idle layers do not
    dilute the figure. 1.0 is perfect balance.

    Args:
        tokens_per_rank: ``[L, ranks]`` non-negative load per rank.

    Returns:
        A float in ``[0, 1]``; 0.0 when the input is empty or carries no load.
    """
    load = torch.as_tensor(tokens_per_rank).detach().cpu().to(torch.float64)
    if load.dim() != 2:
        raise ValueError(f"tokens_per_rank must be [L, ranks], got shape {tuple(load.shape)}")
    if load.numel() == 0:
        return 0.0
    peak = float(load.max(dim=1).values.sum())
    if peak <= 0.0:
        return 0.0
    return float(load.mean(dim=1).sum()) / peak


def fold_to_ranks(slot_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Executed slot load ``[L, P]`` -> ``[L, num_ranks]`` float64 load per rank.

    Rank ``r`` holds slots ``[r P / ranks, (r + 1) P / ranks)``.
    """
    load = torch.as_tensor(slot_load).detach().cpu().to(torch.float64)
    if load.dim() != 2:
        raise ValueError(f"slot_load must be [L, P], got shape {tuple(load.shape)}")
    check_slots_per_rank(load.shape[1], num_ranks)
    return load.reshape(load.shape[0], num_ranks, -1).sum(dim=2)


def balancedness_of_slots(slot_load: torch.Tensor, num_ranks: int) -> float:
    """:func:`balancedness` of executed slot load ``[L, P]`` folded to ranks (0 when nothing
    ran)."""
    return balancedness(fold_to_ranks(slot_load, num_ranks))


def rank_load(phy2log: torch.Tensor, logical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Estimated load of every rank: each expert's load split evenly over its replicas.

    Args:
        phy2log: ``[L, P]`` int64 placement, ``P % num_ranks == 0``.
        logical_load: ``[L, N]`` load per logical expert.
        num_ranks: EP ranks.

    Returns:
        ``[L, num_ranks]`` float64.
    """
    phy2log = torch.as_tensor(phy2log).detach().cpu().to(torch.int64)
    load = torch.as_tensor(logical_load).detach().cpu().to(torch.float64)
    if phy2log.dim() != 2 or load.dim() != 2 or phy2log.shape[0] != load.shape[0]:
        raise ValueError(
            f"need phy2log [L, P] and logical_load [L, N] with the same L, got "
            f"{tuple(phy2log.shape)} and {tuple(load.shape)}"
        )
    num_layers, num_slots = phy2log.shape
    per_rank = check_slots_per_rank(num_slots, num_ranks)
    counts = replica_counts(phy2log, load.shape[1]).clamp_min(1).to(torch.float64)
    per_slot = (load / counts).gather(1, phy2log)  # [L, P]
    return per_slot.view(num_layers, num_ranks, per_rank).sum(dim=2)


def replica_counts_numpy(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """``[L, N]`` int64 replicas of each expert in ``phy2log [L, P]`` (numpy, unchecked)."""
    count = np.zeros((phy2log.shape[0], num_logical), dtype=np.int64)
    np.add.at(count, (np.arange(phy2log.shape[0])[:, None], phy2log), 1)
    return count


def rank_load_numpy(phy2log: np.ndarray, load: np.ndarray, num_ranks: int) -> np.ndarray:
    """:func:`rank_load` for numpy callers: ``phy2log [L, P]``, ``load [L, N]`` ->
    ``[L, num_ranks]`` (unchecked: the policies call it on placements they built)."""
    num_layers, num_slots = phy2log.shape
    count = replica_counts_numpy(phy2log, load.shape[1])
    per_slot = np.take_along_axis(load / np.maximum(count, 1), phy2log, 1)
    return per_slot.reshape(num_layers, num_ranks, num_slots // num_ranks).sum(axis=2)


def peak_to_mean(tokens_per_rank: torch.Tensor) -> torch.Tensor:
    """``[L]`` float64 max / mean rank load per layer; 1.0 for a layer without load."""
    load = torch.as_tensor(tokens_per_rank).to(torch.float64)
    mean = load.mean(dim=1)
    ratio = load.max(dim=1).values / mean.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


@dataclass(frozen=True)
class HotnessReport:
    """Current vs updated placement under the same observed load (estimated, even split).

    Attributes:
        current_peak_to_mean_mean / _max: mean and max over layers of max/mean rank load.
        current_balancedness: :func:`balancedness` of the current placement's rank loads.
        updated_*: the same for the new placement.
    """

    current_peak_to_mean_mean: float
    current_peak_to_mean_max: float
    current_balancedness: float
    updated_peak_to_mean_mean: float
    updated_peak_to_mean_max: float
    updated_balancedness: float

    def as_dict(self) -> dict[str, float]:
        """Flat ``{name: float}`` for monitoring / JSON."""
        return asdict(self)


def expert_hotness(
    current_phy2log: torch.Tensor,
    new_phy2log: torch.Tensor,
    logical_load: torch.Tensor,
    num_ranks: int,
) -> HotnessReport:
    """Compare how two placements would balance ``logical_load``.

    Args:
        current_phy2log: ``[L, P]`` installed placement.
        new_phy2log: ``[L, P']`` candidate placement (P' may differ from P).
        logical_load: ``[L, N]`` observed load per logical expert.
        num_ranks: EP ranks (divides P and P').

    Returns:
        A :class:`HotnessReport`.
    """
    current = rank_load(current_phy2log, logical_load, num_ranks)
    updated = rank_load(new_phy2log, logical_load, num_ranks)
    current_ratio, updated_ratio = peak_to_mean(current), peak_to_mean(updated)
    return HotnessReport(
        current_peak_to_mean_mean=float(current_ratio.mean()),
        current_peak_to_mean_max=float(current_ratio.max()),
        current_balancedness=balancedness(current),
        updated_peak_to_mean_mean=float(updated_ratio.mean()),
        updated_peak_to_mean_max=float(updated_ratio.max()),
        updated_balancedness=balancedness(updated),
    )

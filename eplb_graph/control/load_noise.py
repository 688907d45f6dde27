"""How much of a window's skew is real: the load a plan should be judged on, with noise shrunk.

A window is a sample. Even under a perfectly uniform router, 32 steps of 64 sequences give every
expert a count a few percent off the mean, some rank's experts come out ahead, and a planner
that trusts the window finds a placement "predicted" to save a few percent. Moving to it buys
nothing (the next window's noise is elsewhere) and costs a move: on the benefit curve the gate
moved on a uniform router this way once the cheap candidate (a few priced moves) existed.

The window already holds what is needed to tell noise from skew: its load comes in time buckets
(``RuntimeSettings.time_samples``). Per layer, each bucket's rows are turned into shares of that
bucket (so a batch that grew within the window is not mistaken for noise), and

- the **noise** of an expert's mean share is the spread of its share across buckets over the
  number of buckets (whatever makes routing noisy, over-dispersion included, shows up there);
- the **skew** is the spread of the mean shares across experts.

The share of the skew that is signal, ``k = max(0, 1 - NOISE_FACTOR x mean noise / skew)``,
scales every expert's deviation from the even share (empirical-Bayes shrinkage, made
conservative by :data:`NOISE_FACTOR`). A router that is uniform gives ``k`` of 0 and an even
load: no placement is predicted faster, and the gate keeps the placement without planning. A
real skew gives ``k`` near 1 and the load as it was.
"""

from __future__ import annotations

import torch

__all__ = ["NOISE_FACTOR", "shrink_to_signal"]

NOISE_FACTOR = 2.0
"""The skew counts as signal only beyond this many times the noise. Under a uniform router the
skew of a window is itself an estimate of the noise and scatters around it (by a chi-square of
``N - 1`` degrees of freedom): with a factor of 1, one window in twenty of a 32-expert layer kept
a third of its noise as "signal"; with 2, such a window is rarer than one in a thousand, while a
skew worth moving for (a few hot experts) is hundreds of times the noise."""


def shrink_to_signal(logical: torch.Tensor, steps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per_step [L, N], signal [L])``: rows per step of every expert with each layer's skew
    scaled by its signal share, and that share.

    Args:
        logical: ``[T, L, N]`` the window's rows per time bucket (summed over ranks).
        steps: steps the window's load covers (per rank).

    With fewer than two non-empty buckets in a layer nothing can be told apart: that layer's
    load is returned as is (signal 1).
    """
    if logical.dim() != 3:
        raise ValueError(f"logical must be [T, L, N], got {tuple(logical.shape)}")
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    counts = logical.to(torch.float64)
    raw = counts.sum(dim=0) / steps  # [L, N]
    num_logical = counts.shape[2]
    totals = counts.sum(dim=2, keepdim=True)  # [T, L, 1]
    used = (totals > 0).to(torch.float64)  # [T, L, 1]: buckets with any row
    buckets = used.sum(dim=0)  # [L, 1]
    shares = torch.where(totals > 0, counts / totals.clamp(min=1), torch.zeros_like(counts))
    mean = shares.sum(dim=0) / buckets.clamp(min=1)  # [L, N]
    spread = ((shares - mean) ** 2 * used).sum(dim=0) / (buckets - 1).clamp(min=1)
    noise = (spread / buckets.clamp(min=1)).mean(dim=1)  # [L]: variance of a mean share
    even = 1.0 / num_logical
    skew = ((mean - even) ** 2).sum(dim=1) / max(1, num_logical - 1)  # [L]
    signal = torch.where(
        skew > 0,
        (1.0 - NOISE_FACTOR * noise / skew.clamp(min=1e-300)).clamp(min=0.0),
        torch.zeros_like(skew),
    )
    signal = torch.where(buckets.squeeze(1) >= 2, signal, torch.ones_like(signal))
    layer_rows = raw.sum(dim=1, keepdim=True)  # [L, 1]
    shrunk = layer_rows * (even + signal.unsqueeze(1) * (raw / layer_rows.clamp(min=1e-300) - even))
    per_step = torch.where(buckets >= 2, shrunk, raw)
    return per_step, signal

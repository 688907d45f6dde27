"""Popularity drift between windows, and the hedge a planner takes against it.

Why: a plan is made from one window's load but serves the next window, and by then every
expert's popularity has drifted by a random factor the window could not see. A plan fitted
exactly to the window's shares over-commits to them: its balance under the next window's load
is what matters (``docs/benchmarks.md``, churn section: DeepSeek's fresh plan is 0.99 balanced
on the window it was made for and 0.80 on the next one on A1).

The hedge is shrinkage in log space. Per layer, with ``s^2`` the spread (variance over experts)
of the log load and ``sigma^2`` the variance of one window-to-window log drift, the load is
raised to the power ``beta = s^2 / (s^2 + sigma^2)`` (and rescaled to its sum): the fraction of
the observed spread that is lasting popularity rather than one window's noise, the classic
empirical-Bayes (James-Stein) factor. With no drift ``beta`` is 1 and nothing changes; the more
the loads churn, the more the plan hedges toward even shares. ``sigma`` is measured from the two
most recent planning windows (:func:`estimate_drift`), so a stable workload is never hedged.
"""

from __future__ import annotations

import numpy as np

__all__ = ["estimate_drift", "hedge_load", "shrinkage"]

_EVEN_SPREAD = 1e-12


def _window_totals(samples: np.ndarray) -> np.ndarray:
    """``[L, N]`` counts of a whole window from ``[L, N]`` or ``[S, L, N]`` samples."""
    return samples if samples.ndim == 2 else samples.sum(axis=0)


def estimate_drift(previous: np.ndarray, current: np.ndarray) -> float:
    """Standard deviation of one window-to-window log drift of expert popularity.

    The log change of every expert's load between two windows, centered per layer (a uniform
    change of traffic is not drift), pooled over layers; the part that counting noise explains
    (about ``1 / count`` per window for a count-like load) is subtracted, so two samples of an
    unchanged popularity measure about 0.

    Args:
        previous, current: ``[L, N]`` or ``[S, L, N]`` non-negative loads of two windows (the
            samples of a window are summed).

    Returns:
        ``sigma >= 0``.

    Raises:
        ValueError: different ``[L, N]`` shapes, or negative loads.
    """
    before = _window_totals(np.asarray(previous, dtype=np.float64))
    after = _window_totals(np.asarray(current, dtype=np.float64))
    if before.shape != after.shape:
        raise ValueError(
            f"the previous window's load is {list(before.shape)} but this window's is "
            f"{list(after.shape)}; both must be [L, N]"
        )
    if (before < 0).any() or (after < 0).any():
        raise ValueError("loads must be >= 0")
    change = np.log1p(after) - np.log1p(before)
    change -= change.mean(axis=1, keepdims=True)
    counting_noise = 1.0 / (1.0 + after) + 1.0 / (1.0 + before)
    return float(np.sqrt(max(float((change**2 - counting_noise).mean()), 0.0)))


def shrinkage(load: np.ndarray, drift_sigma: float) -> np.ndarray:
    """``[L]`` exponent ``beta = s^2 / (s^2 + sigma^2)`` per layer (module docstring).

    A layer whose loads are all equal has ``s^2 = 0`` and nothing to hedge: ``beta`` is 1.
    """
    if drift_sigma < 0:
        raise ValueError(f"drift_sigma must be >= 0, got {drift_sigma}")
    spread = np.log1p(np.asarray(load, dtype=np.float64)).var(axis=1)
    even = spread <= _EVEN_SPREAD  # rounding noise of equal loads, not a spread
    return np.where(even, 1.0, spread / np.where(even, 1.0, spread + drift_sigma**2))


def hedge_load(load: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """``load ** exponent`` per layer (``exponent [L]``), rescaled to each layer's sum.

    Zero loads stay zero; an exponent of 1 returns the load unchanged.
    """
    load = np.asarray(load, dtype=np.float64)
    powered = load ** np.asarray(exponent, dtype=np.float64)[:, None]
    total = powered.sum(axis=1, keepdims=True)
    scale = np.divide(
        load.sum(axis=1, keepdims=True), total, out=np.zeros_like(total), where=total > 0
    )
    return powered * scale

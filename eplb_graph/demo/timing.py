"""Measured step and expert time of the demo's EPLB-on and EPLB-off models.

Why: EPLB exists to shorten the busiest rank's step; balancedness of counts is only a means.
Each rank times both models' forwards (the collectives inside make a step as slow as its
slowest rank) and reads its expert op's own clock (``EplbState.expert_stats``, ns per layer,
accumulated inside the compiled op) as per-step deltas. At the end the ranks exchange their
medians once, so the report says how long the busiest rank spent in experts with EPLB on and off.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from eplb_graph.state import EplbState


def _expert_ns(state: EplbState) -> int:
    return int(state.expert_stats[:, 1].sum())


class StepTiming:
    """Per-step wall time of each model's forward and this rank's expert-op time in it."""

    def __init__(self, state: EplbState, baseline: EplbState) -> None:
        self._states = (state, baseline)
        self._rows_at_start = tuple(int(s.expert_stats[:, 0].sum()) for s in self._states)
        self._last = (_expert_ns(state), _expert_ns(baseline))
        self.step_ms: dict[str, list[float]] = {"eplb": [], "baseline": []}
        self.expert_ms: dict[str, list[float]] = {"eplb": [], "baseline": []}

    def add(self, on_s: float, off_s: float, state: EplbState, baseline: EplbState) -> None:
        now = (_expert_ns(state), _expert_ns(baseline))
        for name, seconds, before, after in zip(
            ("eplb", "baseline"), (on_s, off_s), self._last, now, strict=True
        ):
            self.step_ms[name].append(1e3 * seconds)
            self.expert_ms[name].append((after - before) / 1e6)
        self._last = now

    def summary(self, world_size: int) -> dict:
        """Medians over the run (a collective on the default group: every rank must call it).

        ``expert_rows_per_rank``: (token, k) rows each rank's expert op computed in the run.
        ``step_ms``: median forward time (the same on every rank up to noise: collectives).
        ``busiest_expert_ms``: the largest per-rank median expert time. ``balancedness_measured``:
        mean / max over ranks of the per-rank median expert times. ``speedup``: off / on.
        """
        local = torch.tensor(
            [
                statistics.median(self.step_ms["eplb"] or [0.0]),
                statistics.median(self.step_ms["baseline"] or [0.0]),
                statistics.median(self.expert_ms["eplb"] or [0.0]),
                statistics.median(self.expert_ms["baseline"] or [0.0]),
                *(
                    float(int(s.expert_stats[:, 0].sum()) - start)
                    for s, start in zip(self._states, self._rows_at_start, strict=True)
                ),
            ],
            dtype=torch.float64,
        )
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        rows = torch.stack(gathered)  # [ranks, 6]
        result: dict = {}
        for column, name in ((0, "eplb"), (1, "baseline")):
            expert = rows[:, column + 2]
            busiest = float(expert.max())
            result[name] = {
                "step_ms": float(rows[:, column].max()),
                "busiest_expert_ms": busiest,
                "expert_ms_per_rank": [float(v) for v in expert],
                "expert_rows_per_rank": [int(v) for v in rows[:, column + 4]],
                "balancedness_measured": float(expert.mean()) / busiest if busiest > 0 else None,
            }
        on, off = result["eplb"], result["baseline"]
        result["step_speedup"] = off["step_ms"] / on["step_ms"] if on["step_ms"] > 0 else None
        result["expert_speedup"] = (
            off["busiest_expert_ms"] / on["busiest_expert_ms"]
            if on["busiest_expert_ms"] > 0
            else None
        )
        return result

"""Replay a load trace through the real control plane, with no weights and no model.

Per step the trace's logical load is spread evenly over each expert's replicas under the
committed placement (what the routing op's hash does on average) and added to the state's load
pass iff the controller switched recording on — the same window, phase filter, planner, policy
and gating code that serves. A plan is committed at once (movement is the movement plane's
business; here its cost is counted, not paid). Balancedness is measured on the load actually
executed each step, against a static run with EPLB off on the same trace.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from eplb_graph.control.planning import PolicyPlanner, WindowPlan, plan_window
from eplb_graph.control.window import EplbController, WindowSnapshot, local_reducer, reduce_window
from eplb_graph.placement import Placement
from eplb_graph.policy.metrics import balancedness_of_slots
from eplb_graph.progress import ProgressBar
from eplb_graph.settings import RuntimeSettings
from eplb_graph.simulate.trace import LoadTrace
from eplb_graph.state import EplbState


@dataclass(frozen=True)
class ClusterShape:
    num_redundant: int
    num_ranks: int
    num_nodes: int = 1
    num_groups: int = 1
    expert_bytes: int = 44_040_192  # DeepSeek-V3 routed expert: 3 x 7168 x 2048 at FP8


@dataclass
class RebalanceRecord:
    step: int
    slots_changed: float  # fraction of slots whose expert changed
    transfers: int  # (expert, destination rank) copies that cross ranks
    bytes_moved: int
    layers_changed: int
    policy_seconds: float
    window_balancedness: float  # committed placement under the closed window's load


@dataclass
class SimulationReport:
    policy: str
    settings: dict
    cluster: dict
    steps: int
    balancedness: float  # time-averaged, EPLB on
    balancedness_baseline: float  # time-averaged, EPLB off (initial placement kept)
    rearrangements: int
    rebalances: list[RebalanceRecord] = field(default_factory=list)
    series_step: list[int] = field(default_factory=list)
    series_balancedness: list[float] = field(default_factory=list)
    series_baseline: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        moves = [r.slots_changed for r in self.rebalances]
        data["mean_slots_changed"] = float(np.mean(moves)) if moves else 0.0
        data["mean_bytes_per_rebalance"] = (
            float(np.mean([r.bytes_moved for r in self.rebalances])) if self.rebalances else 0.0
        )
        data["total_policy_seconds"] = float(sum(r.policy_seconds for r in self.rebalances))
        return data


def transfers_between(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Per layer: (expert, rank) pairs present in ``new`` but not in ``old`` ``[L, P]`` -> ``[L]``.

    Each such pair is one expert copy that must cross ranks (duplicates on a rank are copied
    locally from the first arrival, so they are not counted twice).
    """
    num_layers, num_slots = new.shape
    per_rank = num_slots // num_ranks
    num_experts = int(max(old.max(), new.max())) + 1
    rank = torch.arange(num_slots) // per_rank
    old_pairs = torch.zeros(num_layers, num_ranks * num_experts, dtype=torch.bool)
    new_pairs = torch.zeros_like(old_pairs)
    old_pairs.scatter_(1, rank * num_experts + old, True)
    new_pairs.scatter_(1, rank * num_experts + new, True)
    return (new_pairs & ~old_pairs).sum(dim=1)


class _EvenSplit:
    """Logical load ``[L, N]`` -> slot load ``[L, P]`` under one placement (cached per version)."""

    def __init__(self, phy2log: torch.Tensor, num_logical: int) -> None:
        self.phy2log = phy2log
        counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.float64)
        counts.scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))
        self.inverse_count = (1.0 / counts).gather(1, phy2log)

    def __call__(self, logical: torch.Tensor) -> torch.Tensor:
        return logical.gather(1, self.phy2log) * self.inverse_count


def simulate(
    trace: LoadTrace,
    settings: RuntimeSettings,
    cluster: ClusterShape,
    *,
    progress: bool = False,
    series_points: int = 400,
) -> SimulationReport:
    """Run ``trace`` through the control plane with ``settings.policy``; see module docstring.

    The per-step tensors are tiny ([L, P]); intra-op threads only add wake-up latency (measured:
    8x slower at 2 threads on a busy 2-core machine), so the replay runs single-threaded.
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(trace, settings, cluster, progress=progress, series_points=series_points)
    finally:
        torch.set_num_threads(previous_threads)


def _simulate(
    trace: LoadTrace,
    settings: RuntimeSettings,
    cluster: ClusterShape,
    *,
    progress: bool,
    series_points: int,
) -> SimulationReport:
    started = time.perf_counter()
    placement = Placement.default(
        trace.num_layers, trace.num_experts, cluster.num_redundant, cluster.num_ranks
    )
    state = EplbState(placement, rank=0)
    planner = PolicyPlanner(
        settings.policy,
        placement.num_slots,
        cluster.num_groups,
        cluster.num_nodes,
        cluster.num_ranks,
        dict(settings.policy_options),
        settings.min_gain_percent,
    )
    rebalances: list[RebalanceRecord] = []

    def commit_at_once(plan: WindowPlan) -> None:
        old = plan.load.committed
        new = plan.new_phy2log
        transfers = transfers_between(old, new, cluster.num_ranks)
        rebalances.append(
            RebalanceRecord(
                step=plan.load.step,
                slots_changed=float((old != new).double().mean()),
                transfers=int(transfers.sum()),
                bytes_moved=int(transfers.sum()) * cluster.expert_bytes,
                layers_changed=int((old != new).any(dim=1).sum()),
                policy_seconds=plan.seconds,
                window_balancedness=plan.balancedness,
            )
        )
        state.commit_(Placement(new, trace.num_experts, cluster.num_ranks))

    def plan_closed_window(snapshot: WindowSnapshot) -> None:
        """The rebalance pipeline without movement: reduce locally, plan, commit at once."""
        rows = snapshot.copy_rows()
        load = reduce_window(
            rows,
            snapshot,
            snapshot.committed,
            local_reducer,
            trace.num_experts,
            settings.time_samples,
        )
        plan = plan_window(load, planner, cluster.num_ranks)
        if plan.new_phy2log is not None:
            commit_at_once(plan)

    controller = EplbController(state, settings, plan_closed_window)
    baseline_split = _EvenSplit(placement.phy2log, trace.num_experts)
    splits: dict[int, _EvenSplit] = {}
    popularity = torch.from_numpy(trace.popularity).to(torch.float64)
    every = max(1, trace.num_steps // series_points)
    balance_sum = baseline_sum = 0.0
    report = SimulationReport(
        policy=settings.policy,
        settings={k: (v.value if hasattr(v, "value") else v) for k, v in asdict(settings).items()},
        cluster=asdict(cluster),
        steps=trace.num_steps,
        balancedness=0.0,
        balancedness_baseline=0.0,
        rearrangements=0,
    )
    with ProgressBar(trace.num_steps, f"simulate {settings.policy}", enabled=progress) as bar:
        for step in range(trace.num_steps):
            logical = popularity[int(trace.segment[step])] * float(trace.tokens[step])
            controller.begin_step(
                has_prefill=bool(trace.is_prefill[step]),
                num_valid_tokens=int(trace.tokens[step]),
            )
            version, phy2log = state.committed_snapshot()
            split = splits.get(version)
            if split is None:
                splits.clear()
                split = splits[version] = _EvenSplit(phy2log, trace.num_experts)
            slot_load = split(logical)
            if bool(state.record_enabled):
                state.load.add_(slot_load.round().to(torch.int64))
            step_balance = balancedness_of_slots(slot_load, cluster.num_ranks)
            step_baseline = balancedness_of_slots(baseline_split(logical), cluster.num_ranks)
            balance_sum += step_balance
            baseline_sum += step_baseline
            controller.end_step()
            if step % every == 0:
                report.series_step.append(step)
                report.series_balancedness.append(step_balance)
                report.series_baseline.append(step_baseline)
            if step % 256 == 0:
                bar.update(256 if step else 1, suffix=f"rebalances {len(rebalances)}")
    report.balancedness = balance_sum / trace.num_steps
    report.balancedness_baseline = baseline_sum / trace.num_steps
    report.rebalances = rebalances
    report.rearrangements = len(rebalances)
    report.wall_seconds = time.perf_counter() - started
    return report


def plot_reports(reports: list[SimulationReport], path: str) -> None:
    """Balancedness over time per policy (plus the EPLB-off baseline), rebalances marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.5))
    if reports:
        axis.plot(reports[0].series_step, reports[0].series_baseline, color="0.6", label="EPLB off")
    for report in reports:
        (line,) = axis.plot(report.series_step, report.series_balancedness, label=report.policy)
        for record in report.rebalances:
            axis.axvline(record.step, color=line.get_color(), alpha=0.25, linewidth=0.8)
    axis.set_xlabel("step")
    axis.set_ylabel("balancedness (mean / max rank load)")
    axis.set_ylim(0, 1.02)
    axis.legend(loc="lower right")
    axis.set_title("EPLB simulation: balancedness over time (vertical lines: rebalances)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

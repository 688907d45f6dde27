"""Turns a closed window's reduced load into a new placement through a registered policy.

Shared by the live rebalance pipeline (on the movement worker's thread in async mode, inline in
sync mode) and the simulator, so a policy tuned in simulation behaves the same in serving.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from eplb_graph.control.decision_log import DecisionLog
from eplb_graph.control.payback import PaybackGate
from eplb_graph.control.window import WindowLoad
from eplb_graph.control.window_record import WindowRecorder
from eplb_graph.policy import expert_hotness, get_policy, rebalance
from eplb_graph.policy.metrics import balancedness_of_slots, rank_load

HISTORY_OPTION = "previous_weight"
REARRANGE_MODES = ("always", "when_it_pays")
"""``always``: apply every plan that differs (and clears ``min_gain_percent``), as upstream EPLB
does. ``when_it_pays``: apply a plan only when the cost model predicts it repays its move, and go
back from a placement measured slower than the one before it or the starting one
(:mod:`eplb_graph.control.payback`)."""


@dataclass
class PolicyPlanner:
    """Callable ``WindowLoad -> phy2log [L, P] | None`` (``None``: keep the placement).

    Args:
        policy: registered policy name (``eplb_graph.policy.policy_names()``).
        num_replicas, num_groups, num_nodes, num_ranks: the cluster shape the policy plans for.
        options: policy-specific keyword options.

    ``min_gain_percent`` (0 = off) keeps the placement when the plan would cut the predicted
    step's expert load, the sum over layers of the busiest rank's load (each layer waits for its
    busiest rank), by less than that share of the window's load: a rearrangement costs movement
    and stalls, and one that buys almost nothing (a balanced load, noise) never repays them.

    ``rearrange="when_it_pays"`` hands the decision to a :class:`PaybackGate` (the policy's plan
    is one candidate; the placement packed by predicted time is another), which needs
    ``max_replicas`` (the lookup width), ``step_interval`` (the horizon a plan must repay in) and
    ``copy_bytes`` (one expert copy's bytes: the prior cost of a move).

    A window whose planning fails (a policy error, a bug) keeps the placement: it is recorded as
    a ``failed`` decision with its cause (``last_decision``, ``failures``), logged as a WARNING
    (rate-limited: :class:`~eplb_graph.control.decision_log.DecisionLog`), and the next window
    plans again. ``announce``: log every decision (one rank of a group does). ``windows_path``:
    record every window and its decision there
    (:class:`~eplb_graph.control.window_record.WindowRecorder`; one rank of a group does).

    A policy that takes a ``previous_weight`` keyword (``churn_aware``) also gets the load of the
    window this planner saw before, so it can measure how much popularity drifts between
    rebalances and hedge against it. The planner owns that history: the option cannot be set.
    Every rank's planner must see the same windows (the plan is agreed by digest across ranks),
    so the pipeline :meth:`observe` s every window it reduces, whether it then plans it or not.
    """

    policy: str
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_ranks: int
    options: dict = field(default_factory=dict)
    min_gain_percent: int = 0
    rearrange: str = "always"
    max_replicas: int | None = None
    step_interval: int = 3000
    copy_bytes: int = 0
    announce: bool = False
    windows_path: str | None = None
    gate: PaybackGate | None = field(default=None, init=False, repr=False)
    failures: int = field(default=0, init=False)
    last_decision: dict | None = field(default=None, init=False)
    _log: DecisionLog = field(init=False, repr=False)
    _recorder: WindowRecorder | None = field(default=None, init=False, repr=False)
    _takes_history: bool = field(default=False, init=False, repr=False)
    _latest_step: int | None = field(default=None, init=False, repr=False)
    _latest: torch.Tensor | None = field(default=None, init=False, repr=False)
    _before_latest: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._log = DecisionLog(self.announce)
        if self.windows_path is not None:
            self._recorder = WindowRecorder(self.windows_path, self.settings_record())
        policy = get_policy(self.policy)  # unknown names fail at start-up, not at a window
        if HISTORY_OPTION in self.options:
            raise TypeError(
                f"{HISTORY_OPTION!r} is supplied by the planner (the previous window's load); "
                "remove it from the policy options"
            )
        if self.rearrange not in REARRANGE_MODES:
            raise ValueError(f"rearrange must be one of {REARRANGE_MODES}, got {self.rearrange!r}")
        if self.rearrange == "when_it_pays":
            self.gate = PaybackGate(
                self.num_ranks,
                self.num_replicas,
                self.max_replicas or self.num_replicas,
                self.step_interval,
                self.min_gain_percent,
                self.copy_bytes,
            )
        signature = inspect.signature(policy).parameters
        self._takes_history = HISTORY_OPTION in signature
        parameters = signature.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            known = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
            unknown = sorted(set(self.options) - known)
            if unknown:
                raise TypeError(
                    f"policy {self.policy!r} has no option(s) {unknown}; "
                    f"its options are {sorted(known) or 'none'}"
                )

    def settings_record(self) -> dict:
        """What a replay of this planner's windows needs to build one like it."""
        return {
            "policy": self.policy,
            "num_replicas": self.num_replicas,
            "num_groups": self.num_groups,
            "num_nodes": self.num_nodes,
            "num_ranks": self.num_ranks,
            "options": self.options,
            "min_gain_percent": self.min_gain_percent,
            "rearrange": self.rearrange,
            "max_replicas": self.max_replicas,
            "step_interval": self.step_interval,
            "copy_bytes": self.copy_bytes,
        }

    def __call__(self, load: WindowLoad) -> torch.Tensor | None:
        plan = self._plan(load)
        if self._recorder is not None:
            decision = self.last_decision
            if decision is not None and decision["step"] != load.step:
                decision = None  # no decision on this window (it held no load)
            try:
                self._recorder.write(load, decision, plan)
            except OSError as error:  # a full disk must not stop serving, nor planning
                self._decided({"step": load.step, "action": "failed",
                               "reason": f"recording the window: {error}"})  # fmt: skip
                self._recorder = None
        return plan

    def _plan(self, load: WindowLoad) -> torch.Tensor | None:
        if float(load.logical.sum()) == 0.0:
            return None  # nothing was recorded: no evidence to plan on
        self.observe(load)
        if self.gate is not None:
            # The gate asks for the policy's plan only when some placement could repay a move.
            def policy_plan() -> torch.Tensor | None:
                plan = self._policy_plan(load)
                return None if torch.equal(plan, load.committed) else plan

            plan = self.gate.decide(load, policy_plan)  # never raises: failures are recorded
            self._decided(self.gate.last_decision)
            return plan
        try:
            new_phy2log = self._policy_plan(load)
        except Exception as error:
            self._decided({"step": load.step, "action": "failed",
                           "reason": f"{type(error).__name__}: {error}"})  # fmt: skip
            return None
        if torch.equal(new_phy2log, load.committed):
            self._decided({"step": load.step, "action": "kept", "reason": "the plan is the "
                           "committed placement"})  # fmt: skip
            return None
        if (
            self.min_gain_percent
            and predicted_gain(load.committed, new_phy2log, load.logical, self.num_ranks)
            < self.min_gain_percent / 100
        ):
            self._decided({"step": load.step, "action": "kept",
                           "reason": "predicted gain below min_gain_percent"})  # fmt: skip
            return None
        self._decided({"step": load.step, "action": "applied", "reason": "the policy's plan"})
        return new_phy2log

    def _decided(self, decision: dict | None) -> None:
        if decision is None:
            return
        if decision["action"] == "failed":
            self.failures += 1
        self.last_decision = {
            k: decision[k] for k in ("step", "action", "reason", "candidate") if k in decision
        }
        self._log.record(decision)

    def _policy_plan(self, load: WindowLoad) -> torch.Tensor:
        history = {HISTORY_OPTION: self._before_latest} if self._takes_history else {}
        return rebalance(
            self.policy,
            load.logical,
            self.num_replicas,
            self.num_groups,
            self.num_nodes,
            self.num_ranks,
            old_phy2log=load.committed,
            **self.options,
            **history,
        )

    def observe(self, load: WindowLoad) -> None:
        """Remember a window's load as the history of later plans, without planning.

        Idempotent per window (keyed by its close step), so the pipeline can observe every
        reduced window before planning it, and a failure anywhere in planning leaves every
        rank's history the same. Windows with no recorded load are not history.
        """
        if float(load.logical.sum()) == 0.0 or load.step == self._latest_step:
            return
        self._before_latest, self._latest = self._latest, load.logical
        self._latest_step = load.step


def predicted_gain(
    committed: torch.Tensor, proposed: torch.Tensor, logical: torch.Tensor, num_ranks: int
) -> float:
    """Share of the step's busiest-rank load (summed over layers) ``proposed`` removes, under a
    window's load ``logical`` (``[L, N]``, or ``[S, L, N]`` time buckets, summed); 0 if none."""
    load = logical.sum(dim=0) if logical.dim() == 3 else logical
    before = float(rank_load(committed, load, num_ranks).max(dim=1).values.sum())
    after = float(rank_load(proposed, load, num_ranks).max(dim=1).values.sum())
    return (before - after) / before if before > 0 else 0.0


@dataclass(frozen=True)
class WindowPlan:
    """What planning made of one reduced window.

    Attributes:
        load: the reduced window.
        new_phy2log: ``[L, P]``, or ``None`` when the planner kept the placement.
        balancedness: of the committed placement under the window's executed slot load
            (upstream's formula: sum of per-layer mean rank load over sum of per-layer max).
        hotness: peak-to-mean rank load of the committed placement and of the plan (of the
            committed one again when there is no plan) under the window's logical load.
        seconds: time the planner took.
    """

    load: WindowLoad
    new_phy2log: torch.Tensor | None
    balancedness: float
    hotness: dict
    seconds: float


def window_balancedness(load: WindowLoad, num_ranks: int) -> float:
    """Balancedness of the executed slot load of a reduced window."""
    return balancedness_of_slots(load.physical, num_ranks)


def plan_window(load: WindowLoad, planner, num_ranks: int) -> WindowPlan:
    """Observe, plan and measure one reduced window (``planner``: ``WindowLoad -> phy2log|None``).

    ``observe`` runs before planning (and before anything that can fail), so a planning failure
    on one rank never splits the ranks' planner histories.
    """
    observe = getattr(planner, "observe", None)
    if observe is not None:
        observe(load)
    started = time.perf_counter()
    new_phy2log = planner(load)
    seconds = time.perf_counter() - started
    logical = load.logical.sum(dim=0).to(torch.float64)
    proposed = load.committed if new_phy2log is None else new_phy2log
    hotness = expert_hotness(load.committed, proposed, logical, num_ranks).as_dict()
    return WindowPlan(load, new_phy2log, window_balancedness(load, num_ranks), hotness, seconds)

"""Policy registry: every rebalance policy is a pure function behind one name.

A policy maps observed load to a new placement. It is a pure function of tensors (no state, no
I/O, no device), so the async worker can run it off the main thread and the simulator can replay
it on traces. Signature of a registered policy::

    policy(problem: PolicyProblem, **options) -> phy2log [L, P] int64

- ``problem``: the load and the shape, checked once by :func:`rebalance` (:class:`PolicyProblem`),
  so no policy spells or re-checks the shape arguments.
- ``options``: policy-specific keyword options; unknown options raise ``TypeError``.

:func:`rebalance` runs two post-passes on every policy's plan: copies of an expert beyond one per
rank go to other experts (``policy/replica_cap.py``), then an avoidable second copy of an expert
on one rank is moved to another rank (``policy/spread.py``), so no policy wastes a slot that way
and every plan of a shape with room for it (``P <= N x ranks``) can be written as an expert map.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from eplb_graph.errors import EplbError
from eplb_graph.policy.preserve import preserve_slots, transfers_needed
from eplb_graph.policy.replica_cap import cap_replicas
from eplb_graph.policy.spread import spread_replicas
from eplb_graph.tables import check_slots_per_rank


@dataclass(frozen=True)
class PolicyProblem:
    """What every policy is asked to place: the window's load and the shape to place it in.

    One value instead of six positional arguments, so a policy's signature names only its own
    options and the shape is validated in one place (:func:`rebalance`).

    Attributes:
        weight: ``[S, L, N]`` float64 load samples of the window on the CPU (S >= 1 time
            samples; a policy that ignores time uses :attr:`total_load`).
        num_replicas: ``P`` physical slots per layer.
        num_groups, num_nodes: expert groups and nodes (DeepSeek's hierarchical packing; global
            policies ignore them).
        num_ranks: EP ranks.
        old_phy2log: ``[L, P]`` int64 placement in force, or None (first placement).
    """

    weight: torch.Tensor
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_ranks: int
    old_phy2log: torch.Tensor | None = None

    @property
    def total_load(self) -> torch.Tensor:
        """``[L, N]`` load summed over the window's samples."""
        return self.weight.sum(dim=0)

    def first_placement(self) -> PolicyProblem:
        """The same load with no placement in force (for policies that fall back to DeepSeek)."""
        return PolicyProblem(
            self.weight, self.num_replicas, self.num_groups, self.num_nodes, self.num_ranks
        )


class PolicyFunction(Protocol):
    def __call__(self, problem: PolicyProblem, **options) -> torch.Tensor: ...


class UnknownPolicyError(EplbError, KeyError):
    """The requested policy name is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


_POLICIES: dict[str, PolicyFunction] = {}
_BOUNDED_MOVES: set[str] = set()


def register_policy(
    name: str, *, bounded_moves: bool = False
) -> Callable[[PolicyFunction], PolicyFunction]:
    """Decorator registering ``fn`` under ``name`` (names are unique).

    ``bounded_moves``: the policy edits the placement in force within a budget of moves, so
    :func:`rebalance`'s duplicate post-pass may only swap slots, never re-pack a layer.
    """

    def decorator(fn: PolicyFunction) -> PolicyFunction:
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} is already registered")
        _POLICIES[name] = fn
        if bounded_moves:
            _BOUNDED_MOVES.add(name)
        return fn

    return decorator


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str) -> PolicyFunction:
    try:
        return _POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown EPLB policy {name!r}; registered policies: {', '.join(policy_names())}"
        ) from None


def normalize_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[L, N]`` or ``[S, L, N]`` load -> ``[S, L, N]`` float64 on the CPU (validated)."""
    weight = torch.as_tensor(weight)
    if weight.dim() == 2:
        weight = weight.unsqueeze(0)
    if weight.dim() != 3:
        raise ValueError(f"weight must be [L, N] or [S, L, N], got shape {tuple(weight.shape)}")
    if weight.is_complex():
        raise TypeError(f"weight must be real, got {weight.dtype}")
    weight = weight.detach().to(device="cpu", dtype=torch.float64)
    if bool((weight < 0).any()) or not bool(torch.isfinite(weight).all()):
        raise ValueError("weight must be finite and non-negative")
    return weight


def rebalance(
    name: str,
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """Run the policy ``name``; returns ``phy2log [L, P]`` int64 (see module docstring)."""
    policy = get_policy(name)
    samples = normalize_weight(weight)
    check_slots_per_rank(num_replicas, num_ranks, name="num_replicas")
    if num_replicas < samples.shape[2]:
        raise ValueError(
            f"num_replicas P={num_replicas} is smaller than the number of experts "
            f"N={samples.shape[2]}"
        )
    if old_phy2log is not None:
        old_phy2log = torch.as_tensor(old_phy2log, dtype=torch.int64).cpu()
        expected = (samples.shape[1], num_replicas)
        if tuple(old_phy2log.shape) != expected:
            raise ValueError(
                f"old_phy2log must be [L, P] = {list(expected)}, got {list(old_phy2log.shape)}"
            )
    problem = PolicyProblem(samples, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log)
    raw = policy(problem, **options).to(torch.int64)
    # Whatever the policy: no expert with more copies than ranks when the shape has room
    # (policy/replica_cap.py), and no avoidable second copy of an expert on one rank
    # (policy/spread.py), so every such plan can be written as an expert map.
    phy2log = raw
    spread = spread_replicas(
        cap_replicas(raw, samples.sum(dim=0), num_ranks),
        samples.sum(dim=0),
        num_ranks,
        fewest_moves=name in _BOUNDED_MOVES and old_phy2log is not None,
    )
    if spread is raw or old_phy2log is None:
        return spread
    spread = preserve_slots(old_phy2log, spread, num_ranks)
    if name in _BOUNDED_MOVES:
        # A bounded policy's budget is a promise: a layer the post-pass would make cost more
        # cross-rank copies keeps the policy's row (and its duplicate).
        costlier = transfers_needed(old_phy2log, spread, num_ranks) > transfers_needed(
            old_phy2log, phy2log, num_ranks
        )
        if bool(costlier.any()):
            spread = torch.where(costlier[:, None], phy2log, spread)
    return spread

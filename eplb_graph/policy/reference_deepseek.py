"""Plain-Python reference of the DeepSeek EPLB algorithm: the test oracle and benchmark baseline.

Deliberately written the slow, obvious way (one layer at a time, one item at a time, Python lists
and loops, no array tricks) straight from the description in :mod:`eplb_graph.policy.deepseek`,
so a reader can check it line by line against the algorithm. The vectorized implementation must
return exactly the same placement. Never use this in production: it is the "Python greedy packing
loop" shape whose cost the vectorized version removes.

Arithmetic matches the vectorized code operation for operation (float64, sums accumulated left to
right from 0.0, ``load / count`` divisions), so even ties between non-integer loads resolve alike.
"""

from __future__ import annotations

import torch


def balanced_packing(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Pack items into ``num_packs`` packs of equal size, heaviest first, into the lightest pack.

    Args:
        weights: ``n`` item weights.
        num_packs: ``m``, dividing ``n``.

    Returns:
        ``(pack_of_item, position_in_pack)``, two lists of length ``n``.
    """
    num_items = len(weights)
    per_pack = num_items // num_packs
    if per_pack == 1:
        return list(range(num_items)), [0] * num_items
    # sorted() is stable: equal weights keep ascending item order.
    heaviest_first = sorted(range(num_items), key=lambda item: -weights[item])
    pack_load = [0.0] * num_packs
    pack_size = [0] * num_packs
    pack_of_item = [0] * num_items
    position_in_pack = [0] * num_items
    for item in heaviest_first:
        best = -1
        for pack in range(num_packs):
            if pack_size[pack] == per_pack:
                continue  # full
            if best == -1 or pack_load[pack] < pack_load[best]:  # strict: first index wins ties
                best = pack
        pack_of_item[item] = best
        position_in_pack[item] = pack_size[best]
        pack_size[best] += 1
        pack_load[best] += weights[item]
    return pack_of_item, position_in_pack


def replicate_experts(
    weights: list[float], num_slots: int
) -> tuple[list[int], list[int], list[int]]:
    """One slot per expert, then each extra slot to the expert with the highest load per replica.

    Returns:
        ``(expert_of_slot [num_slots], replica_rank_of_slot [num_slots], count [n])``.
    """
    num_experts = len(weights)
    expert_of_slot = list(range(num_experts))
    replica_rank = [0] * num_experts
    count = [1] * num_experts
    for _ in range(num_slots - num_experts):
        best = 0
        for expert in range(1, num_experts):
            if weights[expert] / count[expert] > weights[best] / count[best]:
                best = expert
        expert_of_slot.append(best)
        replica_rank.append(count[best])
        count[best] += 1
    return expert_of_slot, replica_rank, count


def rebalance_layer(
    weights: list[float], num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[list[int], list[int], list[int]]:
    """Hierarchical placement of one layer.

    Returns:
        ``(phy2log [P], replica_rank [P], logcnt [N])`` as lists.
    """
    num_logical = len(weights)
    group_size = num_logical // num_groups
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_slots // num_nodes
    slots_per_rank = num_slots // num_ranks
    ranks_per_node = num_ranks // num_nodes

    # 1. Whole groups onto nodes.
    group_loads = []
    for group in range(num_groups):
        total = 0.0
        for expert in range(group * group_size, (group + 1) * group_size):
            total += weights[expert]
        group_loads.append(total)
    node_of_group, position_of_group = balanced_packing(group_loads, num_nodes)
    node_experts = [[-1] * experts_per_node for _ in range(num_nodes)]
    for group in range(num_groups):
        for offset in range(group_size):
            local = position_of_group[group] * group_size + offset
            node_experts[node_of_group[group]][local] = group * group_size + offset

    phy2log = [-1] * num_slots
    replica_rank = [-1] * num_slots
    logcnt = [0] * num_logical
    for node in range(num_nodes):
        experts = node_experts[node]
        local_loads = [weights[expert] for expert in experts]
        # 2. Replicate the node's experts into the node's slots.
        local_of_replica, rank_of_replica, count = replicate_experts(local_loads, slots_per_node)
        for local, expert in enumerate(experts):
            logcnt[expert] = count[local]
        # 3. Pack the node's replicas onto the node's ranks.
        replica_loads = [local_loads[local] / count[local] for local in local_of_replica]
        rank_of, position_of = balanced_packing(replica_loads, ranks_per_node)
        for replica, local in enumerate(local_of_replica):
            slot = node * slots_per_node + rank_of[replica] * slots_per_rank + position_of[replica]
            phy2log[slot] = experts[local]
            replica_rank[slot] = rank_of_replica[replica]
    return phy2log, replica_rank, logcnt


def reference_rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`eplb_graph.policy.deepseek.rebalance_experts`, layer by layer.

    Args:
        weight: ``[L, N]`` loads.

    Returns:
        ``phy2log [L, P]``, ``log2phy [L, N, P - N + 1]`` (slots ascending, -1 padded) and
        ``logcnt [L, N]``, int64.
    """
    rows = torch.as_tensor(weight).detach().cpu().to(torch.float64).tolist()
    num_logical = len(rows[0])
    if num_replicas % num_ranks != 0:
        raise ValueError(f"num_replicas P={num_replicas} is not divisible by num_ranks")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas P={num_replicas} is smaller than N={num_logical}")
    if num_groups % num_nodes != 0:  # global fallback
        num_groups, num_nodes = 1, 1
    if num_logical % num_groups != 0 or num_ranks % num_nodes != 0:
        raise ValueError("hierarchical balancing needs N % groups == 0 and ranks % nodes == 0")

    width = num_replicas - num_logical + 1
    all_phy2log, all_log2phy, all_logcnt = [], [], []
    for layer_weights in rows:
        phy2log, _, logcnt = rebalance_layer(
            layer_weights, num_replicas, num_groups, num_nodes, num_ranks
        )
        log2phy = [[-1] * width for _ in range(num_logical)]
        filled = [0] * num_logical
        for slot, expert in enumerate(phy2log):  # ascending slot order
            log2phy[expert][filled[expert]] = slot
            filled[expert] += 1
        all_phy2log.append(phy2log)
        all_log2phy.append(log2phy)
        all_logcnt.append(logcnt)
    return (
        torch.tensor(all_phy2log, dtype=torch.int64),
        torch.tensor(all_log2phy, dtype=torch.int64),
        torch.tensor(all_logcnt, dtype=torch.int64),
    )


def reference_replica_rank(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """``[L, P]`` upstream replica rank of every slot (creation order of the copy), per layer."""
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1
    rows = torch.as_tensor(weight).detach().cpu().to(torch.float64).tolist()
    ranks = [
        rebalance_layer(row, num_replicas, num_groups, num_nodes, num_ranks)[1] for row in rows
    ]
    return torch.tensor(ranks, dtype=torch.int64)

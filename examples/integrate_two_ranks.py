"""Two expert-parallel ranks serving a compiled MoE with eplb-graph: the whole integration.

    python examples/integrate_two_ranks.py [--sync]        # spawns 2 ranks on this machine
    torchrun --standalone --nproc-per-node 2 examples/integrate_two_ranks.py [--sync]

Every rank routes every token (replicated routing, as vLLM's CPU expert parallelism does),
computes the rows routed to the slots it holds, and an all-reduce sums the ranks' partial outputs.
A skewed router and a short window make EPLB rearrange within the first steps; each step's output
is checked against a plain MoE computed with no EPLB at all.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import eplb_graph
from eplb_graph.launch import launched_by_torchrun, run_under_torchrun, spawn_ranks

LAYERS, EXPERTS, REDUNDANT, HIDDEN, INTER, TOP_K = 2, 8, 4, 16, 32, 2
PADDED_TOKENS, STEPS, MAX_STEPS = 8, 40, 2000  # every batch is padded to PADDED_TOKENS rows


def moe_layer(hidden, router, w13, w2, log2phy, replica_count, offset, load, valid, record, slots):
    """One MoE layer on one rank; ``slots`` are the global ids of the slots this rank holds."""
    weights, logical = torch.topk(torch.softmax(hidden @ router, dim=-1), TOP_K)
    # Logical expert -> physical slot (a replica), and executed load recorded per slot.
    physical = torch.ops.eplb_graph.map_and_record(
        logical, log2phy, replica_count, offset, load, valid, record
    )
    # Graph-safe dispatch: no nonzero() or boolean-mask indexing (shapes would depend on data).
    # Every local slot computes every token; a dense [T, S] mask keeps what the router chose.
    gate = (weights.unsqueeze(-1) * (physical.unsqueeze(-1) == slots)).sum(dim=1)  # [T, S]
    up_gate, up = torch.einsum("th,sjh->tsj", hidden, w13).chunk(2, dim=-1)
    out = torch.einsum("tsi,shi->tsh", F.silu(up_gate) * up, w2)  # [T, S, H]
    return torch.einsum("ts,tsh->th", gate, out)  # this rank's share; peers add the rest


def reference_layer(hidden, router, w13, w2):
    """The same layer with no EPLB and no expert parallelism: logical experts, one process."""
    weights, logical = torch.topk(torch.softmax(hidden @ router, dim=-1), TOP_K)
    up_gate, up = torch.einsum("th,tkjh->tkj", hidden, w13[logical]).chunk(2, dim=-1)
    out = torch.einsum("tki,tkhi->tkh", F.silu(up_gate) * up, w2[logical])
    return (weights.unsqueeze(-1) * out).sum(dim=1)


def run_rank(rank: int, world_size: int, use_async: bool) -> bool:
    torch.set_num_threads(1)  # ranks share this machine's cores
    seeded = torch.Generator().manual_seed(0)  # the "checkpoint": identical on every rank
    w13_all = torch.randn(LAYERS, EXPERTS, 2 * INTER, HIDDEN, generator=seeded) / HIDDEN**0.5
    w2_all = torch.randn(LAYERS, EXPERTS, HIDDEN, INTER, generator=seeded) / INTER**0.5
    routers = torch.randn(LAYERS, HIDDEN, EXPERTS, generator=seeded)
    routers[:, :, -2:] *= 4  # experts 6 and 7 win most tokens: the load is skewed

    # Slot p holds expert phy2log[l, p]; rank r holds slots [r * S, (r + 1) * S).
    placement = eplb_graph.Placement.default(LAYERS, EXPERTS, REDUNDANT, world_size)
    my_slots = torch.arange(rank * placement.slots_per_rank, (rank + 1) * placement.slots_per_rank)
    # Replicated routing: a token must choose the same replica on every rank (offset_seed=0).
    state = eplb_graph.EplbState(placement, rank=rank, offset_seed=0)
    # Local expert weights [S, ...], filled from phy2log. These exact tensors are what the
    # kernel reads and what EPLB overwrites in place when it moves an expert here.
    w13 = [w13_all[lay].index_select(0, placement.phy2log[lay, my_slots]) for lay in range(LAYERS)]
    w2 = [w2_all[lay].index_select(0, placement.phy2log[lay, my_slots]) for lay in range(LAYERS)]
    views = [
        eplb_graph.make_expert_view("unquantized", {"w13": w13[lay], "w2": w2[lay]})
        for lay in range(LAYERS)
    ]
    runtime = eplb_graph.EplbRuntime(
        state,
        views,
        # The first window closes after step_interval // 4 = 2 steps, then every 8 steps.
        # Async (default): a worker thread plans and moves; layers commit at a step all ranks
        # agree on, inside begin_step. Sync: the whole rearrangement runs inside the end_step
        # that closes a window (serving stalls), and begin_step always returns [].
        eplb_graph.RuntimeSettings(window_size=4, step_interval=8, use_async=use_async),
        eplb_graph.GroupRing(size=2),  # EPLB's own gloo groups, never the serving group
        rank,
        record_load=rank == 0,  # every rank sees every token: count each token once
    )
    compiled = torch.compile(moe_layer, fullgraph=True)  # one graph serves every layer
    worst, step = 0.0, 0
    # Serve STEPS steps, and on until a layer was committed (async commits wait for agreement).
    # Every rank must take the same steps; placement_version moves at the same step everywhere.
    while step < STEPS or (state.placement_version == 0 and step < MAX_STEPS):
        valid = 5 + step % 4  # real tokens; the rest of the batch is padding
        hidden = torch.randn(PADDED_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(step))
        # has_prefill: whether the batch holds a prefill request (for load_collection_phase).
        committed = runtime.begin_step(has_prefill=False, num_valid_tokens=valid)
        if committed and rank == 0:
            print(f"step {step}: begin_step committed layers {committed}", flush=True)
        out, expected = hidden, hidden
        for lay in range(LAYERS):
            partial = compiled(
                out, routers[lay], w13[lay], w2[lay], state.log2phy[lay],
                state.replica_count[lay], state.offset, state.load[lay],
                state.num_valid_tokens, state.record_enabled, my_slots,
            )  # fmt: skip
            dist.all_reduce(partial)  # combine: sum the ranks' shares
            out = out + partial
            expected = expected + reference_layer(expected, routers[lay], w13_all[lay], w2_all[lay])
        worst = max(worst, float((out[:valid] - expected[:valid]).abs().max()))
        if step == 0:  # every layer has run once: from now on a recompile is an error
            torch.compiler.set_stance("fail_on_recompile")
        version = state.placement_version  # +1 per committed layer
        runtime.end_step()
        done = state.placement_version - version
        if done and rank == 0:
            print(f"step {step}: end_step committed {done} layers", flush=True)
        step += 1
    runtime.close()
    moved = runtime.stats().as_dict()
    exact = all(  # every local slot now holds the weights of the expert phy2log names
        torch.equal(w13[lay], w13_all[lay].index_select(0, state.phy2log[lay, my_slots]))
        and torch.equal(w2[lay], w2_all[lay].index_select(0, state.phy2log[lay, my_slots]))
        for lay in range(LAYERS)
    )
    if rank == 0:
        print(f"{'async' if use_async else 'sync'}: {moved['layers_committed']} layers committed")
        print(f"local weights follow phy2log: {'yes' if exact else 'NO'}")
        verdict = "outputs match" if worst < 1e-4 else "OUTPUTS DIFFER"
        print(f"max |EPLB - reference| over valid rows: {worst:.1e} ({verdict})", flush=True)
    return exact and worst < 1e-4


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", action="store_true", help="rearrange inside end_step")
    use_async = not parser.parse_args().sync
    if launched_by_torchrun():  # this process is one rank; CPU tensors: a gloo serving group
        ok = run_under_torchrun(run_rank, use_async, backend="gloo")
    else:
        ok = all(spawn_ranks(run_rank, 2, use_async))
    raise SystemExit(0 if ok else 1)

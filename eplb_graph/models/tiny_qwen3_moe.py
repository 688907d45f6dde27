"""A tiny Qwen3-MoE checkpoint for real vLLM engines: the plugin's tests and benchmark write it.

Random weights (seeded) saved with transformers, about 2.5 MB in float32: hidden 128, 2 layers,
4 heads / 2 KV heads of 32, 8 experts, top-2, expert intermediate 64, vocabulary 512. vLLM's
CPU attention supports head size 32. Weights are drawn larger than transformers' default init
so routing and logits are not degenerate.

``hot_experts`` skews the router: their gate rows are scaled up and every other row down, so
most tokens pick hot experts. With the default placement and 2 EP ranks, experts 2, 3 and 4 all
sit on rank 0 with no replica, the worst case EPLB should fix.

``router_zipf`` (exponent ``s``) replaces that two-level skew with a graded, Zipf-shaped one: the
gate row of the expert ranked ``r`` (``hot_experts`` first, then the rest in id order) is scaled
by ``(r + 1) ** -s``, normalised to mean 1 (0 = no skew at all). With ``hot_experts=()`` the
low-numbered experts are the hot ones and, under the default placement, sit on rank 0. It
shapes the router's logits, so the executed load follows the ranking roughly, not an exact Zipf
law. The size options make a checkpoint whose experts dominate a step (e.g. hidden 1024,
4 layers, 64 experts, top-8).

``domains`` makes a router that follows the tokens, as real traffic does (code requests heat
other experts than chat): one hot expert set per domain, and the vocabulary split into one
token range per domain plus a neutral range (:func:`domain_tokens`). A domain's tokens, its hot
experts' router rows and its tokens' output rows share one direction of the hidden space, so a
prompt of a domain's tokens routes to that domain's experts and generates (greedily) that
domain's tokens, step after step; neutral tokens route evenly. The attention and expert
outputs are drawn smaller (:data:`DOMAIN_WRITE_SCALE`) so the domain's direction survives the
layers. A batch whose sequences come from several domains routes to all their hot sets.

``eplb-graph checkpoint OUT`` and ``python -m eplb_graph.models.tiny_qwen3_moe OUT`` write one.
"""

from __future__ import annotations

from pathlib import Path

HOT_EXPERTS = (2, 3, 4)
NUM_EXPERTS = 8
VOCAB = 512
FIRST_TOKEN = 3  # 0-2 are special (pad, bos, eos)
DOMAIN_STRENGTH = 6.0
"""Norm of a domain's direction in its tokens' embeddings, its hot experts' router rows and its
tokens' output rows, against the random weights' (about 0.1 x sqrt(hidden))."""
ROUTER_SHARE = 0.012
"""A domain's direction in its hot experts' router rows, as a share of :data:`DOMAIN_STRENGTH`:
most of a domain's tokens pick its hot experts, not every one of them."""
DOMAIN_WRITE_SCALE = 0.005
"""Attention and expert output projections are drawn this much smaller with ``domains``: what
each layer writes into the residual stream stays small beside a token's domain direction."""


def domain_tokens(domain: int, num_domains: int) -> range:
    """Token ids of ``domain`` (``num_domains``: the neutral range, routed evenly)."""
    span = (VOCAB - FIRST_TOKEN) // (num_domains + 1)
    start = FIRST_TOKEN + domain * span
    return range(start, start + span)


def write_tiny_qwen3_moe(
    path: str | Path,
    *,
    hot_experts: tuple[int, ...] = HOT_EXPERTS,
    seed: int = 0,
    router_zipf: float | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_experts: int = NUM_EXPERTS,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    dtype: str = "float32",
    domains: tuple[tuple[int, ...], ...] = (),
) -> Path:
    """Write the checkpoint folder ``path`` and return it.

    ``router_zipf`` (not None) replaces the two-level skew; the defaults write the tests' model.
    ``dtype`` (``float32`` or ``bfloat16``) is the saved weights' type (bf16 halves the files
    of the benchmark's larger models). ``domains``: one hot expert set per domain (the router
    follows the tokens; ``hot_experts`` and ``router_zipf`` are then ignored).
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # comes with the vllm extra

    for hot in domains:
        if not hot or any(not 0 <= expert < num_experts for expert in hot):
            raise ValueError(f"a domain's hot experts must be in [0, {num_experts}), got {hot}")
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=256,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.1)
        if domains:
            _route_by_domain(model, domains, hidden_size)
        elif router_zipf is not None:
            order = [*hot_experts, *(e for e in range(num_experts) if e not in hot_experts)]
            scale = torch.empty((num_experts, 1))
            for rank, expert in enumerate(order):
                scale[expert] = (rank + 1) ** -float(router_zipf)
            scale *= num_experts / scale.sum()
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(scale)
        elif hot_experts:
            scale = torch.full((num_experts, 1), 0.25)
            scale[list(hot_experts)] = 4.0
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(scale)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    path = Path(path)
    model.save_pretrained(path)
    return path


def _route_by_domain(model, domains: tuple[tuple[int, ...], ...], hidden_size: int) -> None:
    """Give each domain a direction of the hidden space, written into its tokens' embeddings,
    its hot experts' router rows and its tokens' output rows (see the module docstring)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    count = len(domains) + 1  # the last direction is the neutral tokens': no hot experts
    directions = torch.linalg.qr(torch.randn(hidden_size, count, generator=generator))[0]
    directions = directions.T * DOMAIN_STRENGTH  # [D + 1, H], orthogonal
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    unit = directions / DOMAIN_STRENGTH
    # Output rows read no domain's direction but through their own: within a domain the next
    # token is picked by the context's own features, not by the direction every token shares
    # (which would make every sequence of a domain emit the same few tokens).
    head -= (head @ unit.T) @ unit
    for domain in range(count):
        tokens = domain_tokens(domain, len(domains))
        embed[tokens.start : tokens.stop] += directions[domain]
        head[tokens.start : tokens.stop] += directions[domain]
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(DOMAIN_WRITE_SCALE)
        layer.mlp.experts.down_proj.mul_(DOMAIN_WRITE_SCALE)  # [E, H, I], all experts
        gate = layer.mlp.gate.weight
        # No router row reads a domain's direction except through its bonus, so within a
        # domain (and among neutral tokens) a token's own features pick its experts.
        gate -= (gate @ unit.T) @ unit
        for domain, hot in enumerate(domains):
            gate[list(hot)] += ROUTER_SHARE * directions[domain]


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(
        prog="python -m eplb_graph.models.tiny_qwen3_moe",
        description="Write the tiny Qwen3-MoE checkpoint (`eplb-graph checkpoint OUT` does the "
        "same, with a choice of router skew).",
    )
    _parser.add_argument("out", metavar="OUT", help="folder to write")
    _parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    _args = _parser.parse_args()
    write_tiny_qwen3_moe(_args.out, seed=_args.seed)

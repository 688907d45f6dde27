"""eplb-graph as a vLLM plugin: vLLM's EPLB switches, served by eplb-graph, on vLLM's CPU backend.

Installed with ``pip install 'eplb-graph[vllm]'``, which registers :func:`register` under vLLM's
``vllm.general_plugins`` entry-point group. vLLM then runs it in every process, and with it:

- ``enable_expert_parallel=True`` works on the CPU fused-MoE kernel (slots to local rows);
- ``enable_eplb=True`` and ``eplb_config={...}`` are accepted on CPU and served by eplb-graph:
  routing and load recording through ``torch.ops.eplb_graph.map_and_record`` inside vLLM's
  compiled graph, eplb-graph's load window, policies and asynchronous (or synchronous) movement
  of vLLM's real expert weights over eplb-graph's own gloo groups, commits between steps;
- eplb-graph's own settings come through ``additional_config={"eplb_graph": {...}}``;
- per-rank metrics files, and Prometheus metrics on the server's ``/metrics``.

See ``docs/vllm.md``. Nothing here imports vLLM until :func:`register` runs.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM general-plugin entry point: check this vLLM, then patch it (once per process)."""
    from eplb_graph.integrations.vllm.install import install

    install()

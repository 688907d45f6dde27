"""Adapters between host serving engines and the eplb-graph core.

The core (control, movement, runtime, policy, placement, state) takes plain settings objects and
never reads a host engine's configuration; nothing in it imports from here. This package speaks
the hosts' vocabulary: :mod:`eplb_graph.integrations.settings` validates vLLM's V2 EPLB options
and vllm-ascend's legacy keys and converts them into the core's settings.
"""

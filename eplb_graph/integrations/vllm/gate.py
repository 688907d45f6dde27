"""Let vLLM's parallel configuration accept ``enable_eplb`` on the CPU platform.

vLLM refuses EPLB on CPU in ``ParallelConfig`` validation by asking the module global
``current_platform`` of ``vllm.config.parallel`` whether it is CUDA-like (vllm-ascend passes the
same gate the same way). The plugin replaces that one module global with a proxy that answers yes
to that one question and forwards everything else to the real platform, so no other check of
that module, and no other module, sees a different platform. EPLB itself then runs in
eplb-graph, not in vLLM's CUDA implementation.
"""

from __future__ import annotations


class EplbPlatformGate:
    """Forwards every attribute to the real platform except ``is_cuda_alike()``."""

    def __init__(self, platform: object) -> None:
        object.__setattr__(self, "_platform", platform)

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name: str) -> object:
        return getattr(object.__getattribute__(self, "_platform"), name)

    def __repr__(self) -> str:
        return f"EplbPlatformGate({object.__getattribute__(self, '_platform')!r})"


def install() -> bool:
    """Open the gate on the CPU platform; returns whether it is open."""
    import vllm.config.parallel as parallel

    if isinstance(parallel.current_platform, EplbPlatformGate):
        return True
    if not parallel.current_platform.is_cpu():
        return False
    parallel.current_platform = EplbPlatformGate(parallel.current_platform)
    return True

"""eplb-graph's log lines in vLLM's processes go where vLLM's own lines go."""

from __future__ import annotations

import logging


def log_through_vllm() -> None:
    """Send eplb-graph's INFO lines where vLLM's go (its handlers, every process).

    vLLM configures handlers on its own ``vllm`` logger only; without this, the attach and
    rearrangement lines of eplb-graph would be dropped in every worker. Nothing is changed
    when the application configured ``eplb_graph`` or the root logger itself, or when vLLM's
    logging is off (``VLLM_CONFIGURE_LOGGING=0``: no handlers to borrow). The API server loads
    plugins before it configures vLLM's logging, so code logging there later calls this again.
    """
    ours, theirs = logging.getLogger("eplb_graph"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    ours.propagate = False

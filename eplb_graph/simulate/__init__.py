"""Trace simulator: tune window, interval, redundancy and policy before touching a cluster.

Names load on first use (``eplb_graph.lazy_exports``): the command line builds its parser from
``simulate.command`` without importing torch.
"""

from __future__ import annotations

from eplb_graph.lazy_exports import lazy_exports

_SIMULATOR = "eplb_graph.simulate.simulator"
_TRACE = "eplb_graph.simulate.trace"
_PUBLIC = {
    "ClusterShape": _SIMULATOR,
    "SimulationReport": _SIMULATOR,
    "plot_reports": _SIMULATOR,
    "simulate": _SIMULATOR,
    "transfers_between": _SIMULATOR,
    "LoadTrace": _TRACE,
    "TraceError": _TRACE,
    "TraceSpec": _TRACE,
    "generate_trace": _TRACE,
    "load_trace": _TRACE,
    "save_trace": _TRACE,
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC)

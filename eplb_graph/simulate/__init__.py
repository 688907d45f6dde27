"""Trace simulator: tune window, interval, redundancy and policy before touching a cluster."""

from eplb_graph.simulate.simulator import (
    ClusterShape,
    SimulationReport,
    plot_reports,
    simulate,
    transfers_between,
)
from eplb_graph.simulate.trace import (
    LoadTrace,
    TraceError,
    TraceSpec,
    generate_trace,
    load_trace,
    save_trace,
)

__all__ = [
    "ClusterShape",
    "LoadTrace",
    "SimulationReport",
    "TraceError",
    "TraceSpec",
    "generate_trace",
    "load_trace",
    "plot_reports",
    "save_trace",
    "simulate",
    "transfers_between",
]

"""Per-rank EPLB metrics readable from outside a vLLM engine: JSON files and Prometheus.

Each worker keeps ``<metrics_path>/rank<r>.json`` current: it is rewritten (temp file + rename,
so a reader never sees half a file) when a rearrangement starts, commits a layer or ends, when a
window closes, every ``REFRESH_S`` seconds while steps are served, and at shutdown. Offline
engines with expert parallelism are torn down by a force-kill after a grace period, so "at
shutdown" alone would lose the figures. The writes happen on a thread of their own
(:class:`BackgroundWriter`): building and writing the document costs about a millisecond,
which the serving step must not pay.

Under an OpenAI-compatible server, :class:`MetricsFileCollector` (registered in the API-server
process, which serves ``/metrics``) re-reads the files at every scrape and exports them as
``eplb_graph_*`` metrics next to vLLM's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def placement_digest(phy2log: torch.Tensor) -> str:
    """A short hex digest of a placement: changes whenever the placement changes."""
    data = phy2log.to(torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def write_atomically(path: Path, document: dict[str, Any]) -> None:
    """Replace ``path`` with ``document`` as JSON in one rename."""
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed before the rename)
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
    )
    temporary = Path(handle.name)
    try:
        with handle:
            json.dump(document, handle, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide counters: graphs compiled and graph breaks."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


WARN_INTERVAL_S = 60.0
"""At most one warning per this many seconds about metrics that could not be written."""


class RateLimitedWarning:
    """One WARNING line per ``interval_s``; the next line says how many were held back.

    A metrics directory deleted under a server would otherwise log a line at every refresh of
    every rank (hundreds a second): monitoring must neither take serving down nor flood its log.
    """

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: float | None = None
        self._suppressed = 0
        self._lock = threading.Lock()

    def warn(self, message: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += " (%d more like this in the last %.0f s were not logged)"
            args = (*args, suppressed, self.interval_s)
        logger.warning(message, *args)


def compile_figures(model_compiled: bool, graphs_at_first_step: int | None) -> dict[str, Any]:
    """The metrics file's ``compile`` entry.

    Dynamo's counters are process-wide: in an eager engine (``enforce_eager``, compilation mode
    NONE) they count whatever else in the worker calls ``torch.compile`` on first use (helpers of
    vLLM's, after the first step), never the model. Reported there, "2 graphs now, 0 at the
    first step" reads as a recompile of the model that never happened, so an eager engine says
    ``model_compiled: false`` and reports no graph figures (``null``). In a compiled engine,
    ``recompiled_while_serving`` says whether graphs were added after the first served step.
    """
    if not model_compiled:
        return {
            "model_compiled": False,
            "unique_graphs": None,
            "graph_breaks": None,
            "unique_graphs_at_first_step": None,
            "recompiled_while_serving": None,
        }
    counters = compile_counters()
    recompiled = None
    if graphs_at_first_step is not None:
        recompiled = counters["unique_graphs"] > graphs_at_first_step
    return {
        "model_compiled": True,
        **counters,
        "unique_graphs_at_first_step": graphs_at_first_step,
        "recompiled_while_serving": recompiled,
    }


def model_is_compiled(vllm_config: Any) -> bool:
    """Whether vLLM compiles the model (any compilation mode but NONE, and not eager)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    return int(getattr(vllm_config.compilation_config, "mode", 0) or 0) != 0


class RankMetricsFile:
    """Keeps one rank's metrics file current (see the module docstring).

    A directory removed while serving is created again at the next write; failures that
    persist are logged at most once per ``WARN_INTERVAL_S`` (:class:`RateLimitedWarning`).
    """

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = rank_file(directory, rank)
        self._last_progress: tuple | None = None
        self.warnings = RateLimitedWarning()

    def update(
        self, progress: tuple, document: Callable[[], dict[str, Any]], *, force: bool = False
    ) -> bool:
        """Rewrite the file if ``progress`` (cheap counters) moved since the last write; the
        ``document`` is built only then. Returns whether the file was written."""
        if not force and progress == self._last_progress:
            return False
        content = {**document(), "updated_unix_s": time.time()}
        try:
            try:
                write_atomically(self.path, content)
            except FileNotFoundError:  # the directory was removed while serving: recreate it
                self.directory.mkdir(parents=True, exist_ok=True)
                write_atomically(self.path, content)
        except OSError as error:  # monitoring must never take serving down
            self.warnings.warn("eplb-graph: cannot write metrics to %s: %s", self.path, error)
            return False
        self._last_progress = progress
        return True


REFRESH_S = 2.0
"""Longest a metrics file lags serving (steps, step times) between EPLB events."""


class BackgroundWriter:
    """Rewrites a :class:`RankMetricsFile` on a daemon thread when told progress was made.

    The serving thread only compares a tuple of counters and, on a change, wakes the writer;
    the writer builds the document (plain values read from the runtime) and writes it.
    """

    def __init__(
        self,
        file: RankMetricsFile,
        document: Callable[[], dict[str, Any]],
        heartbeat: Callable[[], object] | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.file = file
        self.document = document
        self.heartbeat = heartbeat
        self.refresh_s = refresh_s
        self._condition = threading.Condition()
        self._pending: tuple | None = None
        self._notified: tuple | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="eplb-metrics", daemon=True)
        self._thread.start()

    def notify(self, progress: tuple) -> None:
        """Serving thread: cheap unless ``progress`` moved."""
        if progress == self._notified:
            return
        self._notified = progress
        with self._condition:
            self._pending = progress
            self._condition.notify()

    def close(self, progress: tuple) -> None:
        """Stop the thread, then write the final document here (forced)."""
        with self._condition:
            self._stopped = True
            self._condition.notify()
        self._thread.join(5.0)
        self.file.update(progress, self.document, force=True)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._pending is not None or self._stopped,
                    timeout=self.refresh_s if self.heartbeat is not None else None,
                )
                if self._stopped:
                    return
                progress, self._pending = self._pending, None
            if progress is None:  # the refresh period passed: rewrite if serving moved on
                progress = ("heartbeat", self.heartbeat())
            try:
                self.file.update(progress, self.document)
            except Exception as error:  # monitoring must never take serving down
                self.file.warnings.warn("eplb-graph: metrics not written: %s", error)


_COUNTERS = {
    "steps": ("eplb_graph_steps", "Serving steps this rank has taken with EPLB"),
    "rearrangements": (
        "eplb_graph_rearrangements",
        "Rearrangements that committed every changed layer",
    ),
    "aborted": ("eplb_graph_rearrangements_aborted", "Rearrangements aborted on every rank"),
    "layers_committed": ("eplb_graph_layers_committed", "MoE layers installed and committed"),
    "bytes_received": ("eplb_graph_bytes_received", "Expert payload bytes received from peers"),
}
_GAUGES = {
    "balancedness": (
        "eplb_graph_balancedness",
        "Balancedness of the committed placement under the last window (mean / max rank load)",
    ),
    "placement_version": ("eplb_graph_placement_version", "Commits applied to the lookup"),
}


class MetricsFileCollector:
    """A prometheus_client collector over the per-rank files of one metrics directory."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def documents(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.directory.glob("rank*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # replaced while reading: the next scrape sees the new file
        return found

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            InfoMetricFamily,
        )

        documents = self.documents()
        for key, (name, help_text) in _COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["rank"])
            for document in documents:
                if document.get(key) is not None:
                    family.add_metric([str(document["rank"])], float(document[key]))
            yield family
        for key, (name, help_text) in _GAUGES.items():
            family = GaugeMetricFamily(name, help_text, labels=["rank"])
            for document in documents:
                if document.get(key) is not None:
                    family.add_metric([str(document["rank"])], float(document[key]))
            yield family
        yield from _expert_time_families(documents)
        yield from _cost_model_families(documents)
        info = InfoMetricFamily(
            "eplb_graph_placement", "Digest of the committed placement", labels=["rank"]
        )
        for document in documents:
            info.add_metric(
                [str(document["rank"])], {"digest": str(document.get("placement_digest"))}
            )
        yield info


def _expert_time_families(documents: list[dict[str, Any]]):
    """Per-rank median expert-op ms per step, and the measured balancedness across ranks
    (mean / max of those medians: what the busiest rank costs a step, measured, not counted)."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(
        "eplb_graph_expert_ms",
        "Median time per step in this rank's expert op (ms, the op's own clock)",
        labels=["rank"],
    )
    medians = []
    for document in documents:
        median = (document.get("expert_ms") or {}).get("p50")
        if median is not None:
            family.add_metric([str(document["rank"])], float(median))
            medians.append(float(median))
    yield family
    measured = GaugeMetricFamily(
        "eplb_graph_balancedness_measured",
        "Mean / max over ranks of the median expert ms per step (1 = every rank equally busy)",
    )
    value = measured_balancedness(medians, expected=len(documents))
    if value is not None:
        measured.add_metric([], value)
    yield measured


def _cost_model_families(documents: list[dict[str, Any]]):
    """The expert cost model of ``rearrange="when_it_pays"``: its coefficients and fit error,
    each rank's predicted expert ms per step (to set against ``eplb_graph_expert_ms``), and
    what the payback gate decided."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    terms = GaugeMetricFamily(
        "eplb_graph_cost_model_us",
        "Fitted expert-op time per call: fixed, per row, per active slot's weight read (µs)",
        labels=["rank", "term"],
    )
    error = GaugeMetricFamily(
        "eplb_graph_cost_model_fit_error",
        "Root-mean-square residual of the cost model over the mean call time",
        labels=["rank"],
    )
    predicted = GaugeMetricFamily(
        "eplb_graph_predicted_expert_ms",
        "Expert ms per step the cost model predicts for this rank under the last window's load",
        labels=["rank"],
    )
    decisions = {
        key: CounterMetricFamily(f"eplb_graph_plans_{key}", text, labels=["rank"])
        for key, text in (
            ("applied", "Plans the payback gate applied"),
            ("kept", "Windows whose placement the payback gate kept"),
            ("rollbacks", "Steps back to a placement faster under the load served now"),
            ("failed", "Windows whose deciding failed (the placement was kept)"),
        )
    }
    for document in documents:
        gate = document.get("cost_model") or {}
        rank = str(document["rank"])
        model = gate.get("model")
        if model:
            for term in ("fixed", "row", "read"):
                terms.add_metric([rank, term], float(model[f"{term}_us"]))
            error.add_metric([rank], float(model["fit_error"]))
        ranks_ms = gate.get("predicted_rank_ms") or []
        if isinstance(document.get("rank"), int) and document["rank"] < len(ranks_ms):
            predicted.add_metric([rank], float(ranks_ms[document["rank"]]))
        for key, family in decisions.items():
            if gate.get(key) is not None:
                family.add_metric([rank], float(gate[key]))
    yield terms
    yield error
    yield predicted
    yield from decisions.values()


def measured_balancedness(per_rank_ms: list[float], expected: int) -> float | None:
    """Mean / max of per-rank expert times; ``None`` until every rank has a sample."""
    if not per_rank_ms or len(per_rank_ms) < expected or max(per_rank_ms) <= 0:
        return None
    return sum(per_rank_ms) / len(per_rank_ms) / max(per_rank_ms)


_REGISTERED: set[str] = set()


def register_prometheus_collector(directory: str) -> bool:
    """Export ``directory``'s rank files on this process's Prometheus registry (once).

    One process exports one metrics directory: a second engine in the same process with another
    ``metrics_path`` keeps its files, but its series would carry the same names and labels as
    the first's (a registry refuses duplicates), so it is not exported and a warning says so.
    """
    resolved = str(Path(directory).resolve())
    if resolved in _REGISTERED:
        return True
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    if _REGISTERED:
        logger.warning(
            "eplb-graph: Prometheus already exports %s; %s is written but not exported (one "
            "metrics directory per process)",
            next(iter(_REGISTERED)),
            resolved,
        )
        return False
    REGISTRY.register(MetricsFileCollector(resolved))
    _REGISTERED.add(resolved)
    return True

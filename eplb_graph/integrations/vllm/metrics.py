"""Per-rank EPLB metrics readable from outside a vLLM engine: JSON files and Prometheus.

Each worker keeps ``<metrics_path>/rank<r>.json`` current: it is rewritten (temp file + rename,
so a reader never sees half a file) when a rearrangement starts, commits a layer or ends, when a
window closes, and at shutdown. Offline engines with expert parallelism are torn down by a
force-kill after a grace period, so "at shutdown" alone would lose the figures.

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
import time
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


class RankMetricsFile:
    """Keeps one rank's metrics file current (see the module docstring)."""

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = rank_file(directory, rank)
        self._last_key: tuple | None = None

    def update(self, document: dict[str, Any], *, force: bool = False) -> bool:
        """Rewrite the file if a counter that marks progress changed; returns whether it did."""
        key = tuple(document.get(name) for name in _PROGRESS_KEYS)
        if not force and key == self._last_key:
            return False
        document = {**document, "updated_unix_s": time.time()}
        try:
            write_atomically(self.path, document)
        except OSError as error:  # monitoring must never take serving down
            logger.warning("eplb-graph: cannot write metrics to %s: %s", self.path, error)
            return False
        self._last_key = key
        return True


_PROGRESS_KEYS = (
    "rearrangements_started",
    "rearrangements",
    "aborted",
    "noop",
    "layers_committed",
    "windows_closed",
    "closed",
)

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
        info = InfoMetricFamily(
            "eplb_graph_placement", "Digest of the committed placement", labels=["rank"]
        )
        for document in documents:
            info.add_metric(
                [str(document["rank"])], {"digest": str(document.get("placement_digest"))}
            )
        yield info


_REGISTERED: set[str] = set()


def register_prometheus_collector(directory: str) -> bool:
    """Export ``directory``'s rank files on this process's Prometheus registry (once)."""
    resolved = str(Path(directory).resolve())
    if resolved in _REGISTERED:
        return True
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    REGISTRY.register(MetricsFileCollector(resolved))
    _REGISTERED.add(resolved)
    return True

"""Shared test setup: make the repository root importable without an editable install."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The suite exercises the fused native CPU kernel: build it (once, cached) or fail loudly rather
# than silently testing only the reference. Set EPLB_GRAPH_NATIVE=auto to allow the fallback.
import os  # noqa: E402

os.environ.setdefault("EPLB_GRAPH_NATIVE", "require")

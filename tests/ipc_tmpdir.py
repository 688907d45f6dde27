"""A TMPDIR short enough for vLLM's ZeroMQ sockets.

vLLM names each engine-core socket ``ipc://$TMPDIR/<uuid4>``, and a Unix socket path holds at
most 107 bytes: under a deep pytest base folder (a CI job's own TMPDIR) every engine dies at
start with ``ZMQError: ipc path ... is longer than 107 characters``. Engines then get a short
folder under ``/tmp`` instead, removed when the test process exits.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

SUN_PATH_MAX = 107
IPC_NAME = len("/") + 36  # "/" + a uuid4 string


def ipc_safe_tmpdir(preferred: Path) -> Path:
    """``preferred`` (created) when a socket under it fits, else a fresh short folder in /tmp."""
    if len(str(preferred)) + IPC_NAME <= SUN_PATH_MAX:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    short = Path(tempfile.mkdtemp(prefix="eplb-ipc-", dir="/tmp"))
    atexit.register(shutil.rmtree, short, ignore_errors=True)
    return short

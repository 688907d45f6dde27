"""One folder of vLLM model-class facts for every engine a test process starts.

Before its first engine, vLLM inspects the model's class (``MixtureOfExperts``, pooling, ...)
in a fresh Python process that imports vLLM: about 17 s on the CI machine class, once per
architecture and engine process. vLLM keeps the result in ``$VLLM_CACHE_ROOT/modelinfos``,
checked against a hash of the model's source file, so it is safe to share; every other cache
(compiled graphs included) stays per test. Engines get that folder linked in: one inspection
per architecture per test run instead of one per engine process.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

_shared: Path | None = None


def share_model_info(vllm_cache_root: Path) -> None:
    """Link ``vllm_cache_root/modelinfos`` to this process's shared folder (made once)."""
    global _shared
    if _shared is None:
        _shared = Path(tempfile.mkdtemp(prefix="eplb-modelinfos-"))
        atexit.register(shutil.rmtree, _shared, ignore_errors=True)
    link = vllm_cache_root / "modelinfos"
    if not link.exists():
        vllm_cache_root.mkdir(parents=True, exist_ok=True)
        link.symlink_to(_shared, target_is_directory=True)

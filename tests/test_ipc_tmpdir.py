"""The engines' TMPDIR keeps vLLM's socket paths under the Unix limit (see tests/ipc_tmpdir.py)."""

from __future__ import annotations

from pathlib import Path

from tests.ipc_tmpdir import IPC_NAME, SUN_PATH_MAX, ipc_safe_tmpdir


def test_a_short_folder_is_used_as_given(tmp_path: Path) -> None:
    preferred = Path("/tmp") / tmp_path.name / "tmp"
    try:
        assert ipc_safe_tmpdir(preferred) == preferred
        assert preferred.is_dir()
    finally:
        preferred.rmdir()
        preferred.parent.rmdir()


def test_a_deep_folder_is_swapped_for_one_a_socket_fits_under(tmp_path: Path) -> None:
    preferred = tmp_path / ("deep" * 30) / "tmp"
    chosen = ipc_safe_tmpdir(preferred)
    assert chosen != preferred and chosen.is_dir()
    assert len(str(chosen)) + IPC_NAME <= SUN_PATH_MAX

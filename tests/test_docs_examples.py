"""The code the README and the user guide show runs as written, so docs and code cannot drift.

Every fenced ``python`` block of README.md and docs/user-guide.md is one of three kinds, told by
its first line:

- ``# excerpt of examples/<file>``: shown from a runnable example; its lines (``...`` marks lines
  left out) must appear in that file in order, and the file itself is run below;
- ``# not run: <reason>``: a fragment that cannot run alone; the reason is visible to readers;
- anything else: run as written with a fresh interpreter in a temporary directory, and it must
  exit 0.

Shell blocks (``bash``) are not run here: the README's install and suite commands install
packages, and the others start servers or long jobs (the user guide's V2 command line is parsed
by tests/test_config_cli_args.py; README.md's vLLM quick start and docs/vllm.md's server blocks
run in tests/test_vllm_server.py). The two-rank integration example runs below in both modes,
async (its default) and ``--sync``, spawned as the user guide shows. Every run is a separate
interpreter, all started at once when the module's first test asks: each run is mostly
interpreter start-up and the torch import, so they overlap well.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/user-guide.md")
EXAMPLE = ROOT / "examples" / "integrate_two_ranks.py"
EXCERPT = re.compile(r"# excerpt of (examples/[\w./-]+\.py)\s*$")
NOT_RUN = re.compile(r"# not run: (\S.*)$")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    code: str

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code else ""


def python_blocks(document: str) -> list[Block]:
    """The fenced blocks whose info string starts with ``python``, in document order."""
    blocks, code, start = [], None, 0
    for number, line in enumerate((ROOT / document).read_text().splitlines(), start=1):
        fence = line.strip().startswith("```")
        if code is None and fence and line.strip()[3:].split()[:1] == ["python"]:
            code, start = [], number
        elif code is not None and fence:
            blocks.append(Block(document, start, textwrap.dedent("\n".join(code)) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


ALL_BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]
RUNNABLE = [
    b for b in ALL_BLOCKS if not (EXCERPT.match(b.first_line) or NOT_RUN.match(b.first_line))
]
EXCERPTS = [b for b in ALL_BLOCKS if EXCERPT.match(b.first_line)]
EXAMPLE_RUNS = {"async": [], "sync": ["--sync"]}


def _environment() -> dict[str, str]:
    """This checkout first on the path (not whichever copy is installed)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _selected_runs(session: pytest.Session) -> set[str]:
    """The runs the selected tests of this module need (block names and example modes)."""
    wanted = set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module.__name__ == __name__ and ("block" in params or "mode" in params):
            wanted.add(params["block"].name if "block" in params else params["mode"])
    return wanted


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Start every selected run at once; each test waits for its own.

    Returns ``name -> (returncode, output)``.
    """
    wanted = _selected_runs(request.session)
    started = {}
    for block in (b for b in RUNNABLE if b.name in wanted):
        started[block.name] = subprocess.Popen(
            [sys.executable, "-c", block.code],
            cwd=tmp_path_factory.mktemp("snippet"),
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends its ranks too
        )
    for mode, flags in ((m, f) for m, f in EXAMPLE_RUNS.items() if m in wanted):
        started[mode] = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *flags],
            cwd=tmp_path_factory.mktemp("example"),
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends its ranks too
        )
    finished: dict[str, tuple[int, str]] = {}

    def result(name: str) -> tuple[int, str]:
        if name not in finished:
            process = started[name]
            try:
                output, _ = process.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(process)
                output, _ = process.communicate()
                output += f"\n[killed after {TIMEOUT_S} s]"
            finished[name] = (process.returncode, output)
        return finished[name]

    yield result
    for process in started.values():
        if process.poll() is None:
            _kill(process)
            process.communicate()


def _kill(process: subprocess.Popen) -> None:
    """End a run and every process it started (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def test_the_documents_show_python_and_every_skipped_block_says_why():
    for document in DOCUMENTS:
        assert python_blocks(document), f"no python block found in {document}"
    for block in ALL_BLOCKS:
        if block.first_line.startswith("# not run"):
            assert NOT_RUN.match(block.first_line), f"{block.name}: '# not run: <reason>'"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.name)
def test_python_block_runs_as_written(block, runs):
    returncode, output = runs(block.name)
    assert returncode == 0, f"{block.name} failed:\n{block.code}\n--- output ---\n{output}"


def _segments(code: str) -> list[str]:
    """The excerpt's runs of lines between ``...`` lines (its first line names the file)."""
    segments, current = [], []
    for line in code.splitlines()[1:]:
        if line.strip() == "...":
            segments.append(current)
            current = []
        else:
            current.append(line)
    segments.append(current)
    return [textwrap.dedent("\n".join(s)).strip("\n") for s in segments if any(s)]


@pytest.mark.parametrize("block", EXCERPTS, ids=lambda block: block.name)
def test_excerpt_is_the_example_verbatim(block):
    source = (ROOT / EXCERPT.match(block.first_line).group(1)).read_text()
    position = 0
    for segment in _segments(block.code):
        found = [
            source.find(textwrap.indent(segment, " " * indent), position)
            for indent in range(0, 17, 4)
        ]
        found = [index for index in found if index >= 0]
        assert found, f"{block.name}: not in the example (in this order):\n{segment}"
        position = min(found) + 1


def test_the_user_guide_shows_and_links_the_integration_example():
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    assert "(../examples/integrate_two_ranks.py)" in guide
    assert any(b.document == "docs/user-guide.md" for b in EXCERPTS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", EXAMPLE_RUNS)
def test_the_integration_example_commits_layers_and_matches_the_reference(mode, runs):
    returncode, output = runs(mode)
    assert returncode == 0, output
    committed = re.search(rf"^{mode}: (\d+) layers committed", output, re.MULTILINE)
    assert committed and int(committed.group(1)) > 0, output
    assert "local weights follow phy2log: yes" in output, output
    assert "(outputs match)" in output, output
    # Async: layers are installed at an agreed step, inside begin_step. Sync: the rearrangement
    # runs inside the end_step that closes a window, and begin_step always returns [].
    in_begin = re.search(r"^step \d+: begin_step committed layers \[", output, re.MULTILINE)
    in_end = re.search(r"^step \d+: end_step committed \d+ layers", output, re.MULTILINE)
    if mode == "async":
        assert in_begin and not in_end, output
    else:
        assert in_end and not in_begin, output

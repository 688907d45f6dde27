"""Run the OpenAI-compatible server commands of README.md and docs/vllm.md as written.

The blocks are read from the documents at test time (never copied), and run with ``bash`` in a
scratch folder: relative paths in them (``tiny-moe``, ``eplb-metrics``) land there. One thing is
changed: the port (``8000`` in the documents) becomes a free one, so runs beside other servers on
the machine (another test run, a user's server) do not collide. The environment carries caches
under the scratch folder and ``HF_HUB_OFFLINE=1``, and *not* the ``VLLM_CPU_*`` variables: the
documents' own prefix must set them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.ipc_tmpdir import ipc_safe_tmpdir
from tests.vllm_model_info import share_model_info

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 90
DOCS_PORT = "8000"


def bash_blocks(document: str, heading: str) -> list[str]:
    """The fenced ``bash`` blocks of ``document`` from ``heading`` to the next heading."""
    text = (ROOT / document).read_text()
    start = text.index(heading)
    following = re.search(r"^#{1,3} |^\*\*\w", text[start + len(heading) :], re.M)
    end = start + len(heading) + following.start() if following else len(text)
    return re.findall(r"```bash\n(.*?)```", text[start:end], re.S)


def commands(block: str) -> list[str]:
    """The block's commands: one per line, backslash-newline continuations joined (as bash
    reads them), trailing ``# comments`` kept (bash ignores them)."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(root: Path) -> dict[str, str]:
    """What a user's shell would have: this checkout's Python first on PATH (the one with
    eplb-graph and vLLM installed), caches under ``root``, no ``VLLM_CPU_*`` settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    for name, folder in (
        ("HF_HOME", "hf"),
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("XDG_CACHE_HOME", "xdg"),
    ):
        (root / "cache" / folder).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / "cache" / folder)
    share_model_info(root / "cache" / "vllm")
    env["TMPDIR"] = str(ipc_safe_tmpdir(root / "cache" / "tmp"))
    env["HF_HUB_OFFLINE"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_shell(command: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run ``command`` with bash in ``cwd``; its output, or an AssertionError with it."""
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


def with_port(command: str, port: int) -> str:
    return command.replace(f":{DOCS_PORT}", f":{port}").replace(
        f"--port {DOCS_PORT}", f"--port {port}"
    )


class Server:
    """One server started from a documented command, its log in ``cwd / 'server.log'``."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.cwd = cwd
        self.log_path = cwd / "server.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                ["bash", "-c", with_port(command, self.port)],
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: the test can end every process of it
            )
        self.pgid = self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> float:
        """Poll ``/health`` until it answers; the seconds it took."""
        started = time.monotonic()
        while True:
            assert self.process.poll() is None, f"server exited:\n{self.log()[-6000:]}"
            with contextlib.suppress(OSError):
                get(f"{self.url}/health")
                return time.monotonic() - started
            assert time.monotonic() - started < START_TIMEOUT_S, "server did not start in time"
            time.sleep(1)

    def complete(self, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["choices"][0]["token_ids"]

    def scrape(self) -> dict[str, dict[str, float]]:
        """``eplb_graph_*`` samples labelled by rank: name -> rank -> value."""
        return parse_prometheus(get(f"{self.url}/metrics"))

    def stop(self, signum: int, *, whole_group: bool) -> float:
        """Send ``signum`` to the server process (``kill PID``) or to its whole process group
        (what Ctrl-C in a terminal does); wait until every process of the group is gone.
        Returns the seconds that took; anything left after ``STOP_TIMEOUT_S`` is killed and
        the test fails."""
        started = time.monotonic()
        if whole_group:
            os.killpg(self.pgid, signum)
        else:
            self.process.send_signal(signum)
        try:
            self.process.wait(STOP_TIMEOUT_S)
            while time.monotonic() - started < STOP_TIMEOUT_S:
                os.killpg(self.pgid, 0)  # raises once no process of the group is left
                time.sleep(0.2)
        except ProcessLookupError:
            return time.monotonic() - started
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        raise AssertionError(f"server still running {STOP_TIMEOUT_S} s after {signum}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


SAMPLE = re.compile(r'^(eplb_graph_\w+)\{(?:[^}]*,)?rank="(\d+)"[^}]*\} (\S+)$', re.M)


def parse_prometheus(text: str) -> dict[str, dict[str, float]]:
    samples: dict[str, dict[str, float]] = {}
    for name, rank, value in SAMPLE.findall(text):
        samples.setdefault(name, {})[rank] = float(value)
    return samples


def rank_files(directory: Path) -> list[dict]:
    files = sorted(directory.glob("rank*.json"))
    assert [f.name for f in files] == ["rank0.json", "rank1.json"], files
    return [json.loads(f.read_text()) for f in files]

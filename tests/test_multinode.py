"""The demo across two "nodes": two separate ``torchrun`` launches (``--nnodes 2``, node ranks 0
and 1) meeting at one rendezvous endpoint, as they would on two machines.

Both launches run on this machine, so what is exercised is everything a second node changes for
the program: a second launcher, a rank whose ``LOCAL_RANK`` is 0 but whose ``RANK`` is 1, the
TCP store reached through ``MASTER_ADDR:MASTER_PORT``, and EPLB's gloo groups and decisions
between processes that share no parent. The network between real machines is not.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_demo_on_two_nodes_with_one_rendezvous(tmp_path):
    found = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    torchrun = os.path.abspath(found)  # the launches run in their own working directories
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launches = []
    for node in (0, 1):
        workdir = tmp_path / f"node{node}"
        workdir.mkdir()
        command = [
            torchrun,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "eplb_graph.demo",
            *("--steps", "90", "--layers", "2", "--experts", "8", "--redundant", "4"),
            *("--window-size", "12", "--step-interval", "40"),
            *("--json", "report.json", "--no-plot", "--no-progress"),
        ]
        launches.append(
            subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for launch in launches:
            outputs.append(launch.communicate(timeout=600)[0])
    finally:
        for launch in launches:
            launch.kill()
    for node, (launch, output) in enumerate(zip(launches, outputs, strict=True)):
        assert launch.returncode == 0, f"node {node}:\n{output[-3000:]}"
    # Rank 0 (on node 0) writes the report for the whole job; node 1 writes nothing.
    report = json.loads((tmp_path / "node0" / "report.json").read_text())
    assert not (tmp_path / "node1" / "report.json").exists()
    assert report["ranks"] == 2
    assert report["rearrangements"] >= 1 and report["layers_committed"] >= 1
    assert report["bytes_moved"] > 0  # weights crossed between the two launches
    assert report["recompiles"] == 0 and report["graph_breaks"] == 0
    assert report["weights_exact"] is True
    assert report["max_abs_diff"] == 0.0

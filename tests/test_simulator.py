"""Trace format, generator and the simulator (real control plane, no weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb_graph import RuntimeSettings
from eplb_graph.simulate import (
    ClusterShape,
    LoadTrace,
    TraceError,
    TraceSpec,
    generate_trace,
    load_trace,
    save_trace,
    simulate,
    transfers_between,
)

SMALL = TraceSpec(
    num_layers=3,
    num_experts=16,
    top_k=2,
    num_steps=600,
    skew=1.2,
    drift_sigma=0.3,
    segment_steps=50,
    prefill_fraction=0.3,
    prefill_tokens=256,
    decode_tokens=32,
)


def test_generated_trace_shape_and_normalization():
    trace = generate_trace(SMALL)
    assert trace.popularity.shape == (12, 3, 16)
    assert np.allclose(trace.popularity.sum(axis=2), SMALL.top_k, atol=1e-4)
    assert trace.num_steps == 600
    assert 0.2 < trace.is_prefill.mean() < 0.4
    # Drift: consecutive segments differ; lognormal noise keeps every expert's share positive.
    assert not np.allclose(trace.popularity[0], trace.popularity[1])
    assert (trace.popularity > 0).all()
    assert np.allclose(trace.step_load(5), trace.popularity[0] * trace.tokens[5])


def test_trace_round_trip(tmp_path):
    trace = generate_trace(SMALL)
    path = tmp_path / "trace.npz"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert np.array_equal(loaded.popularity, trace.popularity)
    assert np.array_equal(loaded.segment, trace.segment)
    assert np.array_equal(loaded.tokens, trace.tokens)
    assert np.array_equal(loaded.is_prefill, trace.is_prefill)
    assert loaded.top_k == trace.top_k


def _arrays():
    return dict(
        popularity=np.ones((2, 1, 4), dtype=np.float32),
        segment=np.array([0, 1, 1], dtype=np.int32),
        tokens=np.array([3, 3, 3], dtype=np.int32),
        is_prefill=np.array([True, False, False]),
        top_k=1,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"popularity": np.ones((1, 4), dtype=np.float32)}, r"popularity must be \[G, L, N\]"),
        ({"segment": np.array([0, 2, 1], dtype=np.int32)}, r"segment ids must be in \[0, 2\)"),
        ({"tokens": np.array([3, -1, 3], dtype=np.int32)}, "tokens must be >= 0"),
        ({"is_prefill": np.array([True])}, r"is_prefill must be \[T\]"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"popularity": -np.ones((2, 1, 4), dtype=np.float32)}, "finite and non-negative"),
    ],
)
def test_trace_validation_messages(change, message):
    arrays = _arrays()
    arrays.update(change)
    with pytest.raises(TraceError, match=message):
        LoadTrace(**arrays)


def test_trace_file_errors(tmp_path):
    missing = tmp_path / "missing.npz"
    np.savez(missing, popularity=np.ones((1, 1, 2)))
    with pytest.raises(TraceError, match="missing arrays"):
        load_trace(missing)
    garbage = tmp_path / "garbage.npz"
    garbage.write_text("not a zip")
    with pytest.raises(TraceError, match=r"not a readable \.npz trace"):
        load_trace(garbage)


def test_transfers_between_counts_cross_rank_copies_once_per_rank():
    old = torch.tensor([[0, 1, 2, 3]])  # rank 0: {0, 1}, rank 1: {2, 3}
    new = torch.tensor([[0, 0, 2, 1]])  # rank 0 keeps 0 (twice: local copy), rank 1 gains 1
    assert transfers_between(old, new, 2).tolist() == [1]
    assert transfers_between(old, old, 2).tolist() == [0]


def test_simulation_balances_better_than_eplb_off_and_reports_churn():
    trace = generate_trace(SMALL)
    settings = RuntimeSettings(window_size=40, step_interval=150, policy="default")
    cluster = ClusterShape(num_redundant=8, num_ranks=4, expert_bytes=1000)
    report = simulate(trace, settings, cluster)
    assert report.balancedness > report.balancedness_baseline + 0.05
    # Closes at 37 (150 // 4), 187, 337, 487: every close replans on new evidence.
    assert [r.step for r in report.rebalances] == [37, 187, 337, 487]
    assert report.rearrangements == 4
    for record in report.rebalances:
        assert 0.0 < record.slots_changed <= 1.0
        assert record.bytes_moved == record.transfers * 1000
    data = report.as_dict()
    assert data["steps"] == 600
    assert len(data["series_step"]) == len(data["series_balancedness"]) > 100


def test_phase_filter_changes_what_the_policy_sees():
    trace = generate_trace(SMALL)
    cluster = ClusterShape(num_redundant=8, num_ranks=4)
    results = {
        phase: simulate(
            trace,
            RuntimeSettings(
                window_size=40, step_interval=150, policy="default", load_collection_phase=phase
            ),
            cluster,
        )
        for phase in ("prefill", "decode")
    }
    assert results["prefill"].rebalances[0].window_balancedness != pytest.approx(
        results["decode"].rebalances[0].window_balancedness
    )


def test_simulate_cli_writes_json_and_png(tmp_path, capsys):
    import argparse
    import json

    from eplb_graph.simulate.command import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    json_path, png_path = tmp_path / "sim.json", tmp_path / "sim.png"
    args = parser.parse_args(
        [
            "simulate",
            "--layers", "2", "--experts", "8", "--top-k", "2", "--steps", "300",
            "--segment-steps", "30", "--window-size", "20", "--step-interval", "80",
            "--num-redundant", "4", "--ranks", "4", "--policy", "default", "--policy", "random",
            "--json", str(json_path), "--plot", str(png_path), "--no-progress",
        ]
    )  # fmt: skip
    assert args.handler(args) == 0
    report = json.loads(json_path.read_text())
    assert [r["policy"] for r in report["reports"]] == ["default", "random"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "balancedness" in capsys.readouterr().out


def test_simulate_cli_rejects_unknown_policy(capsys):
    import argparse

    from eplb_graph.simulate.command import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--steps", "10", "--policy", "nope", "--no-progress"])
    assert args.handler(args) == 2
    assert "unknown EPLB policy 'nope'" in capsys.readouterr().err


def _write_npz_members(path, members: dict[str, bytes]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _valid_members() -> dict[str, bytes]:
    arrays = _arrays()
    return {
        "popularity": _npy_bytes(arrays["popularity"]),
        "segment": _npy_bytes(arrays["segment"]),
        "tokens": _npy_bytes(arrays["tokens"]),
        "is_prefill": _npy_bytes(arrays["is_prefill"]),
        "top_k": _npy_bytes(np.array(arrays["top_k"])),
        "format_version": _npy_bytes(np.array(1)),
    }


def test_trace_loader_refuses_a_huge_declared_shape_before_allocating(tmp_path):
    import io

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6, 256)}
    )
    members = _valid_members()
    members["popularity"] = header.getvalue()  # the header alone: no data follows
    path = tmp_path / "huge.npz"
    _write_npz_members(path, members)
    with pytest.raises(TraceError, match="popularity has 256000000000000 elements"):
        load_trace(path)


@pytest.mark.parametrize(
    ("name", "array", "message"),
    [
        ("popularity", np.ones((2, 3)), "popularity must be a float"),
        ("segment", np.zeros(4, dtype=np.float64), "segment must be an integer"),
        ("tokens", np.array([1, 2, 2**40, 4]), r"tokens values must be in \[0, 2147483647\]"),
        ("top_k", np.array([2]), "top_k must be a 0-d integer"),
        ("format_version", np.array(7), "format_version 7"),
    ],
)
def test_trace_loader_names_the_bad_array(tmp_path, name, array, message):
    members = _valid_members()
    members[name] = _npy_bytes(array)
    path = tmp_path / "bad.npz"
    _write_npz_members(path, members)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_trace_loader_refuses_non_regular_and_damaged_files(tmp_path):
    import os

    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)  # would block a plain open() forever
    with pytest.raises(TraceError, match="not a regular file"):
        load_trace(fifo)
    with pytest.raises(TraceError, match="not a regular file"):
        load_trace(tmp_path)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match=r"not a readable \.npz trace"):
        load_trace(empty)
    good = tmp_path / "good.npz"
    _write_npz_members(good, _valid_members())
    assert load_trace(good).top_k == _arrays()["top_k"]
    damaged = bytearray(good.read_bytes())
    damaged[60:80] = bytes(20)  # inside the first member's data
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(bytes(damaged))
    with pytest.raises(TraceError, match=r"corrupt\.npz"):
        load_trace(corrupt)

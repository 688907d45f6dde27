"""Expert-map JSON: every defect class, round trips, atomic writes and ``map validate``."""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from eplb_graph import EplbError, Placement, PlacementError, cli, safe_files
from eplb_graph import expert_map as expert_map_module
from eplb_graph.expert_map import (
    MAX_EXPERT_MAP_BYTES,
    ExpertMapError,
    ExpertMapFileError,
    expert_map_document,
    load_expert_map,
    parse_expert_map,
)


def document(layers: int = 2, experts: int = 6, redundant: int = 2, devices: int = 2) -> dict:
    placement = Placement.default(layers, experts, redundant, devices)
    return expert_map_document(placement.phy2log, placement.num_ranks)


def random_placement(seed: int, layers: int, experts: int, devices: int, slots: int) -> Placement:
    """A valid placement with no expert twice on one device (expressible in the schema)."""
    generator = torch.Generator().manual_seed(seed)
    table = []
    for _layer in range(layers):
        rows: list[list[int]] = [[] for _ in range(devices)]
        for position, expert in enumerate(torch.randperm(experts, generator=generator).tolist()):
            rows[position // slots].append(expert)
        for row in rows:
            while len(row) < slots:
                free = [e for e in range(experts) if e not in row]
                row.append(free[int(torch.randint(len(free), (1,), generator=generator))])
        table.append([e for row in rows for e in row])
    return Placement(table, experts, devices)


def fails(document: Any, match: str, num_logical: int | None = None, **where: int | None):
    with pytest.raises(ExpertMapError, match=match) as info:
        parse_expert_map(document, num_logical=num_logical)
    for key, value in where.items():
        assert getattr(info.value, key) == value, (key, str(info.value))
    return info.value


# -- file-level defects ---------------------------------------------------------------------------
def test_malformed_json_reports_line_and_column(tmp_path):
    path = tmp_path / "map.json"
    path.write_text('{\n  "moe_layer_count": 1,\n  "layer_list": [,]\n}')
    with pytest.raises(ExpertMapError, match=r"malformed JSON at line 3, column 18") as info:
        load_expert_map(path)
    assert info.value.path == str(path) and str(path) in str(info.value)


def test_non_utf8_nan_and_duplicate_keys_are_rejected(tmp_path):
    path = tmp_path / "map.json"
    path.write_bytes(b'{"moe_layer_count": \xff}')
    with pytest.raises(ExpertMapError, match="not UTF-8 text"):
        load_expert_map(path)
    path.write_text('{"moe_layer_count": NaN, "layer_list": []}')
    with pytest.raises(ExpertMapError, match="NaN is not valid JSON"):
        load_expert_map(path)
    path.write_text('{"moe_layer_count": 1, "moe_layer_count": 2, "layer_list": []}')
    with pytest.raises(ExpertMapError, match="duplicate key 'moe_layer_count'"):
        load_expert_map(path)


def test_unreadable_file_is_an_os_error_not_a_map_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_expert_map(tmp_path / "missing.json")
    with pytest.raises(IsADirectoryError):
        load_expert_map(tmp_path)


# -- hostile files: bounded time and memory --------------------------------------------------------
def _load_with_deadline(path: Path, seconds: float = 20.0) -> BaseException | None:
    """``load_expert_map(path)`` in a thread; fails the test (after unblocking a FIFO reader)
    if it has not returned within ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            load_expert_map(path)
        except BaseException as error:  # handed to the test thread
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # hands the reader an EOF
        os.close(descriptor)
        thread.join(5)
        pytest.fail(f"load_expert_map({path}) was still blocked after {seconds} s")
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "map.json"
    os.mkfifo(fifo)
    error = _load_with_deadline(fifo)
    assert isinstance(error, ExpertMapFileError), error
    assert "is a FIFO (named pipe), not a regular file" in str(error)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    assert "is a FIFO" in str(_load_with_deadline(link))


def test_refused_file_is_an_os_error_and_an_eplb_error_not_a_map_error(tmp_path):
    """Unreadable input (fix the path) stays apart from a bad map (fix the map)."""
    link = tmp_path / "map.json"
    link.symlink_to(os.devnull)
    with pytest.raises(ExpertMapFileError) as info:
        Placement.load_expert_map(link)
    error = info.value
    assert isinstance(error, OSError) and isinstance(error, EplbError)
    assert not isinstance(error, ExpertMapError)
    assert (error.errno, error.filename, error.path) == (errno.EINVAL, str(link), str(link))
    assert error.strerror.startswith("is a character device (the link resolves to /dev/null)")
    assert str(error) == f"expert map {link}: {error.strerror}"
    copy_ = pickle.loads(pickle.dumps(error))
    assert type(copy_) is ExpertMapFileError and str(copy_) == str(error)
    assert copy_.errno == errno.EINVAL


def test_oversize_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "map.json"
    with path.open("wb") as handle:
        handle.truncate(MAX_EXPERT_MAP_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ExpertMapFileError, match=f"over the {MAX_EXPERT_MAP_BYTES}-byte limit"):
        load_expert_map(path)
    assert MAX_EXPERT_MAP_BYTES == 64 << 20


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc")
def test_a_file_larger_than_its_reported_size_is_cut_at_the_cap(monkeypatch):
    """``/proc`` files report 0 bytes: the cap holds for the bytes actually read."""
    monkeypatch.setattr(expert_map_module, "MAX_EXPERT_MAP_BYTES", 64)
    with pytest.raises(ExpertMapFileError, match="is more than 64 bytes, over the 64-byte limit"):
        load_expert_map("/proc/self/status")


# One child process loads each hostile file under an address-space limit (so a regression fails
# the test instead of exhausting the machine) and reports what it raised, how long it took and how
# much its peak memory grew.
_CHILD = r"""
import json, resource, sys, time
from eplb_graph.expert_map import load_expert_map
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), resource.RLIM_INFINITY))
for path in sys.argv[2:]:
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    try:
        load_expert_map(path)
        kinds, message = [], ""
    except BaseException as error:
        kinds, message = [kind.__name__ for kind in type(error).__mro__], str(error)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"path": path, "kinds": kinds, "message": message,
                      "seconds": time.monotonic() - start, "grown_kib": grown}), flush=True)
"""


def _address_space_now() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc and RLIMIT_AS")
def test_hostile_files_cost_bounded_time_and_memory(tmp_path):
    """A FIFO, a link to /dev/zero and one huge id in a 300-byte map: each refused in well under
    a second with no memory growth (the unbounded reader blocked, read until memory ran out, and
    allocated a [L, id] table: 5.2 GB for an id of 10**8)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    paths = [str(fifo), str(zero)]
    for expert in (10**8, 3 * 10**9, 2**62):
        doc = document(layers=1, experts=6, redundant=2, devices=2)
        doc["layer_list"][0]["device_list"][1]["device_expert"][2] = expert
        path = tmp_path / f"id-{expert}.json"
        path.write_text(json.dumps(doc))
        paths.append(str(path))
    # The child's imports already hold most of its address space; allow 4 GiB more.
    limit = _address_space_now() + (4 << 30)
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        finished = subprocess.run(
            [sys.executable, "-c", _CHILD, str(limit), *paths],
            capture_output=True,
            text=True,
            timeout=180,
            env=environment,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("loading the hostile files did not finish within 180 s (a FIFO blocked?)")
    reports = {report["path"]: report for report in map(json.loads, finished.stdout.splitlines())}
    assert len(reports) == len(paths), finished.stderr[-2000:]
    assert "ExpertMapFileError" in reports[str(fifo)]["kinds"]
    assert "character device (the link resolves to /dev/zero)" in reports[str(zero)]["message"]
    for expert, path in zip((10**8, 3 * 10**9, 2**62), paths[2:], strict=True):
        report = reports[path]
        assert report["kinds"][0] == "ExpertMapError", report
        assert f"layer 0, device 1, slot 2: expert id {expert} is too large" in report["message"]
    for report in reports.values():
        assert report["seconds"] < 5, report
        assert report["grown_kib"] < 64 * 1024, report


def test_huge_ids_are_refused_before_anything_sized_by_them():
    """Inferred N = max id + 1 would size a [L, N] table; a given N larger than the slots too."""
    doc = document(layers=2, experts=6, redundant=2, devices=2)
    doc["layer_list"][1]["device_list"][0]["device_expert"][1] = 2**62
    fails(
        doc,
        r"layer 1, device 0, slot 1: expert id 4611686018427387904 is too large for a map of 8 "
        r"slots per layer: every expert 0..max id needs a slot in every layer, so ids are < 8",
        layer=1,
        device=0,
        slot=1,
    )
    # A given N past int64 is compared with no id (torch would overflow or wrap).
    for num_logical in (9, 10**12, 2**63 - 1, 2**63, 2**70):
        fails(
            document(layers=2, experts=6, redundant=2, devices=2),
            f"the model has N={num_logical} logical experts but a layer has only 8 slots",
            num_logical=num_logical,
        )


def test_deep_nesting_is_a_map_error(tmp_path):
    path = tmp_path / "map.json"
    for text in ("[" * 100_000, '{"layer_list": ' * 50_000):
        path.write_text(text)
        with pytest.raises(ExpertMapError, match="nested too deeply"):
            load_expert_map(path)


def test_huge_integer_literals_are_map_errors_naming_where(tmp_path):
    path = tmp_path / "map.json"
    path.write_text('{"moe_layer_count": 1' + "0" * 10_000 + ', "layer_list": []}')
    with pytest.raises(ExpertMapError, match=r"moe_layer_count: integer 1000.* has 10001 digits"):
        load_expert_map(path)
    doc = document(layers=1)
    doc["layer_list"][0]["device_list"][1]["device_expert"][2] = 10**30
    path.write_text(json.dumps(doc))
    with pytest.raises(
        ExpertMapError,
        match=r"layer_list\[0\]\.device_list\[1\]\.device_expert\[2\]: integer 1000.* 31 digits",
    ):
        load_expert_map(path)
    doc["layer_list"][0]["device_list"][1]["device_expert"][2] = 10**20 - 1  # 20 digits: read
    path.write_text(json.dumps(doc))
    with pytest.raises(
        ExpertMapError, match="slot 2: expert id 99999999999999999999 does not fit in a 64-bit"
    ):
        load_expert_map(path)
    doc["layer_list"][0]["device_count"] = 2**70
    fails(doc, "layer 0: device_count 1180591620717411303424 does not fit in a 64-bit", layer=0)


@pytest.mark.parametrize(
    "raw",
    [b"\xc0\xaf", b'{"moe_layer_count": "\xed\xa0\x80"}', "{}".encode("utf-16")],
    ids=["overlong", "surrogate", "utf-16"],
)
def test_text_that_is_not_utf8_is_a_map_error(tmp_path, raw):
    path = tmp_path / "map.json"
    path.write_bytes(raw)
    with pytest.raises(ExpertMapError, match="not UTF-8 text"):
        load_expert_map(path)


def test_duplicate_keys_are_refused_at_any_depth_naming_where(tmp_path):
    doc = json.dumps(document(layers=1))
    doubled = doc.replace('"device_id": 1,', '"device_id": 1, "device_id": 1,')
    path = tmp_path / "map.json"
    path.write_text(doubled)
    with pytest.raises(
        ExpertMapError,
        match=r"layer_list\[0\]\.device_list\[1\]\.device_id: duplicate key 'device_id'",
    ):
        load_expert_map(path)


def test_values_in_messages_are_quoted_briefly():
    doc = document()
    doc["moe_layer_count"] = list(range(100_000))
    fails(doc, r"moe_layer_count must be an integer, got an array \[\.\.\.\]$")
    doc["moe_layer_count"] = "x" * 100_000
    error = fails(doc, "moe_layer_count must be an integer, got a string")
    assert len(str(error)) < 200
    doc["moe_layer_count"] = 10**5000  # str() of it would raise past 4300 digits
    fails(doc, "moe_layer_count of 16610 bits does not fit in a 64-bit integer")


# -- structure ------------------------------------------------------------------------------------
def test_top_level_shape():
    fails([], "the document must be a JSON object, got an array")
    fails({"layer_list": []}, "missing key 'moe_layer_count'")
    fails({"moe_layer_count": 1}, "missing key 'layer_list'")
    doc = document()
    doc["layers"] = 1
    fails(doc, "unknown key 'layers' .allowed: moe_layer_count, layer_list")


def test_wrong_types_bool_is_not_an_int():
    doc = document()
    doc["moe_layer_count"] = "2"
    fails(doc, 'moe_layer_count must be an integer, got a string "2"')
    doc = document()
    doc["moe_layer_count"] = True
    fails(doc, "moe_layer_count must be an integer, got a boolean true")
    doc = document()
    doc["layer_list"][1]["layer_id"] = True
    fails(doc, "layer_id must be an integer, got a boolean", layer=1)
    doc = document()
    doc["layer_list"] = {}
    fails(doc, "layer_list must be a JSON array, got an object")
    doc = document()
    doc["layer_list"][0]["device_list"][1]["device_expert"][2] = False
    fails(doc, "expert id must be an integer, got a boolean", layer=0, device=1, slot=2)
    doc = document()
    doc["layer_list"][0]["device_list"][0]["device_expert"][0] = 1.0
    fails(doc, "expert id must be an integer, got a number 1.0", layer=0, device=0, slot=0)
    doc = document()
    doc["layer_list"][0]["device_list"][0]["device_expert"] = "0 1 2 3"
    fails(doc, "device_expert must be a JSON array, got a string", layer=0, device=0)
    doc = document()
    doc["layer_list"][0]["device_list"][1]["device_id"] = "1"
    fails(doc, r"device_list\[1\].device_id must be an integer", layer=0)
    doc = document()
    doc["layer_list"][1] = [0]
    fails(doc, r"layer_list\[1\] must be a JSON object, got an array", layer=1)


def test_moe_layer_count_must_match_layer_list():
    doc = document(layers=3)
    doc["moe_layer_count"] = 2
    fails(doc, "moe_layer_count is 2 but layer_list has 3 layers")
    doc["moe_layer_count"] = 0
    fails(doc, "moe_layer_count must be >= 1, got 0")


def test_layer_missing_key_is_named():
    doc = document()
    del doc["layer_list"][1]["device_count"]
    fails(doc, r"layer_list\[1\] is missing key 'device_count'", layer=1)


def test_layer_id_duplicates_and_order():
    doc = document(layers=3)
    doc["layer_list"][2]["layer_id"] = 1
    fails(doc, r"layer_id 1 appears twice \(layer_list\[1\] and layer_list\[2\]\)", layer=2)
    doc = document(layers=3)
    doc["layer_list"][0]["layer_id"], doc["layer_list"][1]["layer_id"] = 1, 0
    fails(doc, r"layer_list\[0\] has layer_id 1; list layers in order with layer_id 0..2", layer=0)


def test_device_count_must_match_device_list_and_other_layers():
    doc = document()
    doc["layer_list"][1]["device_count"] = 3
    fails(doc, "device_count is 3 but device_list has 2 devices", layer=1)
    doc["layer_list"][1]["device_count"] = 0
    fails(doc, "device_count must be >= 1, got 0", layer=1)
    doc = document(devices=2)
    doc["layer_list"][1] = document(layers=1, redundant=0, devices=3)["layer_list"][0]
    doc["layer_list"][1]["layer_id"] = 1
    fails(doc, "device_count is 3 but layer 0 has 2; every layer must span the same", layer=1)


def test_device_id_duplicates_and_gaps():
    doc = document(devices=2)
    doc["layer_list"][0]["device_list"][1]["device_id"] = 0
    fails(doc, r"device_id 0 appears twice \(device_list\[0\] and device_list\[1\]\)", layer=0)
    doc["layer_list"][0]["device_list"][1]["device_id"] = 2
    fails(doc, r"device ids must be exactly 0..1 .*missing \[1\], unexpected \[2\]", layer=0)


def test_devices_may_be_listed_in_any_order():
    doc = document()
    reordered = copy.deepcopy(doc)
    reordered["layer_list"][0]["device_list"].reverse()
    assert torch.equal(parse_expert_map(reordered).phy2log, parse_expert_map(doc).phy2log)


def test_unequal_slot_counts_across_devices_and_layers():
    doc = document()
    doc["layer_list"][0]["device_list"][1]["device_expert"].append(5)
    fails(doc, "device_expert has 5 slots but layer 0, device 0 has 4", layer=0, device=1)
    doc = document()
    for device in doc["layer_list"][1]["device_list"]:
        device["device_expert"].pop()
    fails(doc, "has 3 slots but layer 0, device 0 has 4", layer=1, device=0)
    doc = document()
    doc["layer_list"][0]["device_list"][0]["device_expert"] = []
    fails(doc, "device_expert is empty", layer=0, device=0)


# -- content --------------------------------------------------------------------------------------
def test_ids_out_of_range_with_given_num_logical():
    doc = document(experts=6)
    doc["layer_list"][1]["device_list"][1]["device_expert"][3] = 9
    fails(
        doc,
        r"layer 1, device 1, slot 3: expert id 9 is out of range \[0, 6\)",
        num_logical=6,
        layer=1,
        device=1,
        slot=3,
    )
    doc["layer_list"][1]["device_list"][1]["device_expert"][3] = -1
    fails(doc, "expert id -1 is negative", layer=1, device=1, slot=3)


def test_num_logical_is_inferred_as_max_id_plus_one():
    placement = parse_expert_map(document(experts=6))
    assert placement.num_logical == 6
    # Inference cannot see that expert 6 is missing everywhere; an explicit N can.
    fails(document(experts=6), "logical expert 6 is on no device", num_logical=7, layer=0)
    for bad in (0, True, 2.0):
        with pytest.raises(PlacementError, match="num_logical must be an integer >= 1") as info:
            parse_expert_map(document(), num_logical=bad)
        assert isinstance(info.value, ValueError) and not isinstance(info.value, ExpertMapError)


def test_logical_expert_absent_from_a_layer():
    doc = document(layers=2, experts=6, redundant=2, devices=2)
    # layer 1: replace expert 3 (its only slot: device 0, slot 3) by 5 (not yet on device 0)
    doc["layer_list"][1]["device_list"][0]["device_expert"][3] = 5
    fails(doc, "layer 1: logical expert 3 is on no device", num_logical=6, layer=1)


def test_duplicate_expert_on_one_device():
    doc = document()
    doc["layer_list"][1]["device_list"][1]["device_expert"][3] = 4
    fails(doc, "layer 1, device 1: expert 4 appears in slots 0, 3", layer=1, device=1)


def test_error_type_and_pickling():
    error = fails({"moe_layer_count": 1}, "missing key")
    assert isinstance(error, PlacementError) and isinstance(error, ValueError)
    copy_ = pickle.loads(pickle.dumps(ExpertMapError("bad", path="m.json", layer=1, slot=2)))
    assert (copy_.path, copy_.layer, copy_.device, copy_.slot) == ("m.json", 1, None, 2)
    assert str(copy_) == "expert map m.json: layer 1, slot 2: bad"


# -- round trip and writing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seed", "layers", "experts", "devices", "slots"),
    [(0, 1, 4, 2, 2), (1, 3, 6, 2, 4), (2, 4, 16, 4, 5), (3, 2, 8, 8, 1)],
)
def test_save_then_load_round_trips(tmp_path, seed, layers, experts, devices, slots):
    placement = random_placement(seed, layers, experts, devices, slots)
    path = tmp_path / "map.json"
    placement.save_expert_map(path)
    assert Placement.load_expert_map(path, num_logical=experts) == placement
    assert Placement.load_expert_map(str(path)) == placement
    assert json.loads(path.read_text()) == expert_map_document(
        placement.phy2log, placement.num_ranks
    )


def test_saved_file_has_the_vllm_ascend_schema(tmp_path):
    path = tmp_path / "map.json"
    Placement([[0, 1, 2, 0], [1, 2, 0, 2]], 3, 2).save_expert_map(path)
    assert json.loads(path.read_text()) == {
        "moe_layer_count": 2,
        "layer_list": [
            {
                "layer_id": 0,
                "device_count": 2,
                "device_list": [
                    {"device_id": 0, "device_expert": [0, 1]},
                    {"device_id": 1, "device_expert": [2, 0]},
                ],
            },
            {
                "layer_id": 1,
                "device_count": 2,
                "device_list": [
                    {"device_id": 0, "device_expert": [1, 2]},
                    {"device_id": 1, "device_expert": [0, 2]},
                ],
            },
        ],
    }


def test_save_refuses_a_placement_the_schema_cannot_express(tmp_path):
    path = tmp_path / "map.json"
    path.write_text("old")
    with pytest.raises(ExpertMapError, match="layer 0, device 0: expert 0 appears in slots 0, 2"):
        Placement([[0, 1, 0, 1]], 2, 1).save_expert_map(path)
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["map.json"]


def _old_map(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "map.json"
    Placement.default(2, 4, 0, 2).save_expert_map(path)
    return path, path.read_text()


@pytest.mark.parametrize("crash_in", ["write", "fsync", "replace"])
def test_crash_mid_write_keeps_the_old_map(tmp_path, monkeypatch, crash_in):
    path, before = _old_map(tmp_path)
    new = Placement([[3, 2, 1, 0], [0, 1, 2, 3]], 4, 2)

    class Crash(RuntimeError):
        pass

    if crash_in == "write":
        real_tempfile = safe_files.tempfile.NamedTemporaryFile

        def crashing_tempfile(*args, **kwargs):
            """The temporary file gets half the bytes, then the process "dies"."""
            handle = real_tempfile(*args, **kwargs)
            real_write = handle.write

            def write(text):
                real_write(text[: len(text) // 2])
                handle.flush()
                raise Crash("power cut")

            handle.write = write
            return handle

        monkeypatch.setattr(safe_files.tempfile, "NamedTemporaryFile", crashing_tempfile)
    elif crash_in == "fsync":
        monkeypatch.setattr(safe_files.os, "fsync", _raiser(Crash))
    else:
        monkeypatch.setattr(safe_files.os, "replace", _raiser(Crash))
    with pytest.raises(Crash):
        new.save_expert_map(path)
    assert path.read_text() == before
    assert Placement.load_expert_map(path) == Placement.default(2, 4, 0, 2)
    assert sorted(os.listdir(tmp_path)) == ["map.json"], "temporary file left behind"


def _raiser(error: type[BaseException]):
    def raise_(*_args, **_kwargs):
        raise error("crash")

    return raise_


def test_overwrite_keeps_the_file_mode(tmp_path):
    path, _ = _old_map(tmp_path)
    path.chmod(0o640)
    Placement.default(1, 4, 0, 2).save_expert_map(path)
    assert path.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "fresh.json"
    Placement.default(1, 4, 0, 2).save_expert_map(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o644


def test_save_into_missing_directory_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Placement.default(1, 4, 0, 2).save_expert_map(tmp_path / "no" / "map.json")


def test_summary_counts_replicas():
    summary = Placement([[0, 1, 2, 0], [1, 2, 0, 2]], 3, 2).summary()
    assert summary == {
        "layers": 2,
        "devices": 2,
        "slots_per_device": 2,
        "num_slots": 4,
        "num_logical": 3,
        "num_redundant": 1,
        "max_replicas": 2,
        "replicas_histogram": {"1": 4, "2": 2},
    }


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_valid_map_exit_0_prints_summary_and_json(tmp_path, capsys):
    path = tmp_path / "map.json"
    Placement.default(2, 6, 2, 2).save_expert_map(path)
    report_path = tmp_path / "report.json"
    assert cli.main(["map", "validate", str(path), "--json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert "valid:" in out and "slots_per_device" in out and "replicas_histogram" in out
    report = json.loads(report_path.read_text())
    assert report["valid"] is True and report["error"] is None
    assert report["summary"] == Placement.default(2, 6, 2, 2).summary()


def test_cli_invalid_map_exit_1_prints_error_and_json(tmp_path, capsys):
    doc = document()
    doc["layer_list"][1]["device_list"][1]["device_expert"][3] = 4
    path = tmp_path / "map.json"
    path.write_text(json.dumps(doc))
    report_path = tmp_path / "report.json"
    assert cli.main(["map", "validate", str(path), "--json", str(report_path)]) == 1
    assert "expert 4 appears in slots 0, 3" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["valid"] is False and report["summary"] is None
    assert "layer 1, device 1" in report["error"]


def test_cli_num_logical_catches_experts_missing_everywhere(tmp_path):
    path = tmp_path / "map.json"
    Placement.default(1, 6, 2, 2).save_expert_map(path)
    assert cli.main(["map", "validate", str(path)]) == 0
    assert cli.main(["map", "validate", str(path), "--num-logical", "7"]) == 1


def test_cli_io_and_usage_errors_exit_2(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    missing = str(tmp_path / "missing.json")
    assert cli.main(["map", "validate", missing, "--json", str(report_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    report = json.loads(report_path.read_text())
    assert report["valid"] is False and "cannot read" in report["error"]
    for argv in (["map", "validate"], ["map", "validate", missing, "--num-logical", "0"], ["map"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    path = tmp_path / "map.json"
    Placement.default(1, 4, 0, 2).save_expert_map(path)
    unwritable = str(tmp_path / "no" / "report.json")
    assert cli.main(["map", "validate", str(path), "--json", unwritable]) == 2


def test_cli_refused_files_exit_2_before_reading(tmp_path, capsys):
    """A file that is not a regular file, or too large, is unreadable input (exit 2), never an
    invalid map (exit 1), and is reported without being read."""
    device = tmp_path / "device.json"
    device.symlink_to(os.devnull)
    huge = tmp_path / "huge.json"
    with huge.open("wb") as handle:
        handle.truncate(MAX_EXPERT_MAP_BYTES + 1)
    report_path = tmp_path / "report.json"
    for path, problem in ((device, "is a character device"), (huge, "is 67108865 bytes, over the")):
        assert cli.main(["map", "validate", str(path), "--json", str(report_path)]) == 2
        assert f"cannot read {path}: {problem}" in capsys.readouterr().err
        report = json.loads(report_path.read_text())
        assert report["valid"] is False and problem in report["error"]

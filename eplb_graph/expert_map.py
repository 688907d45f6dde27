"""Expert-map JSON files (vllm-ascend's schema): strict loading, atomic saving, summaries.

Schema::

    {"moe_layer_count": L,
     "layer_list": [{"layer_id": l, "device_count": D,
                     "device_list": [{"device_id": d, "device_expert": [e, ...]}, ...]}, ...]}

``device_expert[k]`` is the logical expert in local slot ``k`` of EP rank ``device_id``, so
global slot ``p = device_id * S + k`` (``S`` slots per device) and ``phy2log[l, p] = e``.

Why strict: upstream checks only the file suffix and existence, and a hand-edited map with a
missing expert or a duplicated slot loads "fine" and then routes tokens to the wrong weights. Here
every defect is an :class:`ExpertMapError` naming the layer, device and slot, raised before a
placement exists. Why bounded: a map path can name anything (a FIFO that never ends, a link to
``/dev/zero``, a file with one id of 10**9), so reading refuses what is not a regular file, caps
the bytes read and the size of every number, and checks every id before allocating anything sized
by one. Why atomic: the record mode rewrites the map every rebalance cycle; a crash mid-write must
leave the previous map, never half of a new one.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from eplb_graph import strict_json
from eplb_graph.safe_files import RefusedFileError, read_regular_file, write_text_atomically
from eplb_graph.tables import PlacementError, replica_counts, validate_phy2log

#: The largest expert-map file read, in bytes. Real maps are small (58 layers x 32 devices x 9
#: slots is about 20 KB); the cap bounds what a wrong path or a hostile file can cost.
MAX_EXPERT_MAP_BYTES = 64 << 20
#: The longest integer literal read, in digits: a longer one cannot fit the int64 table (shorter
#: ones that do not fit are refused at their layer, device and slot).
MAX_INTEGER_DIGITS = 20

_TOP_KEYS = ("moe_layer_count", "layer_list")
_LAYER_KEYS = ("layer_id", "device_count", "device_list")
_DEVICE_KEYS = ("device_id", "device_expert")


class ExpertMapError(PlacementError):
    """An expert-map document is malformed; the message says where and what.

    Attributes:
        path: the file, if the map came from one.
        layer / device / slot: position of the defect (``None`` where not applicable): ``layer``
            indexes ``layer_list``, ``device`` is a ``device_id`` (or a ``device_list`` index
            before ids are known), ``slot`` indexes ``device_expert``.
    """

    def __init__(
        self,
        problem: str,
        *,
        path: str | os.PathLike | None = None,
        layer: int | None = None,
        device: int | None = None,
        slot: int | None = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.layer, self.device, self.slot = layer, device, slot
        self.problem = problem
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("layer", layer), ("device", device), ("slot", slot))
            if value is not None
        )
        prefix = f"expert map {self.path}: " if self.path is not None else "expert map: "
        super().__init__(prefix + (f"{where}: " if where else "") + problem)

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {"path": self.path, "layer": self.layer, "device": self.device, "slot": self.slot}
        return _rebuild_error, (self.problem, kwargs)


def _rebuild_error(problem: str, kwargs: dict[str, Any]) -> ExpertMapError:
    return ExpertMapError(problem, **kwargs)


class ExpertMapFileError(RefusedFileError):
    """A path cannot be read as an expert map: not a regular file (after symlinks), or larger
    than :data:`MAX_EXPERT_MAP_BYTES`; refused before its content is read.

    An ``OSError`` (through :class:`~eplb_graph.safe_files.RefusedFileError`), not an
    :class:`ExpertMapError`: like a missing file it is input that cannot be read (fix the path),
    not a map whose content is wrong (fix the map), so ``eplb-graph map validate`` exits 2 for it.
    """

    def __str__(self) -> str:
        return f"expert map {self.path}: {self.problem}"


class ExpertMapTable(NamedTuple):
    """An expert map's content: ``phy2log [L, P]`` int64 and its shape facts.

    ``Placement.load_expert_map`` turns it into a placement; this module deals in tables only,
    so the file format does not depend on the value object built from it.
    """

    phy2log: torch.Tensor
    num_logical: int
    num_ranks: int


# -- reading ------------------------------------------------------------------------------------
def load_expert_map(path: str | os.PathLike, num_logical: int | None = None) -> ExpertMapTable:
    """Read and validate an expert-map file; returns its table.

    Args:
        path: JSON file in the schema above.
        num_logical: N, the model's logical expert count. If ``None`` it is inferred as
            ``max id + 1``; inference cannot notice that the highest-numbered experts are
            missing from every layer, so pass N whenever it is known.

    Raises:
        OSError: the file cannot be read (missing, a directory, permissions).
        ExpertMapFileError: an ``OSError`` too: the path (after symlinks) is not a regular file
            (a FIFO, a device, a socket), or it holds more than :data:`MAX_EXPERT_MAP_BYTES`.
        ExpertMapError: the content is not a valid map.
    """
    raw = read_regular_file(
        path, max_bytes=MAX_EXPERT_MAP_BYTES, what="an expert map", error=ExpertMapFileError
    )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ExpertMapError(
            f"not UTF-8 text (bad byte at offset {error.start}); expert maps are JSON", path=path
        ) from None
    return parse_expert_map(_parse_json(text, path), num_logical=num_logical, path=path)


def _parse_json(text: str, path: str | os.PathLike | None) -> Any:
    try:
        return strict_json.loads(text, max_integer_digits=MAX_INTEGER_DIGITS)
    except strict_json.StrictJsonError as error:
        raise ExpertMapError(str(error), path=path) from None


class _Checker:
    """Structural checks with error positions; one instance per document."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path

    def fail(self, problem: str, **where: int | None) -> NoReturn:
        raise ExpertMapError(problem, path=self.path, **where)

    def object(self, value: Any, what: str, keys: tuple[str, ...], **where: int | None) -> dict:
        if not isinstance(value, Mapping):
            self.fail(f"{what} must be a JSON object, got {_json_type(value)}", **where)
        missing = [key for key in keys if key not in value]
        if missing:
            self.fail(
                f"{what} is missing key {missing[0]!r} (required: {', '.join(keys)})", **where
            )
        extra = [key for key in value if key not in keys]
        if extra:
            self.fail(f"{what} has unknown key {extra[0]!r} (allowed: {', '.join(keys)})", **where)
        return dict(value)

    def integer(self, value: Any, what: str, **where: int | None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(
                f"{what} must be an integer, got {_json_type(value)} {_short(value)}", **where
            )
        if value.bit_length() > 63:  # the table is int64; no valid id or count comes close
            shown = value if value.bit_length() <= 128 else f"of {value.bit_length()} bits"
            self.fail(f"{what} {shown} does not fit in a 64-bit integer", **where)
        return value

    def array(self, value: Any, what: str, **where: int | None) -> list:
        if not isinstance(value, list):
            self.fail(f"{what} must be a JSON array, got {_json_type(value)}", **where)
        return value


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _short(value: Any) -> str:
    """A bounded quote of a value: containers are elided, not serialized."""
    if isinstance(value, (list, dict)):
        return "[...]" if isinstance(value, list) else "{...}"
    text = json.dumps(value[:40] if isinstance(value, str) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_expert_map(
    document: Any, num_logical: int | None = None, *, path: str | os.PathLike | None = None
) -> ExpertMapTable:
    """Validate a parsed expert-map document and return its table.

    Checks, in order (the first failure is raised): top-level shape; ``moe_layer_count`` equals
    the number of layers; each layer's ``layer_id`` is unique and equals its position; every
    layer has the same ``device_count``, equal to its ``device_list`` length; ``device_id`` values
    are exactly ``0..D-1`` (any order); every ``device_expert`` has the same number of slots and
    holds integers; ids are in ``[0, N)``; no device holds an expert twice; every logical expert
    has a slot in every layer.
    """
    if num_logical is not None and (
        isinstance(num_logical, bool) or not isinstance(num_logical, int) or num_logical < 1
    ):
        # A wrong argument, not a wrong map: a PlacementError (a ValueError), not ExpertMapError.
        raise PlacementError(f"num_logical must be an integer >= 1, got {num_logical!r}")
    check = _Checker(path)
    top = check.object(document, "the document", _TOP_KEYS)
    layer_count = check.integer(top["moe_layer_count"], "moe_layer_count")
    if layer_count < 1:
        check.fail(f"moe_layer_count must be >= 1, got {layer_count}")
    layers = check.array(top["layer_list"], "layer_list")
    if len(layers) != layer_count:
        check.fail(
            f"moe_layer_count is {layer_count} but layer_list has {len(layers)} layers; "
            "make them agree"
        )
    table = [_parse_layer(check, index, entry) for index, entry in enumerate(layers)]
    seen_ids: dict[int, int] = {}
    for index, (layer_id, _rows) in enumerate(table):
        if layer_id in seen_ids:
            check.fail(
                f"layer_id {layer_id} appears twice (layer_list[{seen_ids[layer_id]}] and "
                f"layer_list[{index}]); each layer is listed once",
                layer=index,
            )
        seen_ids[layer_id] = index
        if layer_id != index:
            check.fail(
                f"layer_list[{index}] has layer_id {layer_id}; list layers in order with "
                f"layer_id 0..{layer_count - 1}",
                layer=index,
            )
    _check_uniform_shape(check, table)
    experts = torch.tensor([rows for _layer_id, rows in table], dtype=torch.int64)  # [L, D, S]
    num_logical = _check_ids(check, experts, num_logical)
    _check_no_duplicates_per_device(check, experts)
    counts = replica_counts(experts.flatten(1), num_logical)
    missing = (counts == 0).nonzero()
    if len(missing):
        layer, expert = (int(i) for i in missing[0])
        check.fail(
            f"logical expert {expert} is on no device (of N={num_logical}); every expert needs at "
            "least one slot in every layer",
            layer=layer,
        )
    num_layers, num_devices, _slots = experts.shape
    phy2log = experts.reshape(num_layers, -1)
    try:
        validate_phy2log(phy2log, num_logical, num_devices)
    except PlacementError as error:
        check.fail(str(error))
    return ExpertMapTable(phy2log, num_logical, num_devices)


def _parse_layer(check: _Checker, index: int, entry: Any) -> tuple[int, list[list[int]]]:
    """One ``layer_list`` entry -> ``(layer_id, rows)`` with rows ordered by ``device_id``."""
    layer = check.object(entry, f"layer_list[{index}]", _LAYER_KEYS, layer=index)
    layer_id = check.integer(layer["layer_id"], "layer_id", layer=index)
    device_count = check.integer(layer["device_count"], "device_count", layer=index)
    if device_count < 1:
        check.fail(f"device_count must be >= 1, got {device_count}", layer=index)
    devices = check.array(layer["device_list"], "device_list", layer=index)
    if len(devices) != device_count:
        check.fail(
            f"device_count is {device_count} but device_list has {len(devices)} devices; "
            "make them agree",
            layer=index,
        )
    by_id: dict[int, tuple[int, list[int]]] = {}
    for position, device_entry in enumerate(devices):
        device = check.object(
            device_entry, f"device_list[{position}]", _DEVICE_KEYS, layer=index, device=position
        )
        device_id = check.integer(
            device["device_id"], f"device_list[{position}].device_id", layer=index
        )
        if device_id in by_id:
            check.fail(
                f"device_id {device_id} appears twice (device_list[{by_id[device_id][0]}] and "
                f"device_list[{position}]); each device is listed once",
                layer=index,
            )
        slots = check.array(device["device_expert"], "device_expert", layer=index, device=device_id)
        if not slots:
            check.fail(
                "device_expert is empty; every device needs >= 1 slot",
                layer=index,
                device=device_id,
            )
        for slot, value in enumerate(slots):
            check.integer(value, "expert id", layer=index, device=device_id, slot=slot)
        by_id[device_id] = (position, slots)
    expected = set(range(device_count))
    if set(by_id) != expected:
        missing = sorted(expected - set(by_id))
        unexpected = sorted(set(by_id) - expected)
        check.fail(
            f"device ids must be exactly 0..{device_count - 1} (device_count {device_count}); "
            f"missing {missing}, unexpected {unexpected}",
            layer=index,
        )
    return layer_id, [by_id[device_id][1] for device_id in range(device_count)]


def _check_uniform_shape(check: _Checker, table: list[tuple[int, list[list[int]]]]) -> None:
    """Same device count in every layer; same slot count on every device of every layer."""
    first_rows = table[0][1]
    reference = len(first_rows[0])
    for layer, (_layer_id, rows) in enumerate(table):
        if len(rows) != len(first_rows):
            check.fail(
                f"device_count is {len(rows)} but layer 0 has {len(first_rows)}; every layer "
                "must span the same devices",
                layer=layer,
            )
        for device, row in enumerate(rows):
            if len(row) != reference:
                check.fail(
                    f"device_expert has {len(row)} slots but layer 0, device 0 has {reference}; "
                    "every device holds the same number of slots",
                    layer=layer,
                    device=device,
                )


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_ids(check: _Checker, experts: torch.Tensor, num_logical: int | None) -> int:
    """Range-check ids against N (given, or inferred as max id + 1); returns N.

    Runs before anything sized by an id or by N is allocated. Every expert needs a slot in every
    layer, so N cannot exceed a layer's ``P`` slots: an id >= P is refused here, naming it, rather
    than inferred into an N that sizes a ``[L, N]`` count table (an id of 10**9 would ask for
    gigabytes before any message).
    """
    negative = experts < 0
    if bool(negative.any()):
        layer, device, slot = _first(negative)
        check.fail(
            f"expert id {int(experts[layer, device, slot])} is negative; ids are logical "
            "expert numbers >= 0",
            layer=layer,
            device=device,
            slot=slot,
        )
    _num_layers, num_devices, slots = experts.shape
    num_slots = num_devices * slots
    if num_logical is not None and num_logical > num_slots:  # before comparing ids with it
        check.fail(
            f"the model has N={num_logical} logical experts but a layer has only {num_slots} "
            "slots; every expert needs at least one slot in every layer"
        )
    limit = num_slots if num_logical is None else num_logical
    too_large = experts >= limit
    if bool(too_large.any()):
        layer, device, slot = _first(too_large)
        expert = int(experts[layer, device, slot])
        if num_logical is None:
            problem = (
                f"expert id {expert} is too large for a map of {num_slots} slots per layer: every "
                f"expert 0..max id needs a slot in every layer, so ids are < {num_slots}"
            )
        else:
            problem = (
                f"expert id {expert} is out of range [0, {num_logical}) for a model with "
                f"{num_logical} logical experts"
            )
        check.fail(problem, layer=layer, device=device, slot=slot)
    return int(experts.max()) + 1 if num_logical is None else num_logical


def _check_no_duplicates_per_device(check: _Checker, experts: torch.Tensor) -> None:
    """A device holding one expert twice wastes a slot and cannot be expressed by the per-rank
    logical->local map the runtime derives, so it is a defect (as in vllm-ascend)."""
    ordered = torch.sort(experts, dim=2).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=2)  # [L, D]
    if bool(repeated.any()):
        layer, device = _first(repeated)
        row = experts[layer, device].tolist()
        expert = next(e for e, n in Counter(row).items() if n > 1)
        slots = [slot for slot, e in enumerate(row) if e == expert]
        check.fail(
            f"expert {expert} appears in slots {', '.join(map(str, slots))}; a device holds at "
            "most one copy of an expert",
            layer=layer,
            device=device,
        )


# -- writing ------------------------------------------------------------------------------------
def expert_map_document(phy2log: torch.Tensor, num_ranks: int) -> dict[str, Any]:
    """The JSON document of ``phy2log [L, P]`` (one entry per layer, device ids
    ``0..num_ranks-1``)."""
    num_layers = phy2log.shape[0]
    rows = phy2log.reshape(num_layers, num_ranks, -1).tolist()
    return {
        "moe_layer_count": num_layers,
        "layer_list": [
            {
                "layer_id": layer,
                "device_count": num_ranks,
                "device_list": [
                    {"device_id": device, "device_expert": experts}
                    for device, experts in enumerate(devices)
                ],
            }
            for layer, devices in enumerate(rows)
        ],
    }


def _format(document: dict[str, Any]) -> str:
    """Readable JSON: one line per device (``json.dumps(indent=...)`` would put every id on its
    own line, turning a 58-layer x 32-device map into a 20k-line file)."""

    def lines() -> Iterator[str]:
        yield "{"
        yield f'  "moe_layer_count": {document["moe_layer_count"]},'
        yield '  "layer_list": ['
        layers = document["layer_list"]
        for index, layer in enumerate(layers):
            yield "    {"
            yield f'      "layer_id": {layer["layer_id"]},'
            yield f'      "device_count": {layer["device_count"]},'
            yield '      "device_list": ['
            devices = layer["device_list"]
            for position, device in enumerate(devices):
                comma = "," if position + 1 < len(devices) else ""
                yield f"        {json.dumps(device)}{comma}"
            yield "      ]"
            yield "    }" + ("," if index + 1 < len(layers) else "")
        yield "  ]"
        yield "}"

    return "\n".join(lines()) + "\n"


def save_expert_map(
    phy2log: torch.Tensor, num_logical: int, num_ranks: int, path: str | os.PathLike
) -> None:
    """Write ``phy2log [L, P]`` as an expert map, atomically.

    The document is validated before anything is written (a placement with one expert twice on a
    device cannot be expressed in this schema). The bytes go to a temporary file in the target's
    directory, are fsynced, and replace the target with ``os.replace`` (atomic on POSIX and
    Windows within one filesystem), so readers see either the old map or the new one.

    Raises:
        ExpertMapError: the placement cannot be written in this schema (nothing is written).
        OSError: the directory is missing or not writable (nothing is replaced).
    """
    document = expert_map_document(phy2log, num_ranks)
    parse_expert_map(document, num_logical=num_logical, path=path)
    write_text_atomically(Path(path), _format(document))

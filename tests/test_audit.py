"""The graph-safety audit: goldens for the clean model and each broken sample, the checks one by
one, and the CLI's exit codes.

Goldens are ``expecttest`` inline strings: after an intended change to a report, regenerate
them with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_audit.py`` and review the diff.
Paths are repo-relative (``root=ROOT``); line numbers point into ``tests/broken_models.py``.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import expecttest
import pytest
import torch

import eplb_graph
import eplb_graph.audit.live_tables as probe_module
from eplb_graph import cli
from eplb_graph.audit import (
    AuditReport,
    TargetError,
    TargetRaised,
    alternative_placement,
    hints,
    load_target,
    register_op_body,
    run_audit,
    sync_ops,
)
from eplb_graph.audit.findings import (
    Finding,
    location_from_text,
    location_of_callable,
    relative_location,
)
from eplb_graph.testing import assert_graph_safe
from tests.broken_models import TARGETS

ROOT = Path(__file__).resolve().parents[1]
CLEAN = "eplb_graph.models:audit_target"


@functools.cache
def _audit(spec: str) -> AuditReport:
    target = load_target(spec)
    return run_audit(target.fn, target.example_args, target.eplb_state, target=spec)


def _text(spec: str) -> str:
    return _audit(spec).render_text(root=ROOT)


def _json(spec: str) -> str:
    return _audit(spec).to_json(root=ROOT)


class TestAuditGoldens(expecttest.TestCase):
    def test_clean_model_text(self):
        self.assertExpectedInline(
            _text(CLEAN),
            """\
graph audit of eplb_graph.models:audit_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset

no findings: graph-safe
""",  # noqa: E501
        )

    def test_clean_model_json(self):
        self.assertExpectedInline(
            _json(CLEAN),
            """\
{
  "checks": [
    {
      "findings": 0,
      "name": "graph_breaks",
      "note": "explain(): 1 graph(s), 0 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 0 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    }
  ],
  "clean": true,
  "findings": [],
  "schema_version": 1,
  "target": "eplb_graph.models:audit_target"
}
""",  # noqa: E501
        )

    def test_host_sync_text(self):
        self.assertExpectedInline(
            _text(TARGETS["host_sync"]),
            """\
graph audit of tests.broken_models:host_sync_target

checks:
  graph_breaks   ran      explain(): 2 graph(s), 1 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded; explain() saw 1 break(s): trusting explain() (reported as findings), because fullgraph=True may trace through a break that a default compile, the one serving uses, takes
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset

KIND         LOCATION                   MESSAGE
graph_break  tests/broken_models.py:82  graph break: Unsupported Tensor.item() call with capture_scalar_outputs=False
                                        -> Dynamo does not support tracing `Tensor.item()` with config.capture_scalar_outputs=False.
host_sync    tests/broken_models.py:82  aten._local_scalar_dense reads a device value on the host

2 findings: not graph-safe

how to fix:
- a Python value read from a device tensor (.item(), .tolist(), `if tensor:`) stops the
  graph on the host and freezes that value into it. Keep it on the device: pass the tensor
  itself on (the eplb_graph ops take num_valid_tokens and record_enabled as tensors), and
  replace a branch on a tensor with torch.where(condition, a, b) or arithmetic on a mask.
""",  # noqa: E501
        )

    def test_host_sync_json(self):
        self.assertExpectedInline(
            _json(TARGETS["host_sync"]),
            """\
{
  "checks": [
    {
      "findings": 1,
      "name": "graph_breaks",
      "note": "explain(): 2 graph(s), 1 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded; explain() saw 1 break(s): trusting explain() (reported as findings), because fullgraph=True may trace through a break that a default compile, the one serving uses, takes",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 0 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    }
  ],
  "clean": false,
  "findings": [
    {
      "check": "graph_breaks",
      "detail": "Dynamo does not support tracing `Tensor.item()` with config.capture_scalar_outputs=False.",
      "kind": "graph_break",
      "location": "tests/broken_models.py:82",
      "message": "graph break: Unsupported Tensor.item() call with capture_scalar_outputs=False"
    },
    {
      "check": "host_syncs",
      "detail": "",
      "kind": "host_sync",
      "location": "tests/broken_models.py:82",
      "message": "aten._local_scalar_dense reads a device value on the host"
    }
  ],
  "schema_version": 1,
  "target": "tests.broken_models:host_sync_target"
}
""",  # noqa: E501
        )

    def test_python_int_valid_count_text(self):
        self.assertExpectedInline(
            _text(TARGETS["python_int_valid_count"]),
            """\
graph audit of tests.broken_models:python_int_valid_count_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 1 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, offset

KIND          LOCATION                    MESSAGE
recompile     tests/broken_models.py:112  recompiled after valid-token count: guard `self.state.num_valid_host == 12` failed
python_value  tests/broken_models.py:112  routing state read from a Python value is frozen into the graph: `self.state.num_valid_host == 12` stopped holding after valid-token count
                                          -> keep it in a device tensor of the EPLB state and update it in place

2 findings: not graph-safe
""",  # noqa: E501
        )

    def test_python_int_valid_count_json(self):
        self.assertExpectedInline(
            _json(TARGETS["python_int_valid_count"]),
            """\
{
  "checks": [
    {
      "findings": 0,
      "name": "graph_breaks",
      "note": "explain(): 1 graph(s), 0 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 1 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, offset",
      "status": "ran"
    }
  ],
  "clean": false,
  "findings": [
    {
      "check": "recompiles",
      "detail": "",
      "kind": "recompile",
      "location": "tests/broken_models.py:112",
      "message": "recompiled after valid-token count: guard `self.state.num_valid_host == 12` failed"
    },
    {
      "check": "python_values",
      "detail": "keep it in a device tensor of the EPLB state and update it in place",
      "kind": "python_value",
      "location": "tests/broken_models.py:112",
      "message": "routing state read from a Python value is frozen into the graph: `self.state.num_valid_host == 12` stopped holding after valid-token count"
    }
  ],
  "schema_version": 1,
  "target": "tests.broken_models:python_int_valid_count_target"
}
""",  # noqa: E501
        )

    def test_rebinding_commit_text(self):
        self.assertExpectedInline(
            _text(TARGETS["rebinding_commit"]),
            """\
graph audit of tests.broken_models:rebinding_commit_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset

KIND             LOCATION                    MESSAGE
address_changed  tests/broken_models.py:137  EPLB tensor `log2phy` changed address after commit: captured graphs keep reading the old memory
                                             -> write the new values in place (copy_/fill_) instead of assigning a new tensor

1 finding: not graph-safe
""",  # noqa: E501
        )

    def test_rebinding_commit_json(self):
        self.assertExpectedInline(
            _json(TARGETS["rebinding_commit"]),
            """\
{
  "checks": [
    {
      "findings": 0,
      "name": "graph_breaks",
      "note": "explain(): 1 graph(s), 0 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 0 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    }
  ],
  "clean": false,
  "findings": [
    {
      "check": "addresses",
      "detail": "write the new values in place (copy_/fill_) instead of assigning a new tensor",
      "kind": "address_changed",
      "location": "tests/broken_models.py:137",
      "message": "EPLB tensor `log2phy` changed address after commit: captured graphs keep reading the old memory"
    }
  ],
  "schema_version": 1,
  "target": "tests.broken_models:rebinding_commit_target"
}
""",  # noqa: E501
        )

    def test_dict_lookup_text(self):
        self.assertExpectedInline(
            _text(TARGETS["dict_lookup"]),
            """\
graph audit of tests.broken_models:dict_lookup_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_to_physical, eplb_graph::record_load
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 1 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: load, record_enabled, num_valid_tokens, offset

KIND          LOCATION                    MESSAGE
recompile     tests/broken_models.py:169  recompiled after commit: guard `self.state.first_slot[(0, 0)] == 0` failed
python_value  tests/broken_models.py:169  routing state read from a Python value is frozen into the graph: `self.state.first_slot[(0, 0)] == 0` stopped holding after commit
                                          -> keep it in a device tensor of the EPLB state and update it in place
stale_table   tests/broken_models.py:171  `log2phy` passed to eplb_graph::map_to_physical is not read from the live EplbState.log2phy: commits written in place never reach this routing
                                          -> pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values
stale_table   tests/broken_models.py:171  `replica_count` passed to eplb_graph::map_to_physical is not read from the live EplbState.replica_count: commits written in place never reach this routing
                                          -> pass the EplbState's own `replica_count` or a view of it (state.replica_count[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values

4 findings: not graph-safe
""",  # noqa: E501
        )

    def test_dict_lookup_json(self):
        self.assertExpectedInline(
            _json(TARGETS["dict_lookup"]),
            """\
{
  "checks": [
    {
      "findings": 0,
      "name": "graph_breaks",
      "note": "explain(): 1 graph(s), 0 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_to_physical, eplb_graph::record_load",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 1 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 2,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    }
  ],
  "clean": false,
  "findings": [
    {
      "check": "recompiles",
      "detail": "",
      "kind": "recompile",
      "location": "tests/broken_models.py:169",
      "message": "recompiled after commit: guard `self.state.first_slot[(0, 0)] == 0` failed"
    },
    {
      "check": "python_values",
      "detail": "keep it in a device tensor of the EPLB state and update it in place",
      "kind": "python_value",
      "location": "tests/broken_models.py:169",
      "message": "routing state read from a Python value is frozen into the graph: `self.state.first_slot[(0, 0)] == 0` stopped holding after commit"
    },
    {
      "check": "live_tables",
      "detail": "pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values",
      "kind": "stale_table",
      "location": "tests/broken_models.py:171",
      "message": "`log2phy` passed to eplb_graph::map_to_physical is not read from the live EplbState.log2phy: commits written in place never reach this routing"
    },
    {
      "check": "live_tables",
      "detail": "pass the EplbState's own `replica_count` or a view of it (state.replica_count[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values",
      "kind": "stale_table",
      "location": "tests/broken_models.py:171",
      "message": "`replica_count` passed to eplb_graph::map_to_physical is not read from the live EplbState.replica_count: commits written in place never reach this routing"
    }
  ],
  "schema_version": 1,
  "target": "tests.broken_models:dict_lookup_target"
}
""",  # noqa: E501
        )

    def test_cloned_lookup_text(self):
        self.assertExpectedInline(
            _text(TARGETS["cloned_lookup"]),
            """\
graph audit of tests.broken_models:cloned_lookup_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: replica_count, load, record_enabled, num_valid_tokens, offset

KIND         LOCATION                    MESSAGE
stale_table  tests/broken_models.py:193  `log2phy` passed to eplb_graph::map_and_record is not read from the live EplbState.log2phy: commits written in place never reach this routing
                                         -> pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values

1 finding: not graph-safe
""",  # noqa: E501
        )

    def test_cloned_lookup_json(self):
        self.assertExpectedInline(
            _json(TARGETS["cloned_lookup"]),
            """\
{
  "checks": [
    {
      "findings": 0,
      "name": "graph_breaks",
      "note": "explain(): 1 graph(s), 0 break(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "fullgraph",
      "note": "torch.compile(fullgraph=True) succeeded",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "host_syncs",
      "note": "walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "recompiles",
      "note": "steps: commit, record flag, valid-token count, offset; 0 new graph(s)",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "static_inputs",
      "note": "EPLB tensors read by the graph: replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "addresses",
      "note": "7 EPLB tensors compared across: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 0,
      "name": "python_values",
      "note": "non-tensor guards checked after: commit, record flag, valid-token count, offset",
      "status": "ran"
    },
    {
      "findings": 1,
      "name": "live_tables",
      "note": "eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: replica_count, load, record_enabled, num_valid_tokens, offset",
      "status": "ran"
    }
  ],
  "clean": false,
  "findings": [
    {
      "check": "live_tables",
      "detail": "pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values",
      "kind": "stale_table",
      "location": "tests/broken_models.py:193",
      "message": "`log2phy` passed to eplb_graph::map_and_record is not read from the live EplbState.log2phy: commits written in place never reach this routing"
    }
  ],
  "schema_version": 1,
  "target": "tests.broken_models:cloned_lookup_target"
}
""",  # noqa: E501
        )

    def test_constant_lookup_text(self):
        self.assertExpectedInline(
            _text(TARGETS["constant_lookup"]),
            """\
graph audit of tests.broken_models:constant_lookup_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: replica_count, load, record_enabled, num_valid_tokens, offset

KIND         LOCATION                    MESSAGE
stale_table  tests/broken_models.py:220  `log2phy` passed to eplb_graph::map_and_record is not read from the live EplbState.log2phy: commits written in place never reach this routing
                                         -> pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values

1 finding: not graph-safe
""",  # noqa: E501
        )

    def test_per_step_copy_text(self):
        self.assertExpectedInline(
            _text(TARGETS["per_step_copy"]),
            """\
graph audit of tests.broken_models:per_step_copy_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: replica_count, load, record_enabled, num_valid_tokens, offset

KIND         LOCATION                    MESSAGE
stale_table  tests/broken_models.py:249  `log2phy` passed to eplb_graph::map_and_record is not read from the live EplbState.log2phy: commits written in place never reach this routing
                                         -> pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values

1 finding: not graph-safe
""",  # noqa: E501
        )

    def test_stale_view_text(self):
        self.assertExpectedInline(
            _text(TARGETS["stale_view"]),
            """\
graph audit of tests.broken_models:stale_view_target

checks:
  graph_breaks   ran      explain(): 1 graph(s), 0 break(s)
  fullgraph      ran      torch.compile(fullgraph=True) succeeded
  host_syncs     ran      walked 1 ATen graph(s); op bodies audited: eplb_graph::map_and_record
  recompiles     ran      steps: commit, record flag, valid-token count, offset; 0 new graph(s)
  static_inputs  ran      EPLB tensors read by the graph: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset
  addresses      ran      7 EPLB tensors compared across: commit, record flag, valid-token count, offset
  python_values  ran      non-tensor guards checked after: commit, record flag, valid-token count, offset
  live_tables    ran      eager call after commit, record flag, valid-token count, offset; live EPLB tensors read: replica_count, load, record_enabled, num_valid_tokens, offset

KIND             LOCATION                    MESSAGE
address_changed  tests/broken_models.py:137  EPLB tensor `log2phy` changed address after commit: captured graphs keep reading the old memory
                                             -> write the new values in place (copy_/fill_) instead of assigning a new tensor
stale_table      tests/broken_models.py:277  `log2phy` passed to eplb_graph::map_and_record is not read from the live EplbState.log2phy: commits written in place never reach this routing
                                             -> pass the EplbState's own `log2phy` or a view of it (state.log2phy[layer]) on every call; a clone, a buffer filled at init, a constant, a Python-side mirror or a view of a tensor the state replaced keeps old values

2 findings: not graph-safe
""",  # noqa: E501
        )


# -- each broken sample is flagged, finding by finding ------------------------------------------


def _kinds(spec: str) -> list[tuple[str, str]]:
    report = _audit(spec).relative_to(ROOT)
    return [(finding.kind, finding.location) for finding in report.findings]


def _line_of(marker: str, path: str = "tests/broken_models.py") -> str:
    """``path:N`` of the one line carrying ``marker`` (keeps the asserts readable)."""
    lines = (ROOT / path).read_text().splitlines()
    matches = [number for number, line in enumerate(lines, 1) if marker in line]
    assert len(matches) == 1, marker
    return f"{path}:{matches[0]}"


def test_clean_model_is_clean_and_fast():
    started = time.perf_counter()
    target = load_target(CLEAN)
    report = run_audit(target.fn, target.example_args, target.eplb_state)
    elapsed = time.perf_counter() - started
    assert report.clean, report.render_text(ROOT)
    assert [check.status for check in report.checks] == ["ran"] * 8
    assert elapsed < 60, f"audit of the project's model took {elapsed:.1f} s"


def test_host_sync_sample_is_flagged():
    line = _line_of("num_valid = state.num_valid_tokens.item()")
    assert _kinds(TARGETS["host_sync"]) == [("graph_break", line), ("host_sync", line)]


def test_python_int_valid_count_sample_is_flagged():
    line = _line_of("state.num_valid_host, dtype")
    assert _kinds(TARGETS["python_int_valid_count"]) == [
        ("recompile", line),
        ("python_value", line),
    ]


def test_rebinding_commit_sample_is_flagged():
    line = _line_of("self.log2phy = fresh.to(self.device)")
    assert _kinds(TARGETS["rebinding_commit"]) == [("address_changed", line)]


def test_dict_lookup_sample_is_flagged():
    line = _line_of("table = torch.tensor(slots")
    op_line = _line_of("physical = map_to_physical(logical_ids, table, ones")
    assert _kinds(TARGETS["dict_lookup"]) == [
        ("recompile", line),
        ("python_value", line),
        ("stale_table", op_line),
        ("stale_table", op_line),
    ]
    messages = [finding.message for finding in _audit(TARGETS["dict_lookup"]).findings[2:]]
    assert messages[0].startswith("`log2phy` passed to eplb_graph::map_to_physical")
    assert messages[1].startswith("`replica_count` passed to eplb_graph::map_to_physical")


def _route_call_after(marker: str) -> str:
    """``path:N`` of the op call right after the line carrying ``marker`` (the line it names)."""
    path, line = _line_of(marker).rsplit(":", 1)
    assert "return map_and_record(" in (ROOT / path).read_text().splitlines()[int(line)]
    return f"{path}:{int(line) + 1}"


@pytest.mark.parametrize(
    ("sample", "marker"),
    [
        ("cloned_lookup", 'lookup = getattr(self, f"log2phy_{layer}")'),
        ("constant_lookup", "lookup = torch.tensor(self.lookup_rows[layer]"),
        ("per_step_copy", "lookup = state.routing_copy[layer]"),
        ("stale_view", "lookup = self.lookup_views[layer]"),
    ],
)
def test_routing_through_a_copy_of_the_lookup_is_flagged(sample, marker):
    """A clone, a constant, a per-step copy, a view of a replaced tensor: commits never reach
    routing, although the graph compiles once, never syncs and never recompiles."""
    report = _audit(TARGETS[sample])
    stale = [finding for finding in report.findings if finding.kind == "stale_table"]
    assert [finding.relative_to(ROOT).location for finding in stale] == [_route_call_after(marker)]
    (finding,) = stale
    assert finding.check == "live_tables"
    assert finding.message == (
        "`log2phy` passed to eplb_graph::map_and_record is not read from the live "
        "EplbState.log2phy: commits written in place never reach this routing"
    )
    assert "state.log2phy[layer]" in finding.detail
    others = [finding.kind for finding in report.findings if finding.kind != "stale_table"]
    assert others == (["address_changed"] if sample == "stale_view" else [])


def test_a_state_that_rebinds_is_not_a_copy_when_the_model_reads_it_each_call():
    """The rebinding sample reads ``state.log2phy`` afresh: it moves (a finding), but routing
    follows the commit, so it is not reported as reading a copy."""
    assert "stale_table" not in [kind for kind, _ in _kinds(TARGETS["rebinding_commit"])]


# -- the checks in isolation ----------------------------------------------------------------------

_FLAG = torch.tensor(True)


def _sync_zoo(x: torch.Tensor) -> torch.Tensor:
    mask = x > 0
    masked = x[mask]
    nonzero = torch.nonzero(x)
    counts = torch.bincount((x.abs() * 3).long().flatten(), minlength=4)
    zeroed = x.clone()
    zeroed[mask] = 0
    branch = torch.cond(_FLAG, lambda a: a + 1, lambda a: a - 1, (x,))
    return masked.sum() + nonzero.sum() + counts.sum() + zeroed.sum() + branch.sum()


def _zoo_line(text: str) -> int:
    lines, first = __import__("inspect").getsourcelines(_sync_zoo)
    return first + next(index for index, line in enumerate(lines) if text in line)


def test_aten_walk_flags_masks_nonzero_bincount_and_cond_without_state():
    report = run_audit(_sync_zoo, (torch.randn(4, 3),), None, checks=["host_syncs"])
    found = {
        (finding.kind, int(finding.location.rsplit(":", 1)[1]))
        for finding in report.findings
        if finding.location.startswith(__file__)
    }
    assert found == {
        ("host_sync", _zoo_line("x[mask]")),
        ("dynamic_shape", _zoo_line("torch.nonzero")),
        ("dynamic_shape", _zoo_line("torch.bincount")),
        ("host_sync", _zoo_line("zeroed[mask] = 0")),
        ("host_sync", _zoo_line("torch.cond")),
    }


def _masked_dispatch(x: torch.Tensor, expert_of_token: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(3):
        chosen = torch.where(expert_of_token == expert)[0]  # one-argument where: nonzero
        out[chosen] = x[expert_of_token == expert] * (expert + 1)  # boolean mask
    return out


def test_dispatch_findings_show_the_graph_safe_pattern_once():
    args = (torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    report = run_audit(_masked_dispatch, args, None, checks=["graph_breaks", "host_syncs"])
    kinds = {finding.kind for finding in report.findings}
    assert {"host_sync", "dynamic_shape"} <= kinds
    text = report.render_text(root=ROOT)
    _, _, fixes = text.partition("\nhow to fix:\n")
    assert fixes.count("Dispatch on fixed shapes instead") == 1
    assert "".join(f"      {line}\n" for line in hints.DISPATCH_EXAMPLE.splitlines()) in fixes
    assert "index_select" in fixes and "scatter_add_" in fixes


def test_the_dispatch_pattern_of_the_hint_is_graph_safe_and_right():
    """The advice is run, not only printed: it must audit clean and compute the routed sum."""
    source = "def dispatch(x, physical_ids, gates, expert_weights, top_k):\n"
    source += "".join(f"    {line}\n" for line in hints.DISPATCH_EXAMPLE.splitlines())
    source += "    return y\n"
    namespace: dict = {}
    exec(compile(source, "<hints.DISPATCH_EXAMPLE>", "exec"), {"torch": torch}, namespace)
    dispatch = namespace["dispatch"]
    tokens, hidden, slots, top_k = 6, 4, 5, 2
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.randint(-1, slots, (tokens, top_k), generator=generator)
    ids[0, 0] = -1  # a padded choice contributes nothing
    gates = torch.rand(tokens, top_k, generator=generator)
    weights = torch.randn(slots, hidden, hidden, generator=generator)
    expected = torch.zeros_like(x)
    for token in range(tokens):
        for choice in range(top_k):
            slot = int(ids[token, choice])
            if slot >= 0:
                expected[token] += gates[token, choice] * (x[token] @ weights[slot])
    args = (x, ids, gates, weights, top_k)
    torch.testing.assert_close(dispatch(*args), expected)
    assert run_audit(dispatch, args, None).clean


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("aten.index with a boolean mask (nonzero on the host)", "DYNAMIC_SHAPE_HINT"),
        ("aten.nonzero has a data-dependent output shape", "DYNAMIC_SHAPE_HINT"),
        ("graph break: Dynamic shape operator", "DYNAMIC_SHAPE_HINT"),
        ("aten._local_scalar_dense reads a device value on the host", "HOST_VALUE_HINT"),
        ("Data-dependent branching", "HOST_VALUE_HINT"),
        ("EPLB tensor `log2phy` changed address after commit", None),
    ],
)
def test_hints_follow_the_defect(text, expected):
    assert hints.hint_for_text(text) == (getattr(hints, expected) if expected else None)


def test_commit_checks_are_skipped_not_failed_without_state():
    report = run_audit(lambda x: x * 2, (torch.ones(3),), None)
    assert report.clean
    statuses = {check.name: check.status for check in report.checks}
    assert statuses == {
        "graph_breaks": "ran",
        "fullgraph": "ran",
        "host_syncs": "ran",
        "recompiles": "skipped",
        "static_inputs": "skipped",
        "addresses": "skipped",
        "python_values": "skipped",
        "live_tables": "skipped",
    }
    assert "eplb_state is None" in report.as_dict()["checks"][3]["note"]


def test_fullgraph_and_explain_are_both_reported():
    def branches(x):
        if x.sum() > 0:  # data-dependent branch: a break under explain, an error in fullgraph
            return x + 1
        return x - 1

    report = run_audit(branches, (torch.ones(3),), None, checks=["graph_breaks", "fullgraph"])
    kinds = [finding.kind for finding in report.findings]
    assert kinds == ["graph_break", "fullgraph_failed"]
    assert all("Data-dependent branching" in finding.message for finding in report.findings)


def test_custom_op_bodies_are_audited(monkeypatch):
    from eplb_graph.ops.reference import map_and_record_ref

    def syncing_body(*args):
        if bool(args[5].item() > 0):  # a host read hidden inside the op body
            pass
        return map_and_record_ref(*args)

    monkeypatch.setitem(sync_ops._OP_BODIES, "eplb_graph::map_and_record", syncing_body)
    target = load_target(CLEAN)
    report = run_audit(target.fn, target.example_args, target.eplb_state, checks=["host_syncs"])
    (finding,) = report.findings
    assert finding.kind == "host_sync"
    assert "inside the body of eplb_graph::map_and_record" in finding.message
    call_site = _line_of("physical_ids = map_and_record(", "eplb_graph/models/tiny_moe.py")
    assert finding.relative_to(ROOT).location == call_site  # the op's call site in the model
    assert finding.detail.startswith(f"op body line: {__file__}:")


def test_register_op_body_is_public(monkeypatch):
    monkeypatch.setattr(sync_ops, "_OP_BODIES", dict(sync_ops._OP_BODIES))
    register_op_body("mylib::route", len)
    handle = torch.ops.eplb_graph.map_to_physical.default
    assert sync_ops.op_body(handle) is sync_ops._OP_BODIES["eplb_graph::map_to_physical"]
    assert sync_ops._OP_BODIES["mylib::route"] is len


def test_classification_uses_op_tags():
    aten = torch.ops.aten
    assert sync_ops.classify_op(aten._local_scalar_dense.default)[0] == "host_sync"
    assert sync_ops.classify_op(aten.is_nonzero.default)[0] == "host_sync"
    assert sync_ops.classify_op(aten.equal.default)[0] == "host_sync"
    assert sync_ops.classify_op(aten.nonzero.default)[0] == "dynamic_shape"
    assert sync_ops.classify_op(aten.repeat_interleave.Tensor)[0] == "dynamic_shape"
    assert sync_ops.classify_op(aten.index.Tensor, [torch.zeros(2, dtype=torch.long)]) is None
    assert sync_ops.classify_op(aten.index.Tensor, [torch.zeros(2, dtype=torch.bool)])
    assert sync_ops.classify_op(aten.topk.default) is None
    assert sync_ops.classify_op(aten.scatter_add.default) is None


def test_audit_leaves_the_state_as_it_found_it():
    target = load_target(TARGETS["rebinding_commit"])
    state = target.eplb_state
    state.set_step_inputs_(7, False)
    before = {name: tensor.clone() for name, tensor in state.graph_tensors().items()}
    placement = state.placement
    run_audit(target.fn, target.example_args, state)
    assert state.placement == placement
    for name, tensor in state.graph_tensors().items():
        assert torch.equal(tensor, before[name]), name


def test_alternative_placement_differs_and_keeps_replica_counts():
    placement = eplb_graph.Placement.default(2, 8, 8, 4)
    other = alternative_placement(placement)
    assert other is not None and other != placement
    assert torch.equal(other.replica_count(), placement.replica_count())
    single = eplb_graph.Placement(torch.zeros(1, 4, dtype=torch.long), 1, 2)
    assert alternative_placement(single) is None


def test_locations_skip_library_frames_and_relativize():
    torch_file = str(Path(torch.__file__).parent / "nn" / "modules" / "module.py")
    text = f'File "{ROOT}/tests/x.py", line 3, in f\n  File "{torch_file}", line 9, in g'
    assert location_from_text(text) == f"{ROOT}/tests/x.py:3"
    assert relative_location(f"{ROOT}/tests/x.py:3", ROOT) == "tests/x.py:3"
    assert relative_location("/elsewhere/y.py:4", ROOT) == "/elsewhere/y.py:4"
    with pytest.raises(ValueError, match="unknown finding kind"):
        Finding("typo", "check", "message", "x.py:1")


# -- the live-table check in isolation ------------------------------------------------------------


def _routing_state() -> eplb_graph.EplbState:
    state = eplb_graph.EplbState(eplb_graph.Placement.default(2, 8, 8, 4))
    state.set_step_inputs_(5, True)
    return state


_IDS = torch.tensor([[0, 3], [7, 1], [2, 2], [5, 6], [4, 0]])
_OPS = torch.ops.eplb_graph


class _BufferedLookup(torch.nn.Module):
    """Correct, if roundabout: refreshes its own buffer from the live table on every call and
    casts, clones and views the live tensors inside the call."""

    def __init__(self, state: eplb_graph.EplbState) -> None:
        super().__init__()
        self.state = state
        self.register_buffer("lookup", torch.empty_like(state.log2phy))
        self.first_layer = self.lookup[0]  # a view taken before the buffer is filled

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        self.lookup.copy_(state.log2phy)
        first = _OPS.map_to_physical(ids, self.first_layer, state.replica_count[0], state.offset)
        second = _OPS.map_and_record(
            ids,
            state.log2phy[1].clone().contiguous(),
            state.replica_count[1].to(torch.int64),
            state.offset,
            state.load[1],
            state.num_valid_tokens,
            state.record_enabled,
        )
        return first + second


class _PrivateLoad(torch.nn.Module):
    """Records into its own copy of ``load``: the window never sees that load."""

    def __init__(self, state: eplb_graph.EplbState) -> None:
        super().__init__()
        self.state = state
        self.register_buffer("my_load", state.load[0].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = self.state
        load = self.my_load  # BROKEN: a private copy
        count = s.replica_count[0]
        return _OPS.map_and_record(
            ids, s.log2phy[0], count, s.offset, load, s.num_valid_tokens, s.record_enabled
        )


def _own_routing(state: eplb_graph.EplbState, table: torch.Tensor):
    """Routing without the eplb_graph ops: first replica of each expert, gathered from ``table``."""

    def route(ids: torch.Tensor) -> torch.Tensor:
        return table[0, :, 0].index_select(0, ids.reshape(-1)).view_as(ids)

    return route


def _live_table_findings(fn, state) -> list[Finding]:
    report = run_audit(fn, (_IDS,), state, checks=["live_tables"])
    return report.findings


def test_live_tables_accept_copies_made_from_the_live_tables_inside_the_call():
    state = _routing_state()
    assert _live_table_findings(_BufferedLookup(state), state) == []
    assert _live_table_findings(_own_routing(state, state.log2phy), state) == []


def test_live_tables_flag_a_private_load():
    state = _routing_state()
    (finding,) = _live_table_findings(_PrivateLoad(state), state)
    assert finding.kind == "stale_table"
    assert finding.message.startswith("`load` passed to eplb_graph::map_and_record is not read")
    assert finding.message.endswith("the load it records never reaches the rebalancing window")


def test_live_tables_flag_routing_that_reads_no_live_table_without_the_ops():
    state = _routing_state()
    (finding,) = _live_table_findings(_own_routing(state, state.log2phy.clone()), state)
    assert finding.kind == "stale_table"
    assert finding.message.startswith("no op reads the live EplbState routing tables")
    assert finding.location == location_of_callable(_own_routing(state, state.log2phy))


def test_live_tables_runs_after_the_commit_and_names_what_was_read():
    target = load_target(CLEAN)
    report = run_audit(target.fn, target.example_args, target.eplb_state, checks=["live_tables"])
    (check,) = report.checks
    assert check.note == (
        "eager call after commit, record flag, valid-token count, offset; live EPLB tensors "
        "read: log2phy, replica_count, load, record_enabled, num_valid_tokens, offset"
    )


def test_live_tables_follow_values_not_shapes():
    """``zeros_like(live)`` holds none of the live values; ``empty_like(live).copy_(live)`` does."""
    state = _routing_state()
    stale = state.log2phy[0].clone()

    def shaped_like_live(ids):
        table = torch.zeros_like(state.log2phy[0]).copy_(stale)
        return _OPS.map_to_physical(ids, table, state.replica_count[0], state.offset)

    def filled_from_live(ids):
        table = torch.empty_like(stale).copy_(state.log2phy[0])
        return _OPS.map_to_physical(ids, table, state.replica_count[0], state.offset)

    (finding,) = _live_table_findings(shaped_like_live, state)
    assert finding.message.startswith("`log2phy` passed to eplb_graph::map_to_physical")
    assert _live_table_findings(filled_from_live, state) == []


def test_live_tables_report_a_target_that_fails_under_the_probe():
    """The probe's eager call comes after the steps; a target that fails there is a finding (the
    check could not judge it), never a pass."""
    state = _routing_state()

    def fails_once_recording_is_off(ids):
        if not bool(state.record_enabled):
            raise RuntimeError("recording must stay on")
        return _OPS.map_to_physical(ids, state.log2phy[0], state.replica_count[0], state.offset)

    report = run_audit(fails_once_recording_is_off, (_IDS,), state, checks=["live_tables"])
    (finding,) = report.findings
    assert finding.kind == "compile_error"
    assert finding.message == (
        "the target raised when called eagerly under the live-table probe: recording must stay on"
    )


def test_probe_forgets_a_derivation_once_its_memory_is_freed(monkeypatch):
    """Allocators reuse addresses: once every tensor seen with a storage is gone, a new tensor
    at that address must start underived (here every tensor is given the same address)."""
    probe = probe_module.LiveTableProbe({})
    monkeypatch.setattr(probe_module, "_storage_key", lambda tensor: ("cpu", None, 64))
    derived = torch.ones(4)
    probe._mark(derived, {"log2phy"}, replace=True)
    newcomer = torch.zeros(4)
    assert probe.sources(newcomer) == {"log2phy"}  # same address while `derived` lives: shared
    del derived
    assert probe.sources(newcomer) == set()
    probe._mark(newcomer, set(), replace=False)
    assert probe.sources(newcomer) == set()


# -- targets and the command line -----------------------------------------------------------------


def _not_a_triple():
    return 1, 2


def _raises():
    raise RuntimeError("no model today")


def _bad_state():
    return (lambda x: x), (torch.ones(1),), object()


def _tensor_args():
    return (lambda x: x), torch.ones(1), None


def _eager_failure():
    def fn(x):
        raise ValueError("boom")

    return fn, (torch.ones(1),), None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must look like 'package.module:callable'"),
        ("no_such_module_xyz:target", "cannot import module 'no_such_module_xyz'"),
        ("eplb_graph.models:missing", "has no attribute 'missing'"),
        ("eplb_graph.models:__doc__", "is not callable"),
        ("tests.test_audit:_not_a_triple", "must return (fn, example_args, eplb_state)"),
        ("tests.test_audit:_raises", "raised: RuntimeError: no model today"),
        ("tests.test_audit:_bad_state", "eplb_state must be an EplbState (or None)"),
        ("tests.test_audit:_tensor_args", "example_args must be a tuple or list"),
    ],
)
def test_bad_targets_are_usage_errors(spec, message, capsys):
    with pytest.raises(TargetError) as error:
        load_target(spec)
    assert message in str(error.value)
    assert cli.main(["audit", spec]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("eplb-graph audit: ") and message in captured.err
    assert captured.out == ""


class _Stop(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def _exits_when_built():
    sys.exit(0)


def _exits_with_a_message_when_built():
    raise SystemExit("no model today")


def _stops_when_built():
    raise _Stop("halt")


def _exits_when_called():
    def fn(x):
        sys.exit(0)

    return fn, (torch.ones(1),), None


def _exits_on_its_second_call():
    """Passes the plain eager call, then exits inside the audit's own calls of the target."""
    calls = []

    def fn(x):
        calls.append(x)
        if len(calls) > 1:
            sys.exit(0)
        return x * 2

    return fn, (torch.ones(1),), None


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
@pytest.mark.parametrize(
    ("module_text", "attribute", "expected"),
    [
        ("import sys\nsys.exit(0)\n", "target", "raised SystemExit(0) (sys.exit) while importing"),
        ("raise SystemExit(3)\n", "target", "raised SystemExit(3) (sys.exit) while importing"),
        ("from tests.test_audit import _exits_when_built as target\n", "target", "SystemExit(0)"),
        (
            "from tests.test_audit import _exits_with_a_message_when_built as target\n",
            "target",
            "raised SystemExit('no model today') (sys.exit) when called",
        ),
        ("from tests.test_audit import _stops_when_built as target\n", "target", "_Stop: halt"),
        (
            "from tests.test_audit import _exits_when_called as target\n",
            "target",
            "raised SystemExit(0) (sys.exit) during the audit",
        ),
        (
            "from tests.test_audit import _exits_on_its_second_call as target\n",
            "target",
            "raised SystemExit(0) (sys.exit) during the audit",
        ),
    ],
    ids=[
        "exit-0-at-import",
        "exit-3-at-import",
        "exit-0-in-factory",
        "exit-message-in-factory",
        "base-exception-in-factory",
        "exit-in-first-call",
        "exit-in-a-later-call",
    ],
)
def test_a_target_that_exits_is_a_usage_error_not_a_clean_audit(
    module_text, attribute, expected, tmp_path, monkeypatch, capsys
):
    """``sys.exit(0)`` at import, in the factory or in any call of the target must not end the
    CLI with status 0 and no report: one line naming the target and what it did, exit 2."""
    module = f"exiting_target_{abs(hash(module_text))}"
    (tmp_path / f"{module}.py").write_text(module_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"{module}:{attribute}"
    assert cli.main(["audit", spec]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"eplb-graph audit: TARGET {spec!r} ") or line.startswith(
        f"eplb-graph audit: {spec} "
    )
    assert expected in line and "must not exit the process" in line


def _interrupted_target():
    raise KeyboardInterrupt


def _interrupt(x):
    raise KeyboardInterrupt


def test_keyboard_interrupt_in_a_target_still_interrupts():
    with pytest.raises(KeyboardInterrupt):
        load_target("tests.test_audit:_interrupted_target")
    with pytest.raises(KeyboardInterrupt):
        run_audit(_interrupt, (torch.ones(1),), None)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_a_target_that_exits_during_the_audit_fails_assert_graph_safe():
    fn, args, _ = _exits_on_its_second_call()
    with pytest.raises(TargetRaised, match=r"raised SystemExit\(0\) \(sys.exit\) during"):
        assert_graph_safe(fn, args)


def test_target_failing_eagerly_is_a_usage_error(capsys):
    target = load_target("tests.test_audit:_eager_failure")
    with pytest.raises(TargetRaised, match="boom"):
        run_audit(target.fn, target.example_args, target.eplb_state)
    assert cli.main(["audit", "tests.test_audit:_eager_failure"]) == 2
    assert "raised when called eagerly: boom" in capsys.readouterr().err


def test_cli_exit_codes_and_json(tmp_path, capsys):
    path = tmp_path / "audit.json"
    assert cli.main(["audit", "--json", str(path)]) == 0
    assert "no findings: graph-safe" in capsys.readouterr().out
    clean = json.loads(path.read_text())
    assert clean["clean"] is True and clean["findings"] == []
    assert clean["target"] == CLEAN
    assert cli.main(["audit", TARGETS["rebinding_commit"], "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert report["clean"] is False
    assert {"kind", "message", "location"} <= set(report["findings"][0])
    assert cli.main(["audit", CLEAN, "--json", str(tmp_path / "missing" / "x.json")]) == 2


def test_an_audit_that_cannot_finish_is_exit_2_not_a_finding(monkeypatch, capsys):
    def broken_audit(*args, **kwargs):
        raise RuntimeError("audit bug")

    monkeypatch.setattr("eplb_graph.audit.run_audit", broken_audit)
    assert cli.main(["audit"]) == 2
    assert "the audit itself failed (RuntimeError: audit bug)" in capsys.readouterr().err


def test_tools_wrapper_runs_the_cli():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "graph_audit.py"), "not-a-target"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "TARGET must look like" in result.stderr

from __future__ import annotations

import json

from eplb_graph import cli


def test_info_reports_ops_and_writes_json(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert cli.main(["info", "--build-native", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["ops"] == [
        "local_experts",
        "local_experts_w8a8",
        "map_and_record",
        "map_to_physical",
        "record_load",
    ]
    assert report["native_cpu_kernel"] == "loaded"
    assert "compile:inductor" in report["graph_modes"]
    assert "native_cpu_kernel" in capsys.readouterr().out

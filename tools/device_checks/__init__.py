"""The pieces of ``tools/device_check.py``: one MoE layer routed through eplb-graph's ops
(``layer``), its capture / compile / load / host-sync checks (``graphs``), the routing op's
speed table (``speed``) and the suite's CUDA tests (``suite``).

Each check returns a plain dict with an ``ok`` field (``None`` when it does not apply on this
device), so the driver can write one JSON report and one table whatever ran.
"""

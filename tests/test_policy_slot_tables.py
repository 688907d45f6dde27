"""SlotTables: the counts kept in step with slot edits equal a recount after every edit."""

from __future__ import annotations

import numpy as np

from eplb_graph.policy.slot_tables import SlotTables


def test_reassign_keeps_counts_in_step_with_the_placement():
    rng = np.random.default_rng(0)
    num_layers, num_logical, num_slots, num_ranks = 4, 6, 12, 3
    start = np.stack([rng.permutation(np.arange(num_slots) % num_logical) for _ in range(4)])
    original = start.copy()
    tables = SlotTables.start(start, num_logical, num_ranks)
    assert tables.phy2log is not start and np.array_equal(tables.phy2log, start)
    assert tables.slot_rank.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for _ in range(30):
        layers = rng.choice(num_layers, size=2, replace=False)
        slots = rng.integers(0, num_slots, size=2)
        experts = rng.integers(0, num_logical, size=2)
        tables.reassign_(layers, slots, experts)
        assert (tables.phy2log[layers, slots] == experts).all()
        fresh = SlotTables.start(tables.phy2log, num_logical, num_ranks)
        assert np.array_equal(tables.count, fresh.count)
        assert np.array_equal(tables.on_rank, fresh.on_rank)
    assert np.array_equal(start, original)  # the tables edit a copy

"""Different, valid placements to commit during an audit or a capture regression run.

A permutation of each layer's slots keeps every expert's replica count, so the result always fits
the state's lookup width ``R`` and passes validation, while moving experts to other slots (and
usually other ranks) so a graph that froze the old lookup gives a different answer.
"""

from __future__ import annotations

import torch

from eplb_graph.placement import Placement


def alternative_placement(placement: Placement, shift: int = 1) -> Placement | None:
    """A valid placement differing from ``placement`` in every layer where that is possible.

    Rolls each layer's slots by ``shift`` (then by the next shifts until the row changes).
    Returns ``None`` when no permutation changes any layer (every slot holds the same expert).
    """
    rows = []
    changed = False
    for row in placement.phy2log:
        moved = row
        for step in range(shift, shift + row.numel()):
            candidate = torch.roll(row, shifts=step)
            if not torch.equal(candidate, row):
                moved = candidate
                changed = True
                break
        rows.append(moved)
    if not changed:
        return None
    return Placement(torch.stack(rows), placement.num_logical, placement.num_ranks)


def alternative_placements(placement: Placement, count: int) -> list[Placement]:
    """``count`` placements, each different from the one before (the first from ``placement``)."""
    result: list[Placement] = []
    current = placement
    for _ in range(count):
        following = alternative_placement(current)
        if following is None:
            break
        result.append(following)
        current = following
    return result

"""The documentation names real things: every test the architecture page cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_test_the_architecture_page_cites_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    references = REFERENCE.findall(text)
    assert len(references) > 20  # the table was found
    missing = []
    for file, name in references:
        path = ROOT / file
        if not path.exists():
            missing.append(file)
        elif name and name not in _test_names(path):
            missing.append(f"{file}::{name}")
    assert missing == []

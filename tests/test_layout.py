"""The layout rules of the package, checked on the source: no import circle, no library module
importing tests, no module over the size limit, one importable top-level package.

Imports are read with ``ast`` (module-level and function-level alike: a lazy import is still a
dependency), so the check needs no import side effects and names the offending modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eplb_graph"
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of the package (or ``tests``) that ``path`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [target if target in known else base for target in targets]
        else:
            continue
        found.update(t for t in targets if t in known or t.split(".")[0] == "tests")
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in graph:
                continue
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_import_graph_has_no_circle():
    graph = _graph()
    assert len(graph) > 60  # the walk found the package
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_library_module_imports_tests():
    offenders = {
        name: sorted(t for t in targets if t.split(".")[0] == "tests")
        for name, targets in _graph().items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_tools_do_not_import_tests():
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert offenders == []


def test_no_library_module_is_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}


def test_one_importable_top_level_package():
    top_level = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top_level == {"eplb_graph"}
    assert not list((ROOT / "custom_ops").rglob("*.py"))  # op sources only


def _rearrangement_path() -> tuple[int, list[tuple[str, str]]]:
    """docs/architecture.md's "One rearrangement, file by file": the count it states and its
    table's rows as ``(file, what happens there)``."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## One rearrangement, file by file", 1)[1].split("\n## ", 1)[0]
    stated = int(re.search(r"\*\*(\d+) files\*\*", section).group(1))
    rows = re.findall(r"^\| \d+ \| `([\w/.]+)` \| [^|]+ \| (.+) \|$", section, flags=re.M)
    return stated, rows


def test_one_rearrangement_crosses_the_files_the_architecture_lists():
    """The documented path is the code's: every file exists, every ``Class.method`` named in
    its row is defined in that file, and the count is the one stated (at most 12)."""
    import re

    stated, rows = _rearrangement_path()
    assert len(rows) == stated <= 12
    assert len({file for file, _ in rows}) == len(rows)
    missing = []
    for file, what in rows:
        source = (ROOT / file).read_text()
        for owner, member in re.findall(r"`([A-Z]\w+)\.(\w+)`", what):
            if f"class {owner}" not in source or f"def {member}(" not in source:
                missing.append(f"{file}: {owner}.{member}")
    assert missing == []

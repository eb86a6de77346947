"""The layout shows the architecture: rooms of at most a dozen modules, imports one way (no
circle between modules or folders, nothing below importing what is above), and no two modules
sharing a base name."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("p2p", "gossip", "topologies", "gossipmesh")
MAX_MODULES = 12  # per folder
#: what each layer may import of ours (node.py -> gossipmesh -> gossip -> topologies; p2p alone)
ALLOWED = {
    "node": {"gossipmesh", "gossip", "p2p", "topologies"},
    "gossipmesh": {"gossip", "p2p", "topologies"},
    "gossip": {"topologies"},
    "p2p": set(),
    "topologies": set(),
}


def _modules() -> dict[str, Path]:
    found = {"node": ROOT / "node.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The modules of ours that ``path`` imports at its top or in its functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES}


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    """Module -> module, leaving out the packages' ``__init__`` (they re-export the public names)."""
    g = nx.DiGraph()
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        g.add_node(name)
        for target in _imports(path):
            if MODULES[target].name != "__init__.py" and target != name:
                g.add_edge(name, target)
    return g


def _folder(module: str) -> str:
    return str(MODULES[module].parent.relative_to(ROOT))


def test_no_circle_between_modules_or_folders(graph: nx.DiGraph) -> None:
    assert list(nx.simple_cycles(graph)) == []
    folders = nx.DiGraph((_folder(a), _folder(b)) for a, b in graph.edges if _folder(a) != _folder(b))
    assert list(nx.simple_cycles(folders)) == []


def test_imports_go_one_way(graph: nx.DiGraph) -> None:
    wrong = [
        (a, b)
        for a, b in graph.edges
        if a.split(".")[0] != b.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]
    ]
    assert wrong == []


def test_every_folder_is_a_room_of_a_dozen_modules_at_most() -> None:
    counts = collections.Counter(
        str(path.parent.relative_to(ROOT)) for path in MODULES.values() if path.name not in ("__init__.py",)
    )
    assert {folder: n for folder, n in counts.items() if n > MAX_MODULES} == {}
    assert counts["gossip"] <= 8 and counts["p2p"] <= 8


def test_every_room_of_the_libraries_says_in_one_line_what_it_owns() -> None:
    for name, path in MODULES.items():
        if path.name == "__init__.py" and name.count(".") == 1 and name.startswith(("gossip.", "p2p.")):
            docstring = ast.get_docstring(ast.parse(path.read_text()))
            assert docstring and "\n" not in docstring, name


def test_no_two_modules_share_a_base_name() -> None:
    by_stem = collections.defaultdict(list)
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            by_stem[path.stem].append(name)
    assert {stem: names for stem, names in by_stem.items() if len(names) > 1} == {}

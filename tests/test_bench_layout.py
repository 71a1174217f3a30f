"""The lab's layout: every module of `bench/` sits in a package with one role (`sim`, `burst`,
`perf`, `common`), and no module imports, directly or through others, one that imports it back.

A circle makes the import order decide which names exist when a module's body runs, and it ties
two modules so that neither can be read, moved or tested alone; `TYPE_CHECKING` imports count
too, since they tie the modules for the reader and for mypy the same way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PACKAGES = {"sim", "burst", "perf", "common", "fair"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def bench_modules() -> dict[str, Path]:
    return {module_name(p): p for p in BENCH.rglob("*.py")}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The bench modules `path` imports: `from a.b import c` counts as a.b.c when c is a module,
    else as a.b; relative imports are resolved against the module's own package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = bench_modules()
    return {name: imported(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that starts and ends on the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_no_module_sits_directly_in_bench() -> None:
    loose = sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")
    assert loose == []
    packages = {p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file()}
    assert packages == PACKAGES


def test_the_bench_import_graph_has_no_circle() -> None:
    graph = import_graph()
    assert "bench.perf.rig" in graph["bench.perf.redis_cost"]  # the graph does see imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_circle_and_passes_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imports_are_resolved_from_every_form(tmp_path: Path) -> None:
    known = {"bench.perf", "bench.perf.rig", "bench.perf.scale", "bench.common.stats"}
    source = tmp_path / "scale.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "import bench.common.stats\n"
                      "from . import rig\n"
                      "if TYPE_CHECKING:\n    from bench.perf.scale import Rig\n")
    assert imported("bench.perf.redis_cost", source, known) == {
        "bench.common.stats", "bench.perf.rig", "bench.perf.scale"}

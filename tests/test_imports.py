"""The package imports point one way: no cycle among eagle3/ and capture/ modules, and eagle3 never
imports capture (docs/design.md). Read from the source with ast, function-level imports included,
so a cycle hidden behind a lazy import fails too.

    .venv/bin/python -m pytest tests/test_imports.py -q
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3", "capture")


def modules() -> dict[str, Path]:
    return {f"{pkg}.{f.stem}" if f.stem != "__init__" else pkg: f
            for pkg in PACKAGES for f in sorted((ROOT / pkg).glob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}      # `from eagle3 import data`
    return {m for m in out if m in known} - {name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: dict[str, int] = {}       # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(g):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_no_import_cycle_in_eagle3_and_capture():
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_eagle3_never_imports_capture():
    bad = {m: sorted(n for n in deps if n.split(".")[0] == "capture")
           for m, deps in graph().items() if m.split(".")[0] == "eagle3"}
    assert not {m: d for m, d in bad.items() if d}


def test_the_checker_sees_imports_and_cycles():
    g = graph()
    assert "eagle3.features" in g["capture.hf"] and "eagle3.config" in g["capture.__main__"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []

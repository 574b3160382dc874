#!/usr/bin/env python3
"""The import graph of the product packages, and its cycles.

Reads every module of ``service/ workers/ contract/ storage/ migrations/`` with ``ast`` (nothing is
imported or run), takes every import in it -- at module level and inside functions, relative
ones resolved -- and keeps the edges between product modules. A cycle is a strongly connected
component of more than one module (or a module importing itself). An import of a package
(``from workers.zero import x``) is an edge to its ``__init__``; ``from pkg import mod`` is an
edge to ``pkg.mod`` when that module exists. Imports under ``TYPE_CHECKING`` count too: a
module that names another's type depends on it as much as one that calls it.

Usage: ``python scripts/import_graph.py [--root DIR]``; exits 1 and prints each cycle when
there is one (``tests/test_import_graph.py`` keeps it at zero).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("service", "workers", "contract", "storage", "migrations")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> list[tuple[str, int, tuple[str, ...]]]:
    """(module, relative level, imported names) of every import statement, wherever it is."""
    found: list[tuple[str, int, tuple[str, ...]]] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, 0, ()) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append((child.module or "", child.level, tuple(alias.name for alias in child.names)))
            pending.append(child)
    return found


def build_graph(root: Path) -> dict[str, set[str]]:
    """Each product module and the product modules it imports."""
    files = {module_name(root, path): path for package in PACKAGES
             for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, level, names in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")
                base = base[: len(base) - (level - 1)]
                module = ".".join(base + ([module] if module else []))
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            for target in targets:
                while target and target not in files:  # an attribute of a module: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                elif target == name and level == 0 and not names:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    found = cycles(graph)
    edges = sum(len(targets) for targets in graph.values())
    print(f"{len(graph)} modules, {edges} imports between them, {len(found)} cycle(s)")
    for component in found:
        inner = {m: sorted(graph[m] & set(component)) for m in component}
        print("cycle: " + "; ".join(f"{m} -> {', '.join(t)}" for m, t in inner.items()))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

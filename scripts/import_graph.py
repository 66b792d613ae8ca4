#!/usr/bin/env python3
"""raykv's import graph: every ``raykv`` module and the ``raykv`` modules it imports (at the top
or inside a function: a lazy import is still a dependency), the circles in it, and the imports
that break the layers of ``../shared/DESIGN.md`` (torch only in ``transfer/``, ``model/`` and
the benchmarks that time copies; ray only in ``cluster/``, ``serve/`` and the benchmarks that
drive them).

Usage: python scripts/import_graph.py [--dot]   (exit 1 when it finds a circle or a breach)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raykv"

# where a third-party library may be imported: the layer table's rule, and the modules that
# exist to drive that layer (each named for why)
ALLOWED = {
    # bench.transfer times copies against torch's own; bench.disk_transfer times the disk
    # engine, which reads and writes a torch pool (page-aligned, as a rank's shard is);
    # bench.ttft times transformers' forward
    "torch": (
        "raykv.transfer",
        "raykv.model",
        "raykv.bench.transfer",
        "raykv.bench.disk_transfer",
        "raykv.bench.ttft",
        # raykv inside vLLM: its worker hands vLLM's KV views to the transfer engines
        "raykv.vllm",
    ),
    "ray": ("raykv.cluster", "raykv.serve"),
    "vllm": ("raykv.vllm",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved). ``from
    package import module`` depends on that module, not on the package's ``__init__`` (which
    Python runs first, but which does not depend on what imports it)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return found


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(raykv module -> the raykv modules it imports, raykv module -> third-party tops)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    edges: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in paths.items():
        found = imports_of(path, name, set(paths))
        edges[name] = {m for m in found if m in paths and m != name}
        outside[name] = {m.split(".")[0] for m in found if not m.startswith("raykv")}
    return edges, outside


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def breaches(outside: dict[str, set[str]]) -> list[str]:
    """``module imports library`` for every import outside the library's layers."""
    out = []
    for name, tops in sorted(outside.items()):
        for library, where in ALLOWED.items():
            if library in tops and not any(name == w or name.startswith(w + ".") for w in where):
                out.append(f"{name} imports {library}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print the graph in Graphviz's dot")
    args = parser.parse_args(argv)
    edges, outside = graph()
    if args.dot:
        print("digraph raykv {")
        for name in sorted(edges):
            for target in sorted(edges[name]):
                print(f'  "{name}" -> "{target}";')
        print("}")
    problems = [f"circle: {' -> '.join(c)}" for c in circles(edges)] + breaches(outside)
    for problem in problems:
        print(problem, file=sys.stderr)
    count = sum(len(targets) for targets in edges.values())
    print(f"{len(edges)} modules, {count} imports, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

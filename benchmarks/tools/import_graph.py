"""lmppo's internal import graph read from the source with `ast`: module -> lmppo modules it imports, function-local
imports included (marked `*`), and the strongly connected components (import cycles).

    python benchmarks/tools/import_graph.py [src/lmppo]
"""

from __future__ import annotations

import ast
import os
import sys


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports(root: str) -> dict[str, dict[str, bool]]:
    """module -> {imported lmppo module: imported only inside a function}."""
    modules = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                modules[module_name(root, os.path.join(folder, f))] = os.path.join(folder, f)
    graph: dict[str, dict[str, bool]] = {}
    for mod, path in sorted(modules.items()):
        tree = ast.parse(open(path, encoding="utf-8").read())
        edges: dict[str, bool] = {}
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]

        def visit(node, local: bool, type_checking: bool) -> None:
            for child in ast.iter_child_nodes(node):
                is_local = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                tc = type_checking or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    targets = [base] + [f"{base}.{a.name}" for a in child.names]
                for t in targets:
                    while t and t not in modules:
                        t = t.rpartition(".")[0]
                    if t and t != mod and not tc:
                        edges[t] = edges.get(t, True) and is_local
                visit(child, is_local, tc)

        visit(tree, False, False)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return out


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "src", "lmppo")
    root = os.path.abspath(root)
    graph = imports(root)
    short = lambda m: m.removeprefix("lmppo.") or "lmppo"  # noqa: E731
    local_total = 0
    for mod, edges in graph.items():
        local_total += sum(edges.values())
        targets = ", ".join(short(t) + ("*" if local else "") for t, local in sorted(edges.items()))
        print(f"{short(mod):24s} -> {targets}")
    found = cycles(graph)
    print(
        f"\n{len(graph)} modules; {sum(len(e) for e in graph.values())} edges, {local_total} only inside functions (*)"
    )
    print(f"cycles: {len(found)}" + "".join(f"\n  {len(c)} modules: {', '.join(map(short, c))}" for c in found))


if __name__ == "__main__":
    main()

"""The architecture's seams, checked on the source (AST only, no imports): no import circle in the
package, the engine imported only by the faces and tools, and the engine knowing its proposers and
k policies only through their protocols (no isinstance / hasattr / getattr on them)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "specdec"
FACES_AND_TOOLS = ("specdec.api", "specdec.cli", "specdec.loader", "specdec.tools")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """(module -> specdec modules it imports, [(module, target)] of imports inside functions).
    `from specdec import x` names module specdec.x when x is one; a package and its submodules
    are not an edge unless one imports the other explicitly."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name not in mods:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    graph, nested = {m: set() for m in mods}, []
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # relative: only kernels/__main__ uses them
                base = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
                targets = [f"{base}.{node.module}" if node.module else base]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.startswith("specdec") else None
                if r and r != m:
                    graph[m].add(r)
                    if id(node) not in top:
                        nested.append((m, r))
    return graph, nested


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_cycle_finder_catches_a_circle():
    """Negative control: a two-module circle is found."""
    graph, _ = _graph()
    graph["specdec.config"].add("specdec.sampling")  # sampling imports config
    assert ["specdec.config", "specdec.sampling"] in _cycles(graph)


def test_function_level_imports_only_the_lazy_faces():
    """`import specdec` stays cheap: its LLM attribute imports the API on first use. The CLI
    imports the heavy modules (torch under them) inside `main`'s error guard, so that Ctrl-C
    during start-up is a one-line exit 130, not a traceback. Every other import of the package's
    own modules is at module level."""
    _, nested = _graph()
    assert ("specdec", "specdec.api") in nested
    assert {m for m, _ in nested} <= {"specdec", "specdec.cli"}, nested


def test_engine_imported_only_by_faces_and_tools():
    graph, _ = _graph()
    users = {m for m, deps in graph.items() if any(d.split(".")[:2] == ["specdec", "engine"] for d in deps)
             and not m.startswith("specdec.engine")}
    assert users and all(m.startswith(FACES_AND_TOOLS) for m in users), users


def test_engine_asks_proposers_and_policies_nothing():
    """The engine calls the protocols; it never probes what a proposer or policy is or has."""
    tree = ast.parse((PKG / "engine" / "core.py").read_text())
    probes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "hasattr", "getattr")]
    assert probes == ["isinstance(params, list)"]  # (one SamplingParams or one per prompt)

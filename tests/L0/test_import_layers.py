"""Imports run one way (design §2): no import cycles among the package's modules, and no import
runs back up the layers — the runtime (sharding, masks, ``plan/``, schedules, attention, ...)
never imports ``inspect`` or anything above it, ``inspect`` never imports the planning tools, the
tools never import the Megatron/NeMo integrations or the test helpers.

The graph is read from the source with ``ast`` (nothing is imported), counting imports at module
level, inside functions and under ``TYPE_CHECKING`` alike: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_cp_ext

PKG = "megatron_cp_ext"

LAYERS = (
    ("inspect", 1),
    ("planner", 2),
    ("", 3),  # the package's __init__: the public facade, which also installs the planner's auto chooser
    ("megatron", 4),
    ("recipe_checks", 4),
    ("bridge", 5),
    ("nemo", 6),
    ("testing", 7),
)
"""Rank of a module by its path under the package (exact name or subpackage); every other module
is runtime, rank 0. An import may only go to the same rank or lower."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (the package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from x import name`` counts ``x.name`` when
    that is a module, else ``x``)."""
    mods = modules(root)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names if a.name.split(".")[0] == PKG)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base.split(".")[0] != PKG:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in mods else known(base))
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def rank(mod: str) -> int:
    rel = mod[len(PKG) + 1 :] if mod != PKG else ""
    for prefix, r in LAYERS:
        if rel == prefix or (prefix and rel.startswith(prefix + ".")):
            return r
    return 0


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if rank(b) > rank(a))


ROOT = Path(megatron_cp_ext.__file__).parent


def test_graph_sees_the_package():
    graph = import_graph(ROOT)
    assert len(graph) > 40 and f"{PKG}.plan.calls" in graph[f"{PKG}.schedules.p2p_plan"] | graph[f"{PKG}.plan"]
    assert f"{PKG}.inspect" in graph[f"{PKG}.planner.cost"]


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_no_import_runs_back_up():
    assert back_arrows(import_graph(ROOT)) == []


def test_the_checks_can_fail():
    """A cycle and a back arrow, as the package had them (``bridge`` <-> ``nemo``; the runtime
    reaching the cost model), are found."""
    graph = {f"{PKG}.bridge": {f"{PKG}.nemo"}, f"{PKG}.nemo": {f"{PKG}.bridge"}, f"{PKG}.attention": set()}
    graph[f"{PKG}.attention"].add(f"{PKG}.planner.auto")
    graph[f"{PKG}.planner.auto"] = set()
    assert cycles(graph) == [[f"{PKG}.bridge", f"{PKG}.nemo"]]
    assert back_arrows(graph) == [(f"{PKG}.attention", f"{PKG}.planner.auto"), (f"{PKG}.bridge", f"{PKG}.nemo")]

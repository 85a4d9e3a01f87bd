"""Imports run one way (design §2), and the folders show the layers: no import cycles among the
package's modules, and no import runs back up — ``runtime/`` (checks, groups, comm, ops) under
``masks/``, under ``plan/``, under ``balance/``, under ``sharding/``, under ``backends/`` and
``schedules/``, under ``attention``; then ``inspect``, the planning tools, the public facade, the
Megatron/NeMo/Bridge integrations and the test helpers. Every module sits in a ranked folder or
is one of the few named root modules, so a new file cannot slip in unranked.

The graph is read from the source with ``ast`` (nothing is imported), counting imports at module
level, inside functions and under ``TYPE_CHECKING`` alike: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_cp_ext

PKG = "megatron_cp_ext"

LAYERS = (
    ("runtime", 0),  # validation, groups, comm, inflight, agreement, ops
    ("masks", 1),  # mask spec and blocks, Megatron's mask names, vectorised mask geometry
    ("plan", 2),  # the per-step varlen calls
    ("balance", 3),  # the workload cut and its candidate scoring
    ("sharding", 4),  # CPSharding, shard_sequences, layouts (TE's, bshd/sbhd), the split record
    ("backends", 5),
    ("schedules", 5),
    ("attention", 6),
    ("prepared", 6),
    ("inspect", 7),
    ("planner", 8),
    ("", 9),  # the package's __init__: the public facade, which also installs the planner's auto chooser
    ("megatron", 10),
    ("recipe_checks", 10),
    ("bridge", 11),
    ("nemo", 12),
    ("testing", 13),
)
"""Rank of a module by its path under the package (exact name or folder). An import may only go
to the same rank or lower; a module under no entry is an error (:func:`test_every_module_is_ranked`)."""

ROOT_MODULES_MAX = 8
"""Modules directly in ``megatron_cp_ext/`` (``__init__`` included): the rest live in folders."""


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


def rank(mod: str) -> int | None:
    rel = mod[len(PKG) + 1 :] if mod != PKG else ""
    for prefix, r in LAYERS:
        if rel == prefix or (prefix and rel.startswith(prefix + ".")):
            return r
    return None


def back_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    ranked = [(a, b) for a, targets in graph.items() for b in targets if None not in (rank(a), rank(b))]
    return sorted((a, b) for a, b in ranked if rank(b) > rank(a))


def unranked(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in graph if rank(m) is None)


ROOT = Path(megatron_cp_ext.__file__).parent


def test_graph_sees_the_package():
    graph = import_graph(ROOT)
    assert len(graph) > 40 and f"{PKG}.plan.calls" in graph[f"{PKG}.schedules.p2p_plan"] | graph[f"{PKG}.plan"]
    assert f"{PKG}.inspect" in graph[f"{PKG}.planner.cost"]


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_every_module_is_ranked():
    assert unranked(import_graph(ROOT)) == []


def test_no_import_runs_back_up():
    assert back_arrows(import_graph(ROOT)) == []


def test_root_holds_few_modules():
    """The folders carry the layers: only the facade, the entry points above the schedules and
    the recipe overrides stay at the root."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, root
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders == {prefix for prefix, _ in LAYERS if prefix and (ROOT / prefix).is_dir()}, folders


def test_the_checks_can_fail():
    """A cycle and a back arrow, as the package had them (``bridge`` <-> ``nemo``; the runtime
    reaching the cost model), are found."""
    graph = {f"{PKG}.bridge": {f"{PKG}.nemo"}, f"{PKG}.nemo": {f"{PKG}.bridge"}, f"{PKG}.attention": set()}
    graph[f"{PKG}.attention"].add(f"{PKG}.planner.auto")
    graph[f"{PKG}.planner.auto"] = set()
    graph[f"{PKG}.runtime.ops"] = {f"{PKG}.masks.geometry"}  # a folder reaching up a layer
    graph[f"{PKG}.masks.geometry"] = set()
    graph[f"{PKG}.helpers"] = set()  # a new root module no layer names
    assert cycles(graph) == [[f"{PKG}.bridge", f"{PKG}.nemo"]]
    assert back_arrows(graph) == [
        (f"{PKG}.attention", f"{PKG}.planner.auto"),
        (f"{PKG}.bridge", f"{PKG}.nemo"),
        (f"{PKG}.runtime.ops", f"{PKG}.masks.geometry"),
    ]
    assert unranked(graph) == [f"{PKG}.helpers"]

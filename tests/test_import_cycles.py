"""No import cycles in ``weightsync/``: one concern per module, each layer importing only those below.

The graph is built from the source (``ast``), not by importing, so it sees every import that runs: at
module level and inside functions (a lazy import is still a dependency). A name imported only under
``if TYPE_CHECKING:`` for an annotation runs nothing and is left out. A
package's ``__init__`` is aside: its own imports are re-exports, so it has no outgoing edges, and a
name imported through it is followed to the submodule it re-exports. A failure names every cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "weightsync"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package's ``__init__`` under the package's name)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative ones resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): annotations only."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk(tree: ast.AST) -> Iterable[ast.AST]:
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs: kept)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking(node):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, str | None]]:
    """(module, name) for every import: ``import a.b`` gives (a.b, None); ``from a import b`` gives (a, b)."""
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            for alias in node.names:
                yield target, alias.name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.args[0].value, None  # importlib.import_module("weightsync.x")


def _reexports(modules: dict[str, Path], trees: dict[str, ast.AST]) -> dict[str, dict[str, str]]:
    """For each package: name -> the submodule its ``__init__`` takes it from (``from .x import name``,
    or a lazy table of ``"name": "weightsync.x"`` entries)."""
    out: dict[str, dict[str, str]] = {}
    for mod, path in modules.items():
        if path.name != "__init__.py":
            continue
        names = out.setdefault(mod, {})
        for node in ast.walk(trees[mod]):
            if isinstance(node, ast.ImportFrom):
                src = _absolute(mod, True, node)
                for alias in node.names:
                    names[alias.asname or alias.name] = src
            elif isinstance(node, ast.Dict):  # a PEP 562 table: {"Name": "weightsync.sub", ...}
                for k, v in zip(node.keys, node.values):
                    if (isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Constant)
                            and isinstance(v.value, str) and v.value in modules):
                        names[k.value] = v.value
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the package modules it imports (package ``__init__`` modules have no outgoing edges)."""
    modules = module_files(root)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()}
    reexports = _reexports(modules, trees)

    def resolve(target: str, name: str | None) -> str | None:
        if name is not None and f"{target}.{name}" in modules:
            return f"{target}.{name}"  # from pkg import submodule
        seen = set()
        while name is not None and target in reexports and name in reexports[target] and target not in seen:
            seen.add(target)
            target = reexports[target][name]  # follow the re-export to where the name lives
            if f"{target}.{name}" in modules:
                return f"{target}.{name}"
        while target and target not in modules:  # import a.b.c where only a.b is a module
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        if path.name == "__init__.py":
            continue  # re-exports aside
        for target, name in _imports(trees[mod], mod, path.name == "__init__.py"):
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            got = resolve(target, name)
            if got is not None and got != mod:
                graph[mod].add(got)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
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
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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
                        out.append(sorted(comp))
    return sorted(out)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, as a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def cycles(root: Path = ROOT) -> list[str]:
    graph = import_graph(root)
    return [" -> ".join(shortest_cycle(graph, c)) + (f"  (component: {', '.join(c)})" if len(c) > 2 else "")
            for c in strongly_connected(graph)]


def test_no_import_cycles():
    found = cycles()
    assert not found, (f"{len(found)} import cycle(s) in {PACKAGE}/ (each line: one cycle, then every module "
                       "caught in it); move what both sides need below both:\n  " + "\n  ".join(found))


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path):
    """The checker itself: a cycle through a function-level import is found, one closed only under
    TYPE_CHECKING is not, a re-export through a package ``__init__`` is followed, an acyclic tree passes."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from weightsync.sub.c import thing\n")
    (pkg / "a.py").write_text("def f():\n    from weightsync import b\n")
    (pkg / "b.py").write_text("import weightsync.sub.c\n\ndef g():\n    from .a import f\n")
    (pkg / "sub" / "c.py").write_text("import os\nthing = 1\n")
    (pkg / "d.py").write_text("from weightsync.sub import thing\n")
    graph = import_graph(tmp_path)
    assert graph["weightsync.d"] == {"weightsync.sub.c"}
    assert graph["weightsync.b"] == {"weightsync.a", "weightsync.sub.c"}
    assert cycles(tmp_path) == ["weightsync.a -> weightsync.b -> weightsync.a"]
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    assert cycles(tmp_path) == []


#: the packages of the data path: the planner, the payload interface between codecs and transports, the codecs, the
#: transports, integrity, quantization, checkpoints, the predictor. Among them no package may import, through any
#: chain of their modules, one that imports it back (a new codec or transport then touches its own package only).
DATA_PATH = ("layout", "quant", "plan", "meta", "payload", "integrity", "delta", "codec", "transport", "checkpoint",
             "predict")


def package_graph(graph: dict[str, set[str]], packages: Iterable[str]) -> dict[str, set[str]]:
    """``graph`` folded onto ``packages`` (``weightsync.<name>``): an edge where a module of one imports one of
    another; modules outside them dropped."""
    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in packages else None

    out: dict[str, set[str]] = {p: set() for p in packages}
    for mod, deps in graph.items():
        src = package(mod)
        if src is not None:
            out[src] |= {d for d in map(package, deps) if d is not None and d != src}
    return out


def test_no_package_cycle_in_the_data_path():
    graph = import_graph()
    packages = package_graph(graph, DATA_PATH)
    found = [" -> ".join(shortest_cycle(packages, c)) for c in strongly_connected(packages)]
    why = {(a, b): sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(f"{PACKAGE}.{a}.")
                          for d in deps if d.startswith(f"{PACKAGE}.{b}.") or d == f"{PACKAGE}.{b}")
           for a in packages for b in packages[a]}
    assert not found, ("package cycle(s) among the data path's packages; each edge's imports:\n  " + "\n  ".join(
        f"{c}: " + "; ".join(f"{a}->{b}: {why[(a, b)][:3]}" for a, b in zip(c.split(" -> "), c.split(" -> ")[1:]))
        for c in found))


def test_no_private_name_is_taken_across_packages():
    """A name starting with ``_`` is its package's own: another package importing it (``from weightsync.a.b import
    _x``) leans on what may change without notice; what two packages share is public, below both."""
    found = []
    for mod, path in module_files().items():
        own = mod.split(".")[1] if mod.count(".") else None
        for target, name in _imports(ast.parse(path.read_text()), mod, path.name == "__init__.py"):
            if (name and name.startswith("_") and not name.startswith("__") and target.startswith(PACKAGE + ".")
                    and target.split(".")[1] != own):
                found.append(f"{mod} takes {target}.{name}")
    assert not found, "private names taken across packages:\n  " + "\n  ".join(found)


def test_the_package_graph_folds_modules():
    graph = {"weightsync.a.x": {"weightsync.b.y", "weightsync.c.z"}, "weightsync.b.y": {"weightsync.a.w"},
             "weightsync.a.w": set(), "weightsync.c.z": set()}
    folded = package_graph(graph, ("a", "b"))
    assert folded == {"a": {"b"}, "b": {"a"}}
    assert strongly_connected(folded) == [["a", "b"]]


#: the tooling that may use the test aids of ``weightsync.testing``: the demo and its local job, the
#: benchmarks, the soak. Nothing that runs in a user's trainer or engine imports it.
TEST_AID_USERS = ("weightsync.testing", "weightsync.demo", "weightsync.local.", "weightsync.bench.",
                  "weightsync.soak.")


def test_production_code_does_not_import_the_test_module():
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if "weightsync.testing" in deps
                   and not any(m == u or (u.endswith(".") and m.startswith(u)) for u in TEST_AID_USERS))
    assert not users, (f"{users} import weightsync.testing (test aids); what production code needs from it belongs "
                       "in a production module (the transformers model of a spec: weightsync.checkpoint.hf)")

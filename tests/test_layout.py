"""The package's shape, as docs/design.md writes it: every package of jddp sits on a layer and
imports only from its own layer or below; the planner never reaches the loop; the library never
imports the repository's experiments/ or tests/; the import graph has no cycle; and
`pip install jddp` carries no scipy (the planner's calibration, which needs it, lives in
experiments/calibrate/)."""

import ast
import json
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jddp"


def _design_layers() -> tuple[tuple[str, ...], ...]:
    """The layers as docs/design.md's table writes them, bottom first: the packages named in the
    second column of each numbered row (`| 3 | `jddp.core` | ... |`)."""
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", (ROOT / "docs" / "design.md").read_text(), re.M)
    assert [int(number) for number, _ in rows] == list(range(1, len(rows) + 1)), rows
    return tuple(tuple(re.findall(r"`(jddp[\w.]*)`", packages)) for _, packages in rows)


# A module imports from its own layer or below. It belongs to the package its name starts with
# (the longest match), so a new module of a package is covered; a new package must be given a
# layer on the Design page. The root `jddp` is the public API, gathered from every layer.
LAYERS = _design_layers()


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


def layer(name: str) -> int:
    """The layer (0 at the bottom) of module `name`: that of the longest package it is in. The
    root `jddp` holds only its own `__init__`."""
    matches = [
        (len(package), level)
        for level, packages in enumerate(LAYERS)
        for package in packages
        if name == package or (package != "jddp" and name.startswith(package + "."))
    ]
    assert matches, f"{name} is in no layer: give its package one in LAYERS and docs/design.md"
    return max(matches)[1]


def _reachable(start: str) -> set[str]:
    """Every jddp module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for module in IMPORTS[todo.pop()]:
            if module in MODULES and module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


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


def test_the_library_never_imports_experiments_or_tests():
    offenders = {
        name: sorted(m for m in found if m.split(".")[0] in ("experiments", "tests"))
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


def test_every_module_imports_from_its_layer_or_below():
    """Module by module, imports inside functions too: nothing imports a module on a higher
    layer (the runtime never the core, the core never a strategy, the trainer never the loop,
    the loop never the run, the run never the planner), except the named exceptions."""
    wrong = [
        f"{name} (layer {layer(name) + 1}) imports {module} (layer {layer(module) + 1})"
        for name, found in IMPORTS.items()
        for module in found
        if module in MODULES and layer(module) > layer(name)
    ]
    assert not wrong, "; ".join(sorted(wrong))


def test_the_layers_cover_every_package_and_hold_each_once():
    placed = [package for packages in LAYERS for package in packages]
    assert len(placed) == len(set(placed))
    assert all(layer(name) >= 0 for name in MODULES)


def test_the_planner_never_reaches_the_loop():
    """The planner builds on the run's factory, never on the runner: nothing the planner or its
    command line imports, directly or through other modules, is the loop."""
    planner = [n for n in MODULES if _within(n, ("jddp.planner", "jddp.plan"))]
    wrong = {name: "jddp.loop" for name in planner if "jddp.loop" in _reachable(name)}
    assert not wrong, f"the planner reaches the loop from {sorted(wrong)}"


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

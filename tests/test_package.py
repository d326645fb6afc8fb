"""The package as installed and the code as written: only `jddp` is installed, the library never
reads `experiments/`, no module defines a name twice, and every `noqa` names a rule ruff runs."""

import ast
import glob
import os
import re
import tomllib

import setuptools

import jddp.plan
from tests.helpers import REPO


def pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def python_files(*folders):
    for folder in folders:
        yield from glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True)


def test_installing_jddp_installs_only_jddp():
    find = pyproject()["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(REPO, include=find["include"])
    assert "jddp" in packages
    assert all(name == "jddp" or name.startswith("jddp.") for name in packages), packages


def test_the_library_never_reads_experiments():
    for path in python_files("jddp"):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "experiments" for n in names), path
    jddp_dir = os.path.dirname(jddp.__file__)
    assert os.path.dirname(jddp.plan.CONFIG.default_path) == jddp_dir


def test_no_module_defines_a_top_level_name_twice():
    """A second `def f` silently replaces the first (ruff's F811 misses a first one in use)."""
    for path in python_files("jddp", "experiments", "tests"):
        seen = set()
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                assert node.name not in seen, f"{path}: {node.name} defined twice"
                seen.add(node.name)


def test_every_noqa_names_a_rule_ruff_runs():
    selected = pyproject()["tool"]["ruff"]["lint"]["select"]
    runs = re.compile(rf"^({'|'.join(selected)})\d")
    for path in python_files("jddp", "experiments", "tests"):
        for number, line in enumerate(open(path), 1):
            for codes in re.findall(r"# noqa: ([A-Z0-9, ]+)", line):
                for code in re.split(r"[, ]+", codes.strip()):
                    assert runs.match(code), f"{path}:{number}: noqa {code} (ruff runs {selected})"

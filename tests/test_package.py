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


def test_the_installed_planner_reads_its_default_config_from_the_library():
    """`python -m jddp.plan` without --config reads a config file inside the installed package
    (tests/test_layout.py checks that no jddp module imports `experiments`)."""
    jddp_dir = os.path.dirname(jddp.__file__)
    default = jddp.plan.CONFIG.default_path
    assert os.path.commonpath([default, jddp_dir]) == jddp_dir and os.path.isfile(default)


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

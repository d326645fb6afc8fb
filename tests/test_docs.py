"""The documentation builds and its examples run.

`mkdocs build --strict` fails on a broken link, anchor or API reference. Every ```python block
of a page runs, in order, in one namespace per page, with the working directory a fresh
temporary one; every ```bash / ```console block runs its jddp commands (`jddp-train`,
`python -m experiments.train`, `python -m jddp.plan`, `jddp-launch`, `jddp-export`) from the
repository root, with `--workdir` (and the other paths in RUN_DIR_FLAGS, and `jddp-export`'s
directories) moved under that temporary directory; a command that touches no file of its page
(a plan) runs once per test run, however many pages show it. Consecutive jddp commands run in
one process (`PageCommands`). A shell block that cannot run here
says why on the line before it: `<!-- not-run: REASON -->`.

A tutorial shows files of a user's project: a block preceded by `<!-- file: PATH -->` is written
to PATH under the temporary directory instead of run. On a page that says
`<!-- shell-cwd: page -->`, shell blocks run in that directory too (where its files are), as a user
in their project folder would; and Python blocks import from it, as a script run there does.
"""

import glob
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from tests.commands_in_one_process import run_commands
from tests.helpers import REPO, checkout_env

README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
PAGES = [README, *sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))]
SHELL = ("bash", "console", "shell", "sh")
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->")
MARKER = re.compile(r"<!--\s*([\w-]+):start\s*-->")
FILE = re.compile(r"<!--\s*file:\s*(\S+)\s*-->")
PAGE_CWD = "<!-- shell-cwd: page -->"
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
README_MAX_LINES = 200  # a front page; the rest is in docs/
# jddp's command lines, as a page writes them: [VAR=value ...] python -m MODULE ...
JDDP_MODULES = (
    "experiments.train",
    "jddp.run.train",
    "jddp.plan",
    "jddp.runtime.launch",
    "jddp.run.export",
)
# The installed commands, as the modules they run.
SCRIPTS = {
    "jddp-launch": "jddp.runtime.launch",
    "jddp-train": "jddp.run.train",
    "jddp-export": "jddp.run.export",
}
PYTHONS = ("python", "python3")
VENV_BIN = ".venv/bin/"  # the environment `make` creates, named where it is not activated
# Flags naming a run's directory or a file the page wrote: under the page's temporary directory,
# where the Python examples' relative paths land too. `jddp-export`'s WORKDIR and OUT as well.
RUN_DIR_FLAGS = (
    "--workdir",
    "--config.init_from",
    "--config.data.text_file",
    "--config.data.tokenizer",
)
# ... except a data file of the checkout itself (README.md as text), read where it is.
DATA_FLAGS = ("--config.data.text_file", "--config.data.tokenizer")
HF_PREFIX = "hf:"  # init_from="hf:DIR": a Hugging Face checkpoint directory
RUN_DIR_VAR = "JDDP_TEST_RUN_DIR"  # this test run's own directory (tests/conftest.py)


def page_id(path: str) -> str:
    return os.path.relpath(path, REPO)


def blocks(path: str) -> list[dict]:
    """The fenced code blocks of a page, in order: language, code, the `not-run` reason and the
    `NAME:start` marker on the line before, and the line the block starts on."""
    lines = open(path, encoding="utf-8").read().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language, start = fence.group(1), fence.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        not_run, marker, file = NOT_RUN.search(before), MARKER.search(before), FILE.search(before)
        found.append(
            {
                "language": language,
                "code": textwrap.dedent("\n".join(body)) if indent else "\n".join(body),
                "not_run": not_run.group(1) if not_run else None,
                "marker": marker.group(1) if marker else None,
                "file": file.group(1) if file else None,
                "line": start + 1,
            }
        )
        i += 1
    return found


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def jddp_argv(words: list[str], tmp_path) -> list[str] | None:
    """`words` (one command, environment assignments already taken off) as this interpreter
    runs it, workdirs under `tmp_path`; None if it is not a jddp command."""
    if words and words[0].startswith(VENV_BIN):
        words = [words[0].removeprefix(VENV_BIN), *words[1:]]
    if words and words[0] in SCRIPTS:
        words = ["python", "-m", SCRIPTS[words[0]], *words[1:]]
    if len(words) < 3 or words[0] not in PYTHONS or words[1] != "-m":
        return None
    if words[2] not in JDDP_MODULES:
        return None
    argv = [sys.executable, "-m", words[2]]
    rest = words[3:]
    if words[2] == "jddp.runtime.launch":
        split = rest.index("--")
        inner = jddp_argv(rest[split + 1 :], tmp_path)
        assert inner, f"jddp-launch must run a jddp command, not {rest[split + 1 :]}"
        return argv + rest[: split + 1] + inner
    if words[2] in ("experiments.train", "jddp.run.train"):
        assert any(w.startswith("--workdir=") for w in rest), (
            "a documented training command names its --workdir (else it writes under runs/ of "
            f"the checkout): {shlex.join(words)}"
        )
    for word in rest:
        flag, _, value = word.partition("=")
        if flag in RUN_DIR_FLAGS and not (
            flag in DATA_FLAGS and os.path.exists(os.path.join(REPO, value))
        ):
            word = f"{flag}={under(tmp_path, value, word)}"
        elif words[2] == "jddp.run.export" and not word.startswith("-"):
            word = under(tmp_path, word, word)
        argv.append(word)
    return argv


def under(tmp_path, value: str, word: str) -> str:
    """A page's relative path (an "hf:DIR" checkpoint's too) under `tmp_path`."""
    prefix = HF_PREFIX if value.startswith(HF_PREFIX) else ""
    path = value[len(prefix) :]
    assert not os.path.isabs(path), f"use a relative path in the docs: {word}"
    return prefix + os.path.join(tmp_path, path)


class PageCommands:
    """A page's jddp commands, run in the page's order. Consecutive ones with one working
    directory and environment share one process (tests/commands_in_one_process.py), a training
    run and the export of it too: the page claims what each command does, not that it starts a
    process. A plan shares only with plans (it sets JAX's devices before a backend starts);
    `jddp-launch` shares with nothing (starting processes is its job). `flush` runs what is
    pending; it is called before anything reads what the commands wrote."""

    def __init__(self, tmp_path, cwd=REPO):
        self.tmp_path, self.cwd = tmp_path, cwd
        self.pending = []  # (the page's words for it, its ran-already marker, argv, env)

    def add_block(self, code: str, where: str) -> None:
        for command in shell_commands(code):
            words = shlex.split(command)
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                env[name] = value
            argv = jddp_argv(words, self.tmp_path)
            assert argv, (
                f"{where}: {command!r} is not a jddp command the tests can run; mark the block "
                "with <!-- not-run: REASON --> on the line before it"
            )
            if "XLA_FLAGS" in env:  # keep the tests' simulated devices unless the page sets its own
                env["XLA_FLAGS"] = joined_flags(os.environ.get("XLA_FLAGS", ""), env["XLA_FLAGS"])
                if env["XLA_FLAGS"] == os.environ.get("XLA_FLAGS"):
                    del env["XLA_FLAGS"]
            marker = ran_already(argv, env, self.cwd, self.tmp_path)
            if marker and os.path.exists(marker):
                continue
            if self.pending and not shares_a_process(self.pending[-1][2:], (argv, env)):
                self.flush()
            self.pending.append((f"{where}: {command}", marker, argv, env))

    def flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        _, _, argv, env = pending[0]
        if len(pending) == 1:
            results = [
                subprocess.run(
                    argv,
                    cwd=self.cwd,
                    env=checkout_env(**env),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )  # fmt: skip
            ]
        else:
            results = run_commands([p[2][2:] for p in pending], self.cwd, env, timeout=600)
        for (said, marker, _, _), result in zip(pending, results, strict=True):
            assert result.returncode == 0, (
                f"{said}\nexit {result.returncode}\n{result.stderr[-3000:]}"
            )
            if marker:
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                open(marker, "w").close()


def shares_a_process(one: tuple[list, dict], other: tuple[list, dict]) -> bool:
    """Whether two commands (argv, env) may run in one process, one after the other."""
    (argv, env), (other_argv, other_env) = one, other
    programs = {argv[2], other_argv[2]}
    plans = programs == {"jddp.plan"} or "jddp.plan" not in programs
    return env == other_env and plans and "jddp.runtime.launch" not in programs


def joined_flags(ours: str, page: str) -> str:
    """`XLA_FLAGS` with the page's flags after ours, each flag once."""
    return " ".join(dict.fromkeys(f"{ours} {page}".split()))


def ran_already(argv: list[str], env: dict, cwd, tmp_path) -> str | None:
    """Where a command that neither reads nor writes its page's files (none of its words under
    `tmp_path`, run from the checkout) marks that it succeeded in this test run, so that a page
    repeating another's command (the README's plan is the planner page's first) does not run it
    again, whichever of the two runs first; None for any other command."""
    if str(cwd) != REPO or any(str(tmp_path) in word for word in argv):
        return None
    key = hashlib.sha256(json.dumps([argv, sorted(env.items())]).encode()).hexdigest()[:16]
    return os.path.join(os.environ[RUN_DIR_VAR], "docs-commands-ran", key)


def check_library_example(namespace) -> None:
    """The README's library example learns, on every (simulated) device."""
    result = namespace["trainer"].evaluate(namespace["state"], [namespace["data"]])
    assert result["count"] == 1797
    assert result["accuracy"] > 0.9
    assert namespace["trainer"].num_devices == 8


def check_pipeline_example(namespace) -> None:
    """The pipelined model: 8 blocks over 4 stages, 1F1B, with replicas."""
    state, metrics = namespace["state"], namespace["metrics"]
    assert 0 < float(metrics["loss"]) < 10
    kernel = state.params["blocks"]["Dense_0"]["kernel"]
    assert kernel.shape == (8, 32, 32) and kernel.sharding.spec[0] == "stage"
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {2}


CHECKS = {"library-example": check_library_example, "pipeline-example": check_pipeline_example}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative workdirs of the Python examples land here
    monkeypatch.syspath_prepend(str(tmp_path))  # a tutorial's own modules, as a script's
    with open(page, encoding="utf-8") as f:
        shell_cwd = tmp_path if PAGE_CWD in f.read() else REPO
    namespace = {"__name__": "docs_example"}
    ran = set()
    commands = PageCommands(tmp_path, shell_cwd)
    for block in blocks(page):
        where = f"{page_id(page)}:{block['line']}"
        language = block["language"]
        if block["not_run"] is not None:
            assert block["not_run"], f"{where}: give the reason a block does not run"
            continue
        if block["file"]:
            path = tmp_path / block["file"]
            if path.exists():  # a pending command may read the file's earlier text
                commands.flush()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block["code"] + "\n")
        elif language == "python":
            commands.flush()
            exec(compile(block["code"], where, "exec"), namespace)  # our own documentation
        elif language in SHELL:
            commands.add_block(block["code"], where)
        if block["marker"] in CHECKS:
            commands.flush()
            CHECKS[block["marker"]](namespace)
            ran.add(block["marker"])
    commands.flush()
    expected = {"README.md": {"library-example"}, "docs/pipeline.md": {"pipeline-example"}}
    assert ran == expected.get(page_id(page), set())


def test_not_run_blocks_say_why():
    """Lists every shell block the tests skip, with its reason (shown with `pytest -rA -s`)."""
    skipped = []
    for page in PAGES:
        for block in blocks(page):
            if block["not_run"] is not None:
                assert block["not_run"].strip()
                assert block["language"] in SHELL, (
                    f"{page_id(page)}:{block['line']}: only shell blocks may be not-run"
                )
                skipped.append(f"{page_id(page)}:{block['line']}: {block['not_run']}")
    print("\nshell blocks not run:\n" + "\n".join(skipped))
    assert skipped


def test_readme_is_short_and_its_links_resolve():
    """The README is outside the site (mkdocs checks the site's links): its own are checked
    here."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links its documentation"
    missing = [t for t in local if not os.path.exists(os.path.join(REPO, t))]
    assert not missing, f"README.md links to missing files: {missing}"


def flat_keys(config, prefix="") -> list[str]:
    keys = []
    for key, value in config.items():
        name = prefix + key
        keys.append(name)
        if hasattr(value, "items"):
            keys.extend(flat_keys(value, name + "."))
    return keys


def test_configs_page_names_every_key():
    import jddp

    with open(os.path.join(DOCS, "configs.md"), encoding="utf-8") as f:
        page = f.read()
    missing = [k for k in flat_keys(jddp.default_config()) if f"`{k}`" not in page]
    assert not missing, f"docs/configs.md does not document {missing}"


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, anchor or `::: reference` fails."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert os.path.exists(tmp_path / "site" / "index.html")

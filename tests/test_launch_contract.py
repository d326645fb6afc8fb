"""The exit-code contract (docs/errors.md's table: each error class's code, and what
`jddp-launch` does with each code), a launcher whose death takes its processes with it (SIGKILL,
a closed session), and a slots file that fails closed and cannot restart a job forever."""

import builtins
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from jddp import errors
from jddp.run import cli
from jddp.runtime import failures, launch, orphans, processes
from tests.helpers import REPO, launched

DOCS = os.path.join(REPO, "docs", "errors.md")


def exit_code_table() -> dict[int | None, str]:
    """{code: the row's "raised for" cell} of docs/errors.md's exit-code table (None: else)."""
    text = open(DOCS).read()
    table = text[text.index("| exit code |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        code = re.match(r"\*\*(\d+)\*\*", cells[0])
        rows[int(code[1]) if code else None] = cells[2]
    return rows


def test_each_error_class_exits_with_the_code_of_its_row_in_the_docs_table(capsys):
    rows = exit_code_table()
    assert set(rows) == {0, 2, 75, 130, None}, rows
    documented = {}
    for code, cell in rows.items():
        for name in re.findall(r"`(\w+)`", cell):
            found = getattr(errors, name, None) or getattr(builtins, name, None)
            if isinstance(found, type) and issubclass(found, BaseException):
                assert name not in documented, f"{name} is in two rows"
                documented[name] = (found, code)
    own = {n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, Exception)}
    assert own - set(documented) == set(), "an error class the table does not give a code"
    assert {"OSError", "KeyboardInterrupt"} <= set(documented)
    for name, (cls, code) in documented.items():
        error = cls("the problem; the fix") if cls is not KeyboardInterrupt else cls()
        assert cli.exit_code(error) == code, name
        if issubclass(cls, errors.JddpError):
            assert cls.exit_code == code, name
    # The shortcut every program takes: one line, that code.
    for error, code in ((errors.WorkdirBusy("held by pid 7; wait"), 75),
                        (PermissionError(13, "Permission denied"), 75),
                        (errors.ConfigError("bad\nsecond line"), 2)):  # fmt: skip
        with pytest.raises(SystemExit) as ended:
            cli.fail_with(error)
        assert ended.value.code == code
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_launcher_decides_by_the_exit_code_of_the_failed_process():
    now = [0.0]
    restarts = failures.Restarts(max_restarts=2, clock=lambda: now[0])
    for code in (2, 130):  # a mistake, an interruption: never restarted
        assert restarts.after(code) == failures.Decision(restart=False, exit_code=code)
    # Retryable: free, after a doubling back-off, FREE_IN_A_ROW times in a row...
    free = [restarts.after(75) for _ in range(failures.FREE_IN_A_ROW)]
    assert all(d.restart and not d.counted for d in free)
    assert [d.delay_s for d in free] == [1.0, 2.0, 4.0, 8.0, 16.0][: failures.FREE_IN_A_ROW]
    # ...then each takes one of --max_restarts, as any other failure does, until none is left.
    assert restarts.after(75) == failures.Decision(restart=True, counted=True, delay_s=32.0)
    assert restarts.after(137) == failures.Decision(restart=True, counted=True)  # SIGKILL
    for code in (75, 1, 3, 143):
        assert restarts.after(code) == failures.Decision(restart=False, exit_code=code)
    assert not restarts.grow()  # nor does the job stop to grow
    # A start that ran LONG_RUN_S ends the row: free retries and grows again, no counted ones.
    restarts.start()
    now[0] += failures.LONG_RUN_S
    assert restarts.after(75) == failures.Decision(restart=True, delay_s=1.0)
    assert restarts.grow() and restarts.counted == 2
    assert restarts.after(1) == failures.Decision(restart=False, exit_code=1)
    # Signals as the shell reports them: 128 + N; SIGINT is an interruption.
    assert [failures.exit_code(c) for c in (-9, -2, 3)] == [137, 130, 3]


def run_launcher(capfd, *argv) -> tuple[int, list[str], list[str]]:
    code = launch.main(list(argv))
    out, err = capfd.readouterr()
    return code, out.splitlines(), err.strip().splitlines()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's, in this test process
def test_the_launcher_retries_75_without_counting_and_ends_on_2_and_130(tmp_path, capfd):
    """In this process (the children are bare Python): 75 then 0 is a success with one uncounted
    retry; 2 and 130 end at once whatever --max_restarts says."""
    tries = tmp_path / "tries"
    once_retryable = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) "
        "if p.exists() else 0; p.write_text(str(n + 1)); print('try', n, flush=True); "
        "sys.exit(75 if n == 0 else 0)"
    )
    code, out, err = run_launcher(
        capfd, "--nproc=1", "--", sys.executable, "-c", once_retryable, str(tries)
    )
    assert (code, out) == (0, ["[0] try 0", "[0] try 1"]), err
    assert err == [
        "[launcher] process 0 of 1 failed (exit code 75); stopped the others; retryable: "
        "starting the job again in 1 s, it resumes from the newest checkpoint (retry 1 of "
        f"{failures.FREE_IN_A_ROW} in a row that --max_restarts does not count)"
    ]
    for ending in (2, 130):
        said = f"import sys; print('error: wrong {ending}', flush=True); sys.exit({ending})"
        code, out, err = run_launcher(
            capfd, "--nproc=1", "--max_restarts=3", "--", sys.executable, "-c", said
        )
        assert (code, out) == (ending, [f"[0] error: wrong {ending}"]), err
        assert err[-1] == f"error: wrong {ending}"  # the process's own line is the last


# ------------------------------------------------------------------ children die with it
CHILD = """
import os, signal, sys
def report(signum, _):
    print("got", signal.Signals(signum).name, flush=True)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, report)
signal.alarm(120)  # never outlives the test
print("ready", os.getpid(), flush=True)
while True:
    signal.pause()
"""


def is_alive(pid: int) -> bool:
    """Whether `pid` runs: exists and is not a zombie (a dead child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until_dead(pids, seconds: float) -> list[int]:
    """The pids still alive after polling them for `seconds`."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
def test_sighup_reaches_the_children_as_sigterm_and_sigkill_of_the_launcher_ends_them():
    pids = {}
    try:
        with launched(CHILD) as launcher:
            lines = iter(launcher.stdout)  # ends early only if the launcher dies (hard timeout)
            for line in lines:
                found = re.match(r"\[(\d)\] ready (\d+)$", line)
                if found:
                    pids[found[1]] = int(found[2])
                if len(pids) == 2:
                    break
            assert sorted(pids) == ["0", "1"], pids
            launcher.send_signal(signal.SIGHUP)  # as a closed ssh session does
            got = set()
            for line in lines:
                got.add(line.strip())
                if len(got) == 2:
                    break
            assert got == {"[0] got SIGTERM", "[1] got SIGTERM"}, got
            launcher.kill()  # SIGKILL: no chance to stop them itself
            launcher.wait()
            assert wait_until_dead(pids.values(), 2.0) == []
    finally:
        for pid in pids.values():
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


# The same, where the kernel does not do it: a child without the parent-death signal (started
# by a plain Popen) watching its parent; the parent ends when its stdin closes.
WATCHER = f"""
import sys
sys.path.insert(0, {os.path.join(REPO, "jddp", "runtime")!r})  # orphans alone, not jddp
import os, signal, orphans
assert not orphans.dies_with_parent()
orphans.watch_parent(os.getppid(), interval_s=0.05)
signal.alarm(60)  # never outlives the test
print(os.getpid(), flush=True)
signal.pause()
"""
PARENT = (
    f"import signal, subprocess, sys; signal.alarm(60); "  # never outlives the test
    f"subprocess.Popen([sys.executable, '-c', {WATCHER!r}]); sys.stdin.read()"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_elsewhere_a_child_that_watches_its_parent_ends_with_it():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        assert is_alive(child)
        parent.stdin.close()  # the parent ends
        assert parent.wait(timeout=30) == 0
        assert wait_until_dead([child], 2.0) == []
    finally:
        parent.kill()
    # Under jddp-launch the watch starts only where the kernel's signal is not set.
    assert not orphans.dies_with_parent()  # this test process was not started with one


# ------------------------------------------------------------------ the slots file
def ask_while_rewritten(path, values, ask, until, seconds: float = 30.0) -> list:
    """`ask()`, again and again, while a shell rewrites the file `path` as a health check does,
    `echo N > path` (truncate, then write) for N in `values` round and round, until
    `until(answers)` holds or `seconds` have passed. (A shell, not a thread: a thread would
    share this process's GIL with `ask` and rewrite the file a few hundred times a second.)"""
    loop = "; ".join(f"echo {value} > {shlex.quote(str(path))}" for value in values)
    writer = subprocess.Popen(["bash", "-c", f"while :; do {loop}; done"])
    answers, deadline = [], time.monotonic() + seconds
    try:
        while not until(answers) and time.monotonic() < deadline:
            answers.append(ask())
    finally:
        writer.kill()
        writer.wait()
    return answers


def test_a_slots_file_rewritten_in_a_tight_loop_neither_misreads_nor_restarts_forever(tmp_path):
    path = tmp_path / "slots"
    path.write_text("1\n")
    slots = launch.Slots(str(path), least=1, most=2)
    # `echo 1 > slots` again and again: an empty read is never taken for "all slots" (2).
    read = ask_while_rewritten(path, [1], slots.available, until=lambda a: len(a) >= 20000)
    assert set(read) == {1}
    # A flapping file (1, 2, 1, ...): the job on one process stops to grow FREE_IN_A_ROW times
    # without counting, then once per --max_restarts, then never again.
    restarts = failures.Restarts(max_restarts=1)
    stop_to_grow = launch.StopToGrow(1, slots, restarts)
    refused_at = []

    def refused_for_a_while(answers) -> bool:
        if stop_to_grow.refused and not refused_at:
            refused_at.append(len(answers))
        return bool(refused_at) and len(answers) >= refused_at[0] + 20000

    grows = sum(ask_while_rewritten(path, [1, 2], stop_to_grow, until=refused_for_a_while))
    assert grows == failures.FREE_IN_A_ROW + 1 and restarts.counted == 1
    assert stop_to_grow.refused > 1  # asked again after the first refusal, refused again
    # Not a number before any was read: the minimum; after one, the last.
    for text, fresh, read_before in (("2", 2, 2), ("", 1, 2), ("two", 1, 2), ("1", 1, 1)):
        path.write_text(text)
        assert launch.Slots(str(path), least=1, most=2).available() == fresh, text
        assert slots.available() == read_before, text


# ------------------------------------------------------------------ the coordinator's address
def test_the_coordinator_binds_the_address_it_is_given_when_it_is_one_of_this_machines():
    bind = processes.coordinator_bind_address
    assert bind("127.0.0.1:1234", environ={}) == "127.0.0.1:1234"
    try:  # whether this machine has IPv6's loopback, decided apart from the code under test
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        expected = "[::1]:1234"
    except OSError:
        expected = None
    assert bind("[::1]:1234", environ={}) == expected
    # A name (others may resolve it elsewhere), an address this machine lacks, a user's choice:
    # JAX's default, every interface (or the user's).
    assert bind("jddp-train-0.jddp-train:1234", environ={}) is None
    assert bind("192.0.2.1:1234", environ={}) is None  # TEST-NET-1: nobody's address
    assert bind("127.0.0.1:1234", environ={"JAX_COORDINATOR_BIND_ADDRESS": "[::]:1"}) is None

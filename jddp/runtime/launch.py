"""Start N processes of one job on this machine, as torchrun does.

    jddp-launch --nproc 2 [--devices_per_proc 2 | --gpus_per_proc 1] -- \
        jddp-train --config=... --workdir=...

(also `python -m jddp.runtime.launch`). The children run in the launcher's own environment: a
command whose program is `python`, `python3` or `python3.X` (this interpreter's version) runs
with the launcher's interpreter (`sys.executable`), a program installed beside it (`jddp-train`,
any console script of the same virtual environment) is that one, and the children's PATH starts
with that directory. Each child gets `JDDP_COORDINATOR_ADDRESS` (a free port on 127.0.0.1),
`JDDP_NUM_PROCESSES` and `JDDP_PROCESS_ID`, which `jddp.runtime.processes.initialize` reads
(process 0's coordinator then listens on 127.0.0.1 only), and `JDDP_LAUNCHER_PID`;
`--devices_per_proc` simulates that many CPU devices per process, `--gpus_per_proc` gives each
its own slice of `CUDA_VISIBLE_DEVICES`; otherwise the environment is inherited as it is.
Output lines are prefixed with the rank. SIGINT and SIGTERM are forwarded to every child,
and SIGHUP (a closed terminal or ssh session) as SIGTERM: the job saves and stops. A child dies
with the launcher (jddp/runtime/orphans.py): a killed launcher leaves no process of its job.

When a child fails, the others are stopped at once (their last words, such as a collective's
"connection reset" traceback, are dropped: jddp/runtime/job.py) and the launcher's last line
names the failed process (for a hang: the process that fell behind, and its stack file) and what
happens next, by the failed process's exit code (the contract in jddp/errors.py, applied by
`failures.Restarts`): 2 (a mistake: its own `error:` line is then the last) and 130
(interrupted) end the launcher with that code; 75 (retryable) starts every process again, on a
fresh port, after a back-off and without counting, a few times in a row; any other failure
does with `--max_restarts=N`, N times. Training resumes from the newest checkpoint. With
`--nproc=MIN:MAX` and `--slots_file`, a start runs as many processes as the file allows (at
least MIN), and a job running on fewer than MAX is stopped (SIGTERM: it saves) and started again
on more when the file allows more (a misread file keeps its last number); the train process
keeps the global batch and the example order (jddp/run/elastic.py). The launcher's own mistakes
(a bad flag, a command that does not exist) are one `error:` line and exit code 2.
"""

import argparse
import os
import re
import socket
import sys
import threading
import time

from jddp import errors
from jddp.runtime import failures, job, orphans


def with_cpu_devices(xla_flags: str, devices: int) -> str:
    """`xla_flags` (an XLA_FLAGS value) with `devices` simulated CPU devices instead of any count
    it set."""
    count = "--xla_force_host_platform_device_count"
    kept = [flag for flag in xla_flags.split() if not flag.startswith(count)]
    return " ".join([*kept, f"{count}={devices}"])


def free_port() -> int:
    """A port free now (another program may take it before it is bound: see reserve_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port() -> tuple[int, socket.socket | None]:
    """(a free port on 127.0.0.1 for the job's coordinator, the socket holding it or None).

    On Linux the port stays bound, with SO_REUSEPORT and without listening, for as long as the
    job runs: no other program is given it, while process 0's coordinator (gRPC binds with
    SO_REUSEPORT too) binds 127.0.0.1 and listens beside this socket. A port that was only looked
    up free could be taken before the coordinator binds it, failing the whole job."""
    if not sys.platform.startswith("linux"):
        return free_port(), None
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
    except OSError:
        holder.close()
        return free_port(), None
    return holder.getsockname()[1], holder


def _own_bin_dir() -> str | None:
    """The directory of the launcher's interpreter (a virtual environment's `bin/`), unresolved:
    a venv's `python` is a symlink whose target lies outside the venv."""
    return os.path.dirname(sys.executable) if sys.executable else None


def child_command(command: list[str]) -> list[str]:
    """`command` as every child runs it: `python` (or `python3`, or `python3.X` of this
    interpreter's version) is this interpreter, a bare program name found beside it is that file,
    anything else (a path, another program) stays as written."""
    program, rest = command[0], command[1:]
    if os.sep in program or not sys.executable:
        return command
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if re.fullmatch(rf"python(3|{re.escape(version)})?", program):
        return [sys.executable, *rest]
    own = os.path.join(_own_bin_dir(), program)
    if os.path.isfile(own) and os.access(own, os.X_OK):
        return [own, *rest]
    return command


def child_env(rank: int, args, port: int, nproc: int | None = None) -> dict[str, str]:
    """The environment of process `rank` of `nproc` (default: --nproc's)."""
    nproc = args.nproc if nproc is None else nproc
    env = dict(os.environ)
    own_bin = _own_bin_dir()
    if own_bin:  # what the child itself starts by name comes from this environment too
        path = env.get("PATH", "")
        if path.split(os.pathsep)[0] != own_bin:
            env["PATH"] = own_bin + (os.pathsep + path if path else "")
    env.update(
        JDDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JDDP_NUM_PROCESSES=str(nproc),
        JDDP_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
        **{orphans.LAUNCHER_PID: str(os.getpid())},
    )
    if args.devices_per_proc:
        env["XLA_FLAGS"] = with_cpu_devices(env.get("XLA_FLAGS", ""), args.devices_per_proc)
    if args.gpus_per_proc:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(nproc * args.gpus_per_proc)]
        mine = ids[rank * args.gpus_per_proc : (rank + 1) * args.gpus_per_proc]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(errors.MISTAKE_EXIT_CODE)


def _say(message: str) -> None:
    print(f"[launcher] {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    """Starts the job, and starts it again after failures and when more slots come back
    (--nproc=MIN:MAX), as `failures.Restarts` decides; returns the launcher's exit code."""
    command = child_command(args.command)
    slots = Slots(args.slots_file, args.min_nproc, args.max_nproc)
    restarts, nproc, signalled = failures.Restarts(args.max_restarts), None, threading.Event()
    while True:
        nproc = slots.wait_for(args.slots_timeout_s, previous=nproc)
        if nproc is None:
            return _give_up(
                f"fewer than {args.min_nproc} processes may run ({slots.describe()}) for "
                f"{args.slots_timeout_s:g} s; raise the count in {args.slots_file} or lower "
                "--nproc's minimum, then run the same command to resume"
            )
        restarts.start()
        outcome = _start(args, command, nproc, slots, restarts, signalled)
        if outcome.failed is None:
            if outcome.stopped and not signalled.is_set():  # stopped to grow
                _say(f"more slots are free ({slots.describe()}): starting again with them")
                continue
            codes = [c for c in outcome.codes.values() if c != 0]
            return failures.exit_code(codes[0]) if codes else 0
        what = failures.what_failed(outcome, nproc)
        code = failures.exit_code(outcome.codes[outcome.failed])
        decision = restarts.after(code)
        if code in (errors.MISTAKE_EXIT_CODE, errors.INTERRUPTED_EXIT_CODE):
            _say(f"{what}; stopped the others")
            if outcome.failed in outcome.errors:  # the process said why (and how to fix it)
                print(outcome.errors[outcome.failed], file=sys.stderr, flush=True)
            return code
        if signalled.is_set():
            return _give_up(f"{what}; stopped the others", code)
        if not decision.restart:
            used = restarts.counted
            after = f" after {used} restart{'s' * (used != 1)}" if used else ""
            again = "" if args.max_restarts else ", or pass --max_restarts=N to restart by itself"
            return _give_up(
                f"{what}{after}; stopped the others; run the same command to resume from the "
                f"newest checkpoint{again}",
                code,
            )
        _say(f"{what}; stopped the others; {_restart_line(decision, restarts)}")
        time.sleep(decision.delay_s)


def _restart_line(decision: failures.Decision, restarts: failures.Restarts) -> str:
    """`restart 1 of 3: starting the job again, ...`, or for a retry not counted, which."""
    when = f" in {decision.delay_s:g} s" if decision.delay_s else ""
    again = f"starting the job again{when}, it resumes from the newest checkpoint"
    if decision.counted:
        return f"restart {restarts.counted} of {restarts.max_restarts}: {again}"
    return (
        f"retryable: {again} (retry {restarts.free_in_a_row} of {failures.FREE_IN_A_ROW} in a "
        "row that --max_restarts does not count)"
    )


def _give_up(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _start(args, command, nproc: int, slots: "Slots", restarts, signalled) -> job.Outcome:
    """One start of `nproc` processes, on a coordinator port of its own; `signalled` is set
    when the launcher gets SIGINT, SIGTERM or SIGHUP (forwarded to the processes; no restart
    after)."""
    port, holder = reserve_port()
    try:
        return job.run_processes(
            command,
            nproc,
            lambda rank: child_env(rank, args, port, nproc),
            stop_when=StopToGrow(nproc, slots, restarts),
            on_signal=signalled.set,
        )
    except OSError as e:  # the command does not exist or cannot be run
        _fail(f"cannot run {args.command[0]!r}: {e.strerror}; check the command after --")
    finally:
        if holder is not None:
            holder.close()


class StopToGrow:
    """`stop_when` of a start on `nproc` processes: true once the slots allow more and the
    restart budget allows the restart (`failures.Restarts.grow`); says once when it does not."""

    def __init__(self, nproc: int, slots: "Slots", restarts: failures.Restarts):
        self.nproc, self.slots, self.restarts = nproc, slots, restarts
        self.refused = 0  # times more slots were free and the budget said no

    def __call__(self) -> bool:
        more = self.slots.available()
        if more <= self.nproc:
            return False
        if self.restarts.grow():
            return True
        self.refused += 1
        if self.refused == 1:
            _say(
                f"{more} slots are free, but the job was restarted {failures.FREE_IN_A_ROW} "
                "times in a row and --max_restarts has none left: it goes on with "
                f"{self.nproc} processes (it may grow once it has run "
                f"{failures.LONG_RUN_S:g} s)"
            )
        return False


class Slots:
    """How many processes may run now: --nproc's maximum, or fewer when --slots_file says so
    (a file holding one number, written by whatever knows which machines are healthy; a
    missing file means the maximum).

    It fails closed: a read that finds no number (a writer's `echo 2 > FILE` empties the file
    before it writes) or cannot read the file keeps the last number read (before any, the
    minimum), so that it never asks the job to grow on a misread."""

    def __init__(self, path: str | None, least: int, most: int):
        self.path, self.least, self.most = path, least, most
        self._last = None  # the last number read
        self._warned = False

    def available(self) -> int:
        if not self.path:
            return self.most
        try:
            with open(self.path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return self.most
        except OSError as e:
            return self._unreadable(e.strerror)
        try:
            self._last = max(0, min(self.most, int(text)))
        except ValueError:
            return self._unreadable(f"{text[:40]!r} is not a number" if text else None)
        return self._last

    def _unreadable(self, why: str | None) -> int:
        keep = self.least if self._last is None else self._last
        if why and not self._warned:  # an empty read is a writer at work: said nothing
            _say(f"cannot read --slots_file {self.path} ({why}); keeping {keep} slots")
            self._warned = True
        return keep

    def describe(self) -> str:
        return f"{self.available()} of {self.most} slots" + (
            f" in {self.path}" if self.path else ""
        )

    def wait_for(self, timeout_s: float, previous: int | None) -> int | None:
        """The number of processes to start (at least the minimum), waiting up to `timeout_s`
        for enough slots; None when they did not come."""
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            count = self.available()
            if count >= self.least:
                if previous is not None and count != previous:
                    _say(f"{count} of {self.most} processes this time (were {previous})")
                return count
            if not said:
                _say(f"waiting for {self.least} slots ({self.describe()})")
                said = True
            if time.monotonic() >= deadline:
                return None
            time.sleep(1.0)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage too: one line is the contract
        _fail(f"{message}; see jddp-launch --help")


def main(argv=None) -> int:
    parser = _Parser(
        prog="jddp-launch", description="Start N processes of one JAX job on this machine."
    )
    parser.add_argument(
        "--nproc",
        required=True,
        help="processes to start: N, or MIN:MAX to run on fewer (down to MIN) while --slots_file "
        "says fewer may run, and on more again when they may",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="start the job again this many times after a process fails (never after exit code "
        "2, a mistake, or 130, interrupted; after 75, retryable, only past "
        f"{failures.FREE_IN_A_ROW} retries in a row); it resumes from the newest checkpoint",
    )
    parser.add_argument(
        "--slots_file",
        default=None,
        help="with --nproc=MIN:MAX: a file holding how many processes may run now (missing: "
        "MAX; unreadable or empty: the last number read); read before each start, and every "
        "second while fewer than MAX run",
    )
    parser.add_argument(
        "--slots_timeout_s",
        type=float,
        default=600.0,
        help="how long to wait for MIN slots before giving up",
    )
    parser.add_argument(
        "--devices_per_proc",
        type=int,
        default=0,
        help="simulated CPU devices per process (sets XLA_FLAGS)",
    )
    parser.add_argument(
        "--gpus_per_proc",
        type=int,
        default=0,
        help="GPUs per process (slices CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- then the command every process runs"
    )
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command to run after --, e.g. -- jddp-train --config=...")
    args.min_nproc, args.max_nproc = _nproc_range(parser, args.nproc)
    args.nproc = args.max_nproc
    for name in ("devices_per_proc", "gpus_per_proc", "max_restarts", "slots_timeout_s"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be at least 0, got {getattr(args, name)}")
    if args.slots_file and args.min_nproc == args.max_nproc:
        parser.error(f"--slots_file needs --nproc=MIN:MAX, got --nproc={args.nproc}")
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C between starts (while none of the job's processes runs)
        print("interrupted: no process of the job was running", file=sys.stderr, flush=True)
        return errors.INTERRUPTED_EXIT_CODE


def _nproc_range(parser, text: str) -> tuple[int, int]:
    """(MIN, MAX) of --nproc=N or --nproc=MIN:MAX."""
    try:
        bounds = [int(part) for part in text.split(":")]
    except ValueError:
        bounds = []
    if len(bounds) not in (1, 2):
        parser.error(f"--nproc must be N or MIN:MAX, got {text!r}")
    least, most = bounds[0], bounds[-1]
    if least < 1:
        parser.error(f"--nproc must be at least 1, got {least}")
    if most < least:
        parser.error(f"--nproc={text}: MAX must be at least MIN")
    return least, most


if __name__ == "__main__":
    sys.exit(main())

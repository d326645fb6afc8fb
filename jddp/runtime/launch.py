"""Start N processes of one job on this machine, as torchrun does.

    jddp-launch --nproc 2 [--devices_per_proc 2 | --gpus_per_proc 1] -- \
        jddp-train --config=... --workdir=...

(also `python -m jddp.runtime.launch`). The children run in the launcher's own environment: a
command whose program is `python`, `python3` or `python3.X` (this interpreter's version) runs
with the launcher's interpreter (`sys.executable`), a program installed beside it (`jddp-train`,
any console script of the same virtual environment) is that one, and the children's PATH starts
with that directory. Each child gets `JDDP_COORDINATOR_ADDRESS` (a free port on 127.0.0.1),
`JDDP_NUM_PROCESSES` and `JDDP_PROCESS_ID`, which `jddp.runtime.processes.initialize` reads;
`--devices_per_proc` simulates that many CPU devices per process, `--gpus_per_proc` gives each
its own slice of `CUDA_VISIBLE_DEVICES`; otherwise the environment is inherited as it is.
Output lines are prefixed with the rank. SIGINT and SIGTERM are forwarded to every child. When a
child fails, the others are stopped and the launcher exits with the failed child's code; if the
child said why in an `error: ...` line, that line is the launcher's last. The launcher's own
mistakes (a bad flag, a command that does not exist) are one `error:` line and exit code 2.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_SEC = 10  # after SIGTERM, before SIGKILL, when stopping the survivors of a failure


def free_port() -> int:
    """A port free now (another program may take it before it is bound: see reserve_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port() -> tuple[int, socket.socket | None]:
    """(a free port for the job's coordinator, the socket holding it or None).

    On Linux the port stays bound, with SO_REUSEPORT and without listening, for as long as the
    job runs: no other program is given it, while process 0's coordinator (gRPC binds with
    SO_REUSEPORT too) binds it beside this socket. A port that was only looked up free could be
    taken before the coordinator binds it, failing the whole job."""
    if not sys.platform.startswith("linux"):
        return free_port(), None
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            holder = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # the coordinator binds [::], dual-stack
                holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            holder.bind((address, 0))
        except OSError:
            holder.close()
            continue
        return holder.getsockname()[1], holder
    return free_port(), None


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


def child_env(rank: int, args, port: int) -> dict[str, str]:
    env = dict(os.environ)
    own_bin = _own_bin_dir()
    if own_bin:  # what the child itself starts by name comes from this environment too
        path = env.get("PATH", "")
        if path.split(os.pathsep)[0] != own_bin:
            env["PATH"] = own_bin + (os.pathsep + path if path else "")
    env.update(
        JDDP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JDDP_NUM_PROCESSES=str(args.nproc),
        JDDP_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
    )
    if args.devices_per_proc:
        flags = env.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={args.devices_per_proc}")
        env["XLA_FLAGS"] = " ".join(flags)
    if args.gpus_per_proc:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = (
            visible.split(",")
            if visible
            else [str(i) for i in range(args.nproc * args.gpus_per_proc)]
        )
        mine = ids[rank * args.gpus_per_proc : (rank + 1) * args.gpus_per_proc]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


USAGE_EXIT_CODE = 2


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def _relay(rank: int, stream, lock: threading.Lock, last_errors: dict) -> None:
    """Copies a child's output lines, prefixed with its rank; remembers its last `error:` line."""
    for line in iter(stream.readline, ""):
        if line.startswith("error: "):
            last_errors[rank] = line.rstrip("\n")
        with lock:
            sys.stdout.write(f"[{rank}] {line}")
            sys.stdout.flush()


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run(args) -> int:
    port, holder = reserve_port()
    try:
        return _run(args, port)
    finally:
        if holder is not None:
            holder.close()


def _run(args, port: int) -> int:
    lock = threading.Lock()
    children, relays, last_errors = [], [], {}

    # Installed before the first child starts: a signal during start-up reaches the children
    # started so far (they run in their own sessions, so nothing else would stop them).
    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    for rank in range(args.nproc):
        try:
            child = subprocess.Popen(
                child_command(args.command),
                env=child_env(rank, args, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        except OSError as e:  # the command does not exist or cannot be run
            _stop(children)
            _fail(f"cannot run {args.command[0]!r}: {e.strerror}; check the command after --")
        relay = threading.Thread(
            target=_relay, args=(rank, child.stdout, lock, last_errors), daemon=True
        )
        relay.start()
        children.append(child)
        relays.append(relay)

    try:
        while True:
            codes = [child.poll() for child in children]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(
                    f"[launcher] process {rank} of {args.nproc} failed ({_describe(code)}); "
                    "stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(children)
                relays[rank].join(timeout=GRACE_SEC)  # its last lines are read
                if rank in last_errors:
                    print(last_errors[rank], file=sys.stderr, flush=True)
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(children) -> None:
    """SIGTERM, then SIGKILL after GRACE_SEC: a survivor may be stuck in a collective."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + GRACE_SEC
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage too: one line is the contract
        _fail(f"{message}; see jddp-launch --help")


def main(argv=None) -> int:
    parser = _Parser(
        prog="jddp-launch", description="Start N processes of one JAX job on this machine."
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes to start")
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
    for name in ("nproc", "devices_per_proc", "gpus_per_proc"):
        lowest = 1 if name == "nproc" else 0
        if getattr(args, name) < lowest:
            parser.error(f"--{name} must be at least {lowest}, got {getattr(args, name)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

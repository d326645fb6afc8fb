"""One process of a multi-process job, watched, for jobs started without `jddp-launch` (by hand,
srun, mpirun, Kubernetes).

When a peer is lost, JAX's coordination service ends every survivor itself: it logs which task
stopped sending heartbeats, then aborts the process (an `F` log line, a native stack dump, exit
code 134), or at once when the coordinator (process 0) is gone. Python never gets to say anything.
So the train entry point runs as a small parent (`supervise`) around the real process: output
passes through unchanged, the coordination service's last words are held back and, if the
process then aborts, replaced by one line naming the lost process and what to do, with exit code
75 (EX_TEMPFAIL: run it again). Everything else (exit codes, SIGINT / SIGTERM, SIGHUP as
SIGTERM) passes through.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

from jddp.errors import RETRYABLE_EXIT_CODE
from jddp.runtime import orphans
from jddp.runtime.job import FORWARDED, FORWARDED_AS

LOST_PEER_EXIT_CODE = RETRYABLE_EXIT_CODE  # the same command, run again, will do
SUPERVISED = "JDDP_SUPERVISED"  # set in the watched process's environment

_COORDINATION_LOG = re.compile(
    r"^[EWF]\d{4} .*(coordination_service|coordination_service_agent|client\.h|"
    r"preemption_sync_manager)"
)
_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")
_ABORT = "Terminating process because the JAX distributed service detected fatal errors"
_STOPPED_HEARTBEATS = re.compile(r"stopped sending heartbeats\):\s*((?:\d+[\s,]*)+)")
_TASK_TIMEOUT = re.compile(r"Task (\d+) heartbeat timeout")


def is_supervised() -> bool:
    return os.environ.get(SUPERVISED) == "1"


def lost_processes(log: str) -> list[int] | None:
    """The processes JAX's coordination service declared lost in `log`; [0] when this process
    lost the coordinator itself (process 0, whose service every process talks to)."""
    found = _STOPPED_HEARTBEATS.search(log)
    if found:
        return sorted({int(n) for n in re.findall(r"\d+", found.group(1))})
    tasks = sorted({int(n) for n in _TASK_TIMEOUT.findall(log)})
    return tasks or [0]


def lost_peer_message(lost: list[int], num_processes: int | None) -> str:
    total = f" of {num_processes}" if num_processes else ""
    who = ", ".join(map(str, lost))
    what = " (the coordinator)" if lost == [0] else ""
    return (
        f"error: lost process {who}{total}{what}: it stopped answering (it crashed, was killed, "
        "or its host went away), so this process stopped too; run the same command again for "
        "every process: training resumes from the newest checkpoint"
    )


class _StderrWatch:
    """Copies the watched process's stderr, holding back the coordination service's log lines
    until it is clear whether an abort follows them; after an abort, copies nothing more and
    keeps the first lines (the abort's status names the lost task) for `lost_processes`."""

    def __init__(self):
        self.held: list[str] = []
        self.aborted = False

    def line(self, text: str) -> None:
        if self.aborted:
            if len(self.held) < 200:
                self.held.append(text)
            return
        if _ABORT in text:
            self.aborted = True
            self.held.append(text)
        elif _COORDINATION_LOG.match(text) or (self.held and not _LOG_LINE.match(text)):
            self.held.append(text)  # the service's words, or the rest of a multi-line one
        else:
            self.flush()
            sys.stderr.write(text)
            sys.stderr.flush()

    def flush(self) -> None:
        sys.stderr.writelines(self.held)
        sys.stderr.flush()
        self.held = []


def supervise(command: list[str], num_processes: int | None = None) -> int:
    """Runs `command` watched (see the module doc); returns the exit code to end with."""
    child = subprocess.Popen(
        command,
        env={**os.environ, SUPERVISED: "1", "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,  # signals reach it once: forwarded from here
        preexec_fn=orphans.die_with_parent(),  # SIGKILL when the supervisor dies, as a host
    )  # going down takes both
    watch = _StderrWatch()
    reader = threading.Thread(
        target=lambda: [watch.line(text) for text in iter(child.stderr.readline, "")], daemon=True
    )
    reader.start()

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(FORWARDED_AS.get(signum, signum))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = child.wait()
    reader.join()
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if watch.aborted:
        print(lost_peer_message(lost_processes("".join(watch.held)), num_processes), flush=True,
              file=sys.stderr)  # fmt: skip
        return LOST_PEER_EXIT_CODE
    watch.flush()
    return code if code >= 0 else 128 - code


_LOST_CONTACT = re.compile(
    r"(?i)(gloo|nccl|mpi).*(connection (reset|closed|refused)|broken pipe|remote process|peer)"
)


def await_lost_peer_verdict(error: Exception, heartbeat_timeout_seconds: int) -> None:
    """In a watched process whose collective just failed because a peer went away: JAX's
    coordination service names that peer within the heartbeat timeout, by aborting this process
    (which the supervisor turns into one line). Wait for that rather than print a traceback that
    names nobody; returns at once for any other error."""
    if not (is_supervised() and _LOST_CONTACT.search(str(error))):
        return
    time.sleep(heartbeat_timeout_seconds + 15)
    line = (str(error).strip().splitlines() or [""])[0][:200]
    print(
        f"error: lost contact with another process of this job ({line}); run the same command "
        "again for every process: training resumes from the newest checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(LOST_PEER_EXIT_CODE)  # JAX's shutdown at exit would wait on the lost peer

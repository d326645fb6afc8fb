"""Children that die with the program that started them: a launcher killed by SIGKILL, or whose
ssh session closed, must not leave its job's processes running, holding the workdir's lock and
the devices (the next start would be refused as "in use").

On Linux the kernel does it: `die_with_parent()` is a `preexec_fn` that asks for SIGKILL when
the parent goes (PR_SET_PDEATHSIG), as torchrun's workers do. Elsewhere (or where prctl fails)
a process that knows its launcher checks on it: `watch_parent` (jddp-train under jddp-launch,
through `jddp.runtime.processes.initialize`). Standard library only: a child's first imports.
"""

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_PID = "JDDP_LAUNCHER_PID"  # set by jddp-launch in its children's environment
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2
WATCH_INTERVAL_S = 0.5


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None


def die_with_parent():
    """A `preexec_fn` for `subprocess.Popen` (None where the kernel cannot do it): the child is
    sent SIGKILL when its parent dies.

    The kernel sends it when the *thread* that forked the child ends, not the process: start
    children from a thread that lives as long as the parent (jddp starts them from the main
    thread). A parent that died before the child asked is caught by comparing parent ids."""
    prctl = _prctl()  # looked up here, in the parent: the child only calls it
    if prctl is None:
        return None
    parent = os.getpid()

    def in_child():
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def dies_with_parent() -> bool:
    """Whether this process gets a signal when its parent dies (Linux's PR_SET_PDEATHSIG)."""
    prctl = _prctl()
    if prctl is None:
        return False
    asked = ctypes.c_int(0)
    return prctl(_PR_GET_PDEATHSIG, ctypes.byref(asked), 0, 0, 0) == 0 and asked.value != 0


def watch_parent(parent: int, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Ends this process (SIGKILL, as the parent-death signal would) within `interval_s` of
    process `parent` ending: this process's parent (an orphan is given another: init, or a
    subreaper), or an ancestor further up (a wrapper script between them: then its pid is
    watched)."""
    direct = os.getppid() == parent

    def alive() -> bool:
        if direct:
            return os.getppid() == parent
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process of another user took the number
            return False
        return True

    def watch():
        while alive():
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="jddp-parent-watch", daemon=True)
    thread.start()
    return thread


def watch_launcher(environ=None) -> None:
    """Under jddp-launch, where the kernel does not end this process with its launcher (not
    Linux, or a process the launcher did not start itself: the signal is not inherited): a
    thread that does (`watch_parent`). Nothing otherwise."""
    environ = os.environ if environ is None else environ
    launcher = environ.get(LAUNCHER_PID, "")
    if launcher.isdigit() and not dies_with_parent():
        watch_parent(int(launcher))

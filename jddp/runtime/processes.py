"""Processes: one call that joins this process to the others of its job, from flags or from the
environment a launcher set, or does nothing for a job of one process.

Sources, first found wins:
1. arguments (the train entry's `--coordinator_address`, `--num_processes`, `--process_id`);
2. `JDDP_COORDINATOR_ADDRESS`, `JDDP_NUM_PROCESSES`, `JDDP_PROCESS_ID` (set by `jddp-launch` and
   by the Kubernetes manifest in launch/; on Kubernetes an Indexed Job's `JOB_COMPLETION_INDEX`
   stands in for the process id);
3. JAX's own cluster detection, for SLURM (`srun`), Open MPI (`mpirun`) and Cloud TPU pods,
   when their variables say the job has more than one process.

A user's script need not call anything: the first `jddp.Trainer` joins the job the environment
describes (`join_launched_job`), as torchrun's and Accelerate's users expect of their scripts.
`jddp.initialize()` does it explicitly, for a script that uses JAX before building a trainer.
Importing jddp changes nothing.
"""

import functools
import hashlib
import ipaddress
import os
import socket
from dataclasses import dataclass

import jax
import numpy as np
from absl import logging

from jddp.errors import ConfigError, UsageError
from jddp.runtime import gloo_threads, orphans

DEFAULT_HEARTBEAT_TIMEOUT_SEC = 30  # a dead peer ends the survivors within ~this long


@dataclass(frozen=True)
class Launch:
    """How this process was started: `source` names where the settings came from."""

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _int(environ, name):
    return int(environ[name]) if environ.get(name) else None


def detect(environ=None, *, coordinator_address=None, num_processes=None, process_id=None):
    """The Launch that the arguments and `environ` describe; `source="single"` for one process.

    SLURM, Open MPI and TPU launches leave the three values to JAX's detection (None here).
    """
    environ = os.environ if environ is None else environ
    given = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise ConfigError(
                "--coordinator_address, --num_processes and --process_id go together; pass all "
                "three, or none to take them from the environment"
            )
        return Launch("flags", *given)
    if environ.get("JDDP_COORDINATOR_ADDRESS"):
        process = _int(environ, "JDDP_PROCESS_ID")
        if process is None:
            process = _int(environ, "JOB_COMPLETION_INDEX")  # Kubernetes Indexed Job
        count = _int(environ, "JDDP_NUM_PROCESSES")
        if process is None or count is None:
            raise ConfigError(
                "JDDP_COORDINATOR_ADDRESS is set but JDDP_NUM_PROCESSES or JDDP_PROCESS_ID "
                "(or JOB_COMPLETION_INDEX) is not; set all of them"
            )
        source = "jddp-launch" if environ.get("JDDP_PROCESS_ID") else "kubernetes"
        return Launch(source, environ["JDDP_COORDINATOR_ADDRESS"], count, process)
    # srun's tasks, not a shell inside `salloc -n 4` (no step: a plain `python` there is alone).
    if environ.get("SLURM_STEP_NODELIST") and (_int(environ, "SLURM_NTASKS") or 1) > 1:
        return Launch("slurm")
    if environ.get("OMPI_MCA_orte_hnp_uri") and (_int(environ, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return Launch("openmpi")
    if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return Launch("tpu")
    return Launch("single")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT_SEC,
) -> Launch:
    """Joins this process to its job with `jax.distributed.initialize` (call it before any other
    JAX call); does nothing for a single process, or when the job is joined already. CPU
    collectives go through gloo; process 0's coordinator listens on the address it is given
    (`coordinator_bind_address`). Under jddp-launch this process also ends with its launcher
    where the kernel would not see to it (jddp/runtime/orphans.py)."""
    if jax.distributed.is_initialized():
        return Launch("joined")
    launch = detect(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    if launch.source == "single":
        return launch
    if launch.source == "jddp-launch":
        orphans.watch_launcher()  # where the kernel does not end this process with it
    # Only the CPU backend reads this; accelerators keep NCCL / ICI.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=launch.coordinator_address,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        coordinator_bind_address=coordinator_bind_address(launch.coordinator_address),
    )
    gloo_threads.start_backend_with_quiet_poller()
    logging.info(
        "process %d of %d (%s), %d of %d devices local",
        jax.process_index(),
        jax.process_count(),
        launch.source,
        jax.local_device_count(),
        jax.device_count(),
    )
    return launch


def join_launched_job() -> Launch:
    """`initialize()` when this process's environment says it is one of a job (jddp-launch,
    SLURM, Open MPI, Kubernetes, a TPU pod) and it has not joined yet; what a `Trainer` calls
    before it looks at the devices. A UsageError in one line when JAX's backend started first
    (then it is too late to join)."""
    if jax.distributed.is_initialized():
        return Launch("joined")
    launch = detect()
    if launch.source == "single":
        return launch
    if _backend_started():
        raise UsageError(
            f"this process is one of a job ({launch.source}), but JAX was used before jddp could "
            "join it (jax.distributed.initialize must come first); call jddp.initialize() at "
            "the top of your script, before any other JAX call"
        )
    return initialize()


def _backend_started() -> bool:
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # a JAX that moved it: jax.distributed.initialize then says it
        return False
    return backends_are_initialized()


@functools.cache
def host_of_processes() -> tuple[int, ...]:
    """The host of each process (0, 1, ... in the order of their first process): processes
    whose devices share a machine's interconnect (NVLink, ICI) share a host. On CPU every
    process is a host of its own, since its devices reach another process's only over gloo's
    TCP, on one machine or two. Computed once: an all-gather of host names over the job."""
    count = jax.process_count()
    if count == 1:
        return (0,)
    if jax.devices()[0].platform == "cpu":
        return tuple(range(count))
    from jax.experimental import multihost_utils

    name = hashlib.sha256(socket.gethostname().encode()).digest()[:8]
    names = np.asarray(multihost_utils.process_allgather(np.frombuffer(name, np.uint32)))
    first: dict[bytes, int] = {}
    return tuple(first.setdefault(row.tobytes(), len(first)) for row in names)


def coordinator_bind_address(coordinator_address: str | None, environ=None) -> str | None:
    """Where process 0's coordinator listens: the address it was given, when that is an IP
    address of this machine (127.0.0.1 under jddp-launch: no other machine can reach the
    unauthenticated service). None, JAX's default of every interface (or the
    JAX_COORDINATOR_BIND_ADDRESS a user set), for a host name (other machines may resolve it to
    another address than this one does) or an address this machine does not have (behind NAT)."""
    environ = os.environ if environ is None else environ
    if not coordinator_address or environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    host, _, port = coordinator_address.rpartition(":")
    try:
        address = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError:  # not an address of this machine
        return None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def check_same_everywhere(what: str, value) -> None:
    """Raises ConfigError unless every process holds the same `value` (a no-op for one)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest()[:8], np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(digest))
    differing = [p for p in range(len(gathered)) if not np.array_equal(gathered[p], gathered[0])]
    if differing:
        raise ConfigError(
            f"processes {differing} disagree with process 0 on the {what}; start every process "
            "with the same command, config and jddp version"
        )


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jddp: {name}")

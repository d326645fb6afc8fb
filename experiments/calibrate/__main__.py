"""`python -m experiments.calibrate`: measures this machine (8 simulated CPU devices, and 2
processes x 2 devices over gloo) and stores it as the planner's `cpu` profile, which
`python -m jddp.plan --device=cpu` reads. `--worker` is the gloo half, started by the launcher.
"""

import json
import sys

from jddp.run.cli import fail
from jddp.runtime import host_memory


def _worker() -> None:
    from jddp.runtime import processes as runtime

    host_memory.keep_freed_memory()
    runtime.initialize()
    import jax

    from experiments.calibrate.measure import PAIR, collective_seconds

    devices = jax.devices()  # process by process: a pair is one process's own devices
    seconds = {n: collective_seconds(devices, n) for n in (len(devices), PAIR)}
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(seconds), flush=True)


def main() -> None:
    # Measured as jddp's programs run: XLA:CPU's step buffers reuse freed host memory
    # (jddp/runtime/host_memory.py), set before JAX starts its threads.
    host_memory.keep_freed_memory()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    from experiments.calibrate.profile import calibrate
    from jddp.errors import JddpError

    try:
        path, m = calibrate()
    except JddpError as e:
        fail(str(e))
    print(
        f"cpu profile written to {path}: matmul {m['matmul_flops'] / 1e9:.0f} GFLOP/s, memory "
        f"{m['memory_bandwidth'] / 1e9:.1f} GB/s, load average {m['load_average']:.1f}"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    elif sys.argv[1:]:
        fail(f"unexpected arguments {sys.argv[1:]}; run `python -m experiments.calibrate`")
    else:
        main()

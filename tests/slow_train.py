"""`python -m tests.slow_train ARGS...`: `experiments.train ARGS` whose loop sleeps
JDDP_TEST_STEP_SLEEP_S seconds (default 0.1) each time it logs a step, so that a test acting
between steps (killing a process, changing the slots of an elastic job) acts while the run
still has steps to go, however fast the machine."""

import functools
import os
import time

from absl import app

from jddp.observe.progress import Progress


def install() -> None:
    update = Progress.update

    @functools.wraps(update)
    def slow(*args, **kwargs):
        time.sleep(float(os.environ.get("JDDP_TEST_STEP_SLEEP_S", 0.1)))
        return update(*args, **kwargs)

    Progress.update = slow


if __name__ == "__main__":
    from experiments import train

    install()
    app.run(train.main, flags_parser=train.CONFIG.parse)

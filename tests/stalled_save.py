"""`python -m tests.stalled_save MARKER ARGS...`: `experiments.train ARGS` whose first checkpoint
save stops just before its commit (the rename of its temporary directory) and stays there, after
writing the step it was saving to the file MARKER. A test that kills it then kills it inside an
asynchronous save every time, not only when a poll happens to fall inside one. Once MARKER
exists, saves commit as usual: a job restarted with the same command goes on. Its loop is as
slow as tests/slow_train.py's."""

import os
import sys
import threading

from absl import app
from orbax.checkpoint._src.path import atomicity

MARKER = sys.argv.pop(1)
_commit = atomicity.AtomicRenameTemporaryPath.finalize


async def _stalled_commit(self, *args, **kwargs):
    step = os.path.basename(str(self._final_path))
    if step.isdigit() and not os.path.exists(MARKER):  # a step's directory, not an item
        with open(MARKER + ".tmp", "w") as f:
            f.write(step)
        os.replace(MARKER + ".tmp", MARKER)  # the test never reads half a step
        threading.Event().wait()  # until killed
    return await _commit(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = _stalled_commit

if __name__ == "__main__":
    from experiments import train
    from tests import slow_train

    slow_train.install()
    app.run(train.main, flags_parser=train.CONFIG.parse)

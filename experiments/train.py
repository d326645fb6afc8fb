"""`python -m experiments.train`: the installed `jddp-train` (jddp/run/train.py) run from a
checkout, with experiments/configs/digits_mlp.py as its default config and the configs beside it
suggested when --config names no file.

    python -m experiments.train --config=experiments/configs/digits_mlp.py --workdir=runs/mlp
"""

import os

from jddp.run.train import CONFIG, main, run

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CONFIG.default_path = os.path.join(_CONFIGS, "digits_mlp.py")
CONFIG.examples_dir = _CONFIGS

__all__ = ["CONFIG", "main", "run"]  # tests run `app.run(main, flags_parser=CONFIG.parse)`

if __name__ == "__main__":
    run()

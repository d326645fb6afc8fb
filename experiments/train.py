"""`python -m experiments.train`: the installed `jddp-train` (jddp/run/train.py) run from a
checkout, with experiments/configs/digits_mlp.py as its default config and the configs beside it
suggested when --config names no file.

    python -m experiments.train --config=experiments/configs/digits_mlp.py --workdir=runs/mlp
"""

import os

from jddp.run import train
from jddp.run.cli import ConfigFlag

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CONFIG = ConfigFlag(os.path.join(_CONFIGS, "digits_mlp.py"), examples_dir=_CONFIGS)


def main(argv: list[str]) -> None:
    """absl's main (tests run `app.run(main, flags_parser=CONFIG.parse)`)."""
    train.main(argv, config=CONFIG)


def run() -> None:
    train.run(CONFIG)


if __name__ == "__main__":
    run()

"""Train an experiment config with data parallelism over all local devices.

    python -m experiments.train --config=experiments/configs/digits_mlp.py --workdir=runs/mlp \
        --config.global_batch_size=256

With no flags it trains the default experiment (digits_mlp) into a new workdir under runs/.
A user mistake (bad flag, config value, workdir) ends in one line on stderr and exit code 2.
"""

import datetime
import logging as logging_std
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "digits_mlp.py")

USAGE_EXIT_CODE = 2
_CONFIG = _WORKDIR = None  # defined by _parse_flags, which absl calls before main


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, with every user mistake turned into one line and exit code 2."""
    global _CONFIG, _WORKDIR
    try:
        # DEFINE_config_file reads the --config.KEY overrides from argv as it defines them.
        _CONFIG = config_flags.DEFINE_config_file(
            "config",
            DEFAULT_CONFIG,
            "Experiment config file (get_config() -> ConfigDict).",
            sys_argv=argv,
        )
        _WORKDIR = flags.DEFINE_string(
            "workdir",
            None,
            "Directory for metrics, TensorBoard files and checkpoints "
            "(default: a new runs/CONFIG-TIMESTAMP).",
        )
        rest = flags.FLAGS(argv)
        _CONFIG.value.keys()  # a missing file surfaces only when the config is first read
        return rest
    except OSError:
        _fail(
            f"config file {_config_path()!r} not found; pass --config=PATH, e.g. one of "
            f"experiments/configs/{{{','.join(_builtin_configs())}}}.py"
        )
    except (KeyError, AttributeError) as e:
        _fail(
            f"config has no key {str(e).strip(chr(34))}; check the --config.KEY=VALUE "
            "overrides against the keys in the config file"
        )
    except flags.Error as e:
        raised = re.findall(r"^(\w+(?:Error|Exception): .*)$", str(e), re.MULTILINE)
        reason = raised[-1] if raised else str(e).splitlines()[0]
        _fail(f"{reason} (in --config or a flag; see --help)")
    except Exception as e:  # noqa: BLE001 - the user's config file raised: report it in one line
        _fail(f"config file failed to load: {type(e).__name__}: {str(e).splitlines()[0]}")


def _config_path() -> str:
    return config_flags.get_config_filename(flags.FLAGS["config"])


def _builtin_configs() -> list[str]:
    folder = os.path.dirname(DEFAULT_CONFIG)
    return sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n[0] != "_")


def _default_workdir(config_path: str) -> str:
    name = os.path.splitext(os.path.basename(config_path))[0]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{name}-{stamp}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; flags look like --config.KEY=VALUE")
    # Imported here so that --help and flag errors answer without loading JAX.
    from jddp.errors import JddpError
    from jddp.experiment import train_and_evaluate

    workdir = _WORKDIR.value or _default_workdir(_config_path())
    # JAX logs at INFO that it found no TPU: noise on every CPU and GPU run.
    logging_std.getLogger("jax._src.xla_bridge").setLevel(logging_std.WARNING)
    try:
        summary = train_and_evaluate(_CONFIG.value, workdir)
    except JddpError as e:
        _fail(str(e))
    perplexity = summary.get("eval_perplexity")  # language models
    print(
        f"done: eval accuracy {summary['eval_accuracy']:.4f}, "
        f"eval loss {summary['eval_loss']:.4f}, "
        + (f"perplexity {perplexity:.3f}, " if perplexity is not None else "")
        + f"wall time {summary['wall_time_sec']:.1f} s; workdir {os.path.abspath(workdir)}"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

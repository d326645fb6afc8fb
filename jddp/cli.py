"""Command-line plumbing shared by jddp's programs: an ml_collections config file flag whose every
user mistake (missing file, unknown key, bad value) ends in one line on stderr and exit code 2."""

import logging
import os
import re
import sys

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

USAGE_EXIT_CODE = 2


def quiet_library_logs() -> None:
    """Keeps orbax's per-save and TFDS's per-read INFO chatter out of the training log
    (their warnings still show)."""

    def keep(record) -> bool:
        noisy = "/orbax/" in record.pathname or "/tensorflow_datasets/" in record.pathname
        return record.levelno >= logging.WARNING or not noisy

    for handler in {*logging.getLogger().handlers, absl_logging.get_absl_handler()}:
        handler.addFilter(keep)
    # JAX logs at INFO that it found no TPU: noise on every CPU and GPU run.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def fail(message: str) -> None:
    """Ends the program the way every user mistake ends: `error: ...`, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


class ConfigFlag:
    """`--config=FILE` plus `--config.KEY=VALUE` overrides; pass `parse` to `app.run`."""

    def __init__(self, default_path: str):
        self.default_path = default_path
        self._holder = None

    @property
    def value(self):
        return self._holder.value

    @property
    def path(self) -> str:
        return config_flags.get_config_filename(flags.FLAGS["config"])

    def parse(self, argv: list[str]) -> list[str]:
        """absl's parse, with every user mistake turned into one line and exit code 2."""
        try:
            # DEFINE_config_file reads the --config.KEY overrides from argv as it defines them.
            self._holder = config_flags.DEFINE_config_file(
                "config",
                self.default_path,
                "Experiment config file (get_config() -> ConfigDict).",
                sys_argv=argv,
            )
            rest = flags.FLAGS(argv)
            self._holder.value.keys()  # a missing file surfaces only when the config is read
            return rest
        except OSError:
            fail(
                f"config file {self.path!r} not found; pass --config=PATH, e.g. one of "
                f"experiments/configs/{{{','.join(self._builtin_configs())}}}.py"
            )
        except (KeyError, AttributeError) as e:
            fail(
                f"config has no key {str(e).strip(chr(34))}; check the --config.KEY=VALUE "
                "overrides against the keys in the config file"
            )
        except flags.Error as e:
            raised = re.findall(r"^(\w+(?:Error|Exception): .*)$", str(e), re.MULTILINE)
            reason = raised[-1] if raised else str(e).splitlines()[0]
            fail(f"{reason} (in --config or a flag; see --help)")
        except Exception as e:  # noqa: BLE001 - the user's config file raised: one line
            fail(f"config file failed to load: {type(e).__name__}: {str(e).splitlines()[0]}")

    def _builtin_configs(self) -> list[str]:
        folder = os.path.dirname(self.default_path)
        return sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n[0] != "_")

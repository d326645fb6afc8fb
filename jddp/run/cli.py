"""Command-line plumbing shared by jddp's programs: an ml_collections config file flag whose every
user mistake (missing file, unknown key, bad value) ends in one line on stderr and exit code 2."""

import ast
import contextlib
import os
import re
import sys

from absl import flags
from ml_collections import config_flags

from jddp import errors
from jddp.errors import MISTAKE_EXIT_CODE as USAGE_EXIT_CODE
from jddp.runtime import quiet

NUMBER = r"\s*((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*"  # 450, 0.5, .5, 989e12, 3E-6
_BYTE_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20}
_BYTE_UNITS |= {"GI": 2**30, "TI": 2**40}


def fail(message: str, exit_code: int = USAGE_EXIT_CODE) -> None:
    """Ends the program the way every user mistake ends: `error: ...`, exit code 2 (or the
    `exit_code` of the error it reports: 75 for one a later try may get past)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


def fail_with(error: BaseException) -> None:
    """`fail` for a caught error: its first line, and its class's exit code (jddp/errors.py)."""
    fail(str(error).splitlines()[0] if str(error) else type(error).__name__, exit_code(error))


def exit_code(error: BaseException) -> int:
    """The exit code the contract in jddp/errors.py gives `error`: a JddpError's own, 75 for an
    OSError (the file system's refusal, which a later try may get past), 130 for Ctrl-C, else 1
    (a failure, as an uncaught exception ends Python)."""
    if isinstance(error, OSError):
        return errors.RETRYABLE_EXIT_CODE
    if isinstance(error, KeyboardInterrupt):
        return errors.INTERRUPTED_EXIT_CODE
    return getattr(error, "exit_code", 1)


def program_quiet() -> quiet.SharedChange:
    """What jddp's programs keep off their console: orbax's and TFDS's INFO chatter, and the
    reports of checkpoint and TensorBoard failures that jddp has reported itself in one line
    (some come late: when the garbage collector reaches orbax's abandoned tasks, or at exit)."""
    from jddp.checkpoints.orbax_noise import FAILURES_REPORTED
    from jddp.observe.tensorboard_writer import TENSORBOARDX_FAILURES

    return quiet.together(quiet.LIBRARY_INFO_KEPT_OUT, FAILURES_REPORTED, TENSORBOARDX_FAILURES)


def quiet_program() -> None:
    """`program_quiet` held until the process ends: for jddp's own programs, which own their
    process (the library holds these only within its calls)."""
    quiet.hold_for_process(program_quiet())


def parse_amount(flag: str, text: str) -> float:
    """'80GB', '24GiB', '450e9', '450GB/s' -> a number of bytes (or bytes/s): KB, MB, GB, TB
    in 1000s (as transformers' max_shard_size), KiB ... TiB in 1024s. One line and exit 2 if
    `text` is not one."""
    match = re.fullmatch(NUMBER + r"([KMGT]?I?)B?(?:/S)?\s*", text, re.IGNORECASE)
    if not match:
        fail(f"--{flag}={text!r} is not an amount; write e.g. 80GB, 24GiB, 450e9")
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]


class ConfigFlag:
    """`--config=FILE` plus `--config.KEY=VALUE` overrides; pass `parse` to `app.run`.

    `--config.model_args.NAME=VALUE` may name any argument of the model, whether or not the file
    sets it (the model refuses names it lacks); every other key must exist in the file.
    `examples_dir` (a folder of config files) is suggested when the file is not found. The
    directory of a file `--config` names becomes importable (see `importable_config_dir`).
    """

    def __init__(self, default_path: str, examples_dir: str | None = None):
        self.default_path = default_path
        self.examples_dir = examples_dir
        self._holder = None

    @property
    def value(self):
        return self._holder.value

    @property
    def path(self) -> str:
        return config_flags.get_config_filename(flags.FLAGS["config"])

    def parse(self, argv: list[str]) -> list[str]:
        """absl's parse, with every user mistake turned into one line and exit code 2."""
        model_args, argv = _split_model_args(argv)
        path = _config_path(argv, self.default_path)  # the flag is unreadable if parsing failed
        if path != self.default_path:
            importable_config_dir(path)
        try:
            # DEFINE_config_file reads the --config.KEY overrides from argv as it defines them.
            self._holder = config_flags.DEFINE_config_file(
                "config",
                self.default_path,
                "Experiment config file: a Python file whose get_config() returns an "
                "ml_collections.ConfigDict; --config.KEY=VALUE overrides a key (every key: "
                "docs/configs.md).",
                sys_argv=argv,
            )
            # --help lists the main program's key flags: --config is one, whoever defines it.
            flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
            rest = flags.FLAGS(argv)
            config = self._holder.value
            config.keys()  # a missing file surfaces only when the config is read
        except BrokenPipeError:  # `--help | head`: the reader left (Python's documented recipe)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError:
            fail(f"config file {path!r} not found; pass --config=PATH{self._examples()}")
        except AttributeError as e:
            if "attribute 'get_config'" in str(e):
                fail(
                    f"config file {path!r} defines no get_config(); define get_config() "
                    "returning an ml_collections.ConfigDict (start from "
                    "jddp.run.config.default_config())"
                )
            fail(_missing_key(e, argv, path))
        except KeyError as e:
            fail(_missing_key(e, argv, path))
        except flags.Error as e:
            raised = re.findall(r"^(\w+(?:Error|Exception): .*)$", str(e), re.MULTILINE)
            reason = raised[-1] if raised else str(e).splitlines()[0]
            fail(f"{reason} (in --config or a flag; see --help)")
        except Exception as e:  # the user's config file raised: one line
            fail(f"config file failed to load: {type(e).__name__}: {str(e).splitlines()[0]}")
        if model_args:
            if "model_args" not in config:
                fail("config has no key model_args; start get_config() from default_config()")
            with config.unlocked():
                config.model_args.update(model_args)
        return rest

    def _examples(self) -> str:
        folder = self.examples_dir
        if not folder or not os.path.isdir(folder):
            return " to a file that defines get_config()"
        names = sorted(n[:-3] for n in os.listdir(folder) if n.endswith(".py") and n[0] != "_")
        return f", e.g. one of {os.path.relpath(folder)}/{{{','.join(names)}}}.py"


def importable_config_dir(path: str) -> None:
    """Makes the directory of config file `path` importable, as Python does a script's: a model
    named "my_models:Net" may live beside the config. Appended to `sys.path`, so that a file there
    cannot shadow a package jddp itself imports. Entry points call this; importing jddp does not."""
    file = path.split(":", 1)[0]  # ml_collections' "FILE:ARGUMENT" form
    folder = os.path.dirname(os.path.abspath(file))
    if os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(folder)


def _missing_key(error: Exception, argv: list[str], path: str) -> str:
    """The one line for a KeyError / AttributeError while loading: a `--config.KEY` override
    naming no key (with ml_collections' suggestion, if it made one), or else an error raised
    by the config file's own get_config()."""
    text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    if text[:1] in ("'", '"'):  # ml_collections nests the repr of its KeyError's message
        with contextlib.suppress(ValueError, SyntaxError):
            text = ast.literal_eval(text)
    key = re.findall(r"""['"]([^'"]+)['"]""", text)
    overridden = {
        arg[len("--config.") :].split("=")[0] for arg in argv if arg.startswith("--config.")
    }
    named = key[0] if key else text
    if not any(named in o.split(".") for o in overridden):
        return (
            f"config file {path!r} failed to load: {type(error).__name__}: {text.splitlines()[0]}"
        )
    close = re.search(r"""Did you mean ['"]([^'"]+)['"]""", text)
    hint = f" (did you mean {close[1]!r}?)" if close else ""
    return (
        f"config has no key {named!r}{hint}; check the --config.KEY=VALUE overrides against "
        "the keys in the config file"
    )


def _config_path(argv: list[str], default: str) -> str:
    """The config file `--config=PATH` (or `--config PATH`) names in `argv`, else `default`."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return default


_MODEL_ARG = re.compile(r"^--config\.model_args\.(\w+)(?:=(.*))?$", re.DOTALL)


def _split_model_args(argv: list[str]) -> tuple[dict, list[str]]:
    """({name: value}, the other arguments) from `--config.model_args.NAME=VALUE` (or
    `... NAME VALUE`); values are Python literals (`(64,64)`, `0.1`, `true`) or else strings."""
    found, rest, args = {}, [], iter(argv)
    for arg in args:
        match = _MODEL_ARG.match(arg)
        if not match:
            rest.append(arg)
            continue
        text = match.group(2)
        found[match.group(1)] = _literal(next(args, "") if text is None else text)
    return found, rest


def _literal(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text

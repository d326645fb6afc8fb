"""Importing what a config names in the user's own code ("package.module:Name"), with every way it
can fail as one line: a module that is not there, one that raises while imported, a missing name.
Own models (jddp/models/user_models.py) and own data functions (jddp/data/user_data.py) use it."""

import difflib
import importlib
import os
import re
import traceback
from typing import Any

from jddp.errors import ConfigError

IMPORT_PATH = re.compile(r"^(?P<module>\w+(?:\.\w+)*):(?P<attr>\w+(?:\.\w+)*)$")
WHERE = "put it beside the config file or on PYTHONPATH"


def load(spec: str, label: str, *, hint: str = "", failure: type[Exception] = ConfigError) -> Any:
    """The object `spec` ("package.module:attr.attr") names. `label` starts each error line
    ("model 'x:Y'"), `hint` ends the one for a missing module; an exception the user's module
    raises while imported becomes `failure`. `spec` must match IMPORT_PATH."""
    match = IMPORT_PATH.match(spec)
    module_name, attr = match["module"], match["attr"]
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # not found, or the user's module raised while it was imported
        if isinstance(e, ModuleNotFoundError) and _names_part_of(e.name, module_name):
            raise ConfigError(
                f"{label}: no module named {e.name!r} on sys.path; {WHERE} "
                f"(as {module_name.replace('.', '/')}.py){hint}"
            ) from None
        raise failure(f"{label}: importing {module_name!r} failed: {brief(e)}") from None
    found, path = module, module_name
    for part in attr.split("."):
        if not hasattr(found, part):
            names = [n for n in dir(found) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            than = f"did you mean {', '.join(close)}?" if close else f"it has {_listing(names)}"
            where = getattr(found, "__file__", None)
            raise ConfigError(
                f"{label}: {path!r}{f' ({where})' if where else ''} has no {part!r}; {than}"
            )
        found, path = getattr(found, part), f"{path}.{part}"
    return found


def _names_part_of(name: str | None, module_name: str) -> bool:
    """Whether `name` is `module_name` or a package above it ('pkg' of 'pkg.models')."""
    return bool(name) and (module_name == name or module_name.startswith(name + "."))


def brief(error: BaseException) -> str:
    """`Type: first line of the message (at FILE:LINE)`: the innermost line of the user's own
    code that raised it (not jddp's, nor an installed library's, where there is one)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if isinstance(error, SyntaxError) and error.filename:
        return f"{text} (at {error.filename}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not _is_library(f.filename)] or frames
    return f"{text} (at {own[-1].filename}:{own[-1].lineno})" if own else text


_JDDP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_library(filename: str) -> bool:
    """Whether a traceback frame is jddp's, the standard library's or an installed package's."""
    path = os.path.abspath(filename)
    return (
        path.startswith(_JDDP_DIR + os.sep)
        or "site-packages" in path
        or path.startswith(os.path.dirname(os.__file__) + os.sep)
        or filename.startswith("<")
    )


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most]) + (", ..." if len(names) > most else "")
    return shown or "no public names"

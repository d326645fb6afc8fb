"""Library calls leave the process as they found it: importing jddp, `jddp.fit` and
`jddp.restore` (restoring, falling back past a damaged checkpoint, failing) leave
`sys.unraisablehook`, `threading.excepthook` and the root, absl and asyncio loggers' filters and
handlers as they were, object for object; what keeps orbax's expected noise off the console is
held while a call needs it, shared by the calls that overlap, and given back by the last.

The library's calls run in a child process (`python -m tests.test_process_state WORKDIR`), whose
state nothing else (pytest, an earlier test) has touched before it takes the first look."""

import glob
import json
import logging
import os
import subprocess
import sys
import threading

import pytest


def process_state() -> dict[str, list]:
    """The hooks and logging objects a library might change, by name."""
    from absl import logging as absl_logging

    root = logging.getLogger()
    return {
        "sys.unraisablehook": [sys.unraisablehook],
        "threading.excepthook": [threading.excepthook],
        "root logger's filters": list(root.filters),
        "root logger's handlers": list(root.handlers),
        "root handlers' filters": [f for handler in root.handlers for f in handler.filters],
        "absl logger's filters": list(logging.getLogger("absl").filters),
        "absl handler's filters": list(absl_logging.get_absl_handler().filters),
        "asyncio logger's filters": list(logging.getLogger("asyncio").filters),
    }


def changed(before: dict[str, list], after: dict[str, list]) -> list[str]:
    """The names whose objects are not the very same ones as before."""
    return [
        name
        for name, objects in before.items()
        if len(objects) != len(after[name])
        or any(a is not b for a, b in zip(objects, after[name], strict=True))
    ]


def damage(checkpoint_dir: str) -> None:
    """Cuts every data file of a checkpoint's state in half."""
    for path in glob.glob(os.path.join(checkpoint_dir, "state", "**", "d", "*"), recursive=True):
        os.truncate(path, os.path.getsize(path) // 2)


def library_calls(workdir: str) -> dict:
    """What each library call changed in the process (names from `process_state`) and what it
    returned or raised."""
    # What the libraries jddp builds on do on import is theirs: absl configures the root logger
    # the first time anything logs through it (orbax and grain do, on import).
    import grain  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    start = process_state()
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    import jddp

    class TinyMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batch = {"image": x, "label": x[:, :4].argmax(1).astype(np.int32)}
    trainer = jddp.Trainer(
        TinyMLP(), jddp.losses.softmax_cross_entropy, optax.adam(1e-2), devices=jax.devices()[:1]
    )
    report = {"changed": {"import jddp": changed(start, process_state())}}

    def call(name: str, function):
        before = process_state()
        try:
            result = function()
            outcome = None if result is None else int(result.step)
        except jddp.JddpError as e:
            outcome = type(e).__name__
        report["changed"][name] = changed(before, process_state())
        report[name] = outcome

    checkpoints = os.path.join(workdir, "checkpoints")
    fit = dict(workdir=workdir, num_steps=4, checkpoint_every=2, log_every=2)
    call("fit", lambda: jddp.fit(trainer, [batch] * 4, **fit))
    call("restore", lambda: jddp.restore(workdir, trainer, batch))
    damage(os.path.join(checkpoints, "4"))
    call("restore past a damaged checkpoint", lambda: jddp.restore(workdir, trainer, batch))
    call("restore of a missing step", lambda: jddp.restore(workdir, trainer, batch, step=3))
    damage(os.path.join(checkpoints, "2"))
    call("restore of damaged checkpoints", lambda: jddp.restore(workdir, trainer, batch))
    call("fit on damaged checkpoints", lambda: jddp.fit(trainer, [batch] * 4, **fit))
    report["changed"]["all calls"] = changed(start, process_state())
    return report


def child_output(*args: str) -> str:
    """The last line a fresh `python ARGS` printed, run in the checkout (exit status 0)."""
    from tests.helpers import REPO, checkout_env  # not in the child: it imports jddp

    result = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_library_calls_leave_hooks_and_log_filters_as_they_found_them(tmp_path):
    report = json.loads(child_output("-m", "tests.test_process_state", str(tmp_path / "run")))
    # The calls did what they are for: each outcome is the documented one.
    assert report["fit"] == 4 and report["restore"] == 4
    assert report["restore past a damaged checkpoint"] == 2  # a reader: 4 left where it is
    assert report["restore of a missing step"] == "CheckpointError"
    assert report["restore of damaged checkpoints"] == "CheckpointError"
    assert report["fit on damaged checkpoints"] == "CheckpointError"  # set aside, no fresh start
    assert report["changed"] == dict.fromkeys(report["changed"], []), report["changed"]


# ------------------------------------------------ overlapping users, in this process and threads
def open_checkpoints(path):
    from jddp.checkpoints.store import Checkpoints

    return Checkpoints(str(path), every=1, max_to_keep=None)


@pytest.mark.parametrize("first_closed", [0, 1])
def test_two_open_checkpoint_managers_share_the_filters_and_the_last_close_removes_them(
    tmp_path, first_closed
):
    before = process_state()
    managers = [open_checkpoints(tmp_path / "a")]
    held = process_state()
    assert set(changed(before, held)) == {
        "sys.unraisablehook", "absl logger's filters", "asyncio logger's filters",
    }  # fmt: skip
    opened = threading.Thread(target=lambda: managers.append(open_checkpoints(tmp_path / "b")))
    opened.start()
    opened.join()
    assert changed(held, process_state()) == []  # shared, not installed twice
    managers.pop(first_closed).close()
    assert changed(held, process_state()) == []  # the other one still needs them
    closing = threading.Thread(target=managers.pop().close)
    closing.start()
    closing.join()
    assert changed(before, process_state()) == []


def test_a_hook_set_over_ours_is_kept_and_ours_then_drops_nothing(monkeypatch):
    from jddp.runtime import quiet

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    drop = quiet.drop_unraisable(lambda report: report == "expected")
    with drop.held():
        ours = sys.unraisablehook
        ours("expected")
        ours("other")
        assert seen == ["other"]

        def theirs(report):
            ours(report)

        sys.unraisablehook = theirs  # another library wraps ours
    assert sys.unraisablehook is theirs  # not replaced by the hook we found
    theirs("expected")
    assert seen == ["other", "expected"]  # ours, still under theirs, passes everything on


# ----------------------------------------------------------- no module rewrites another's globals
def test_the_checkouts_command_passes_its_default_config_instead_of_rewriting_the_librarys():
    from experiments import train as checkout_train
    from jddp.run import train

    assert train.CONFIG.default_path == train.PACKAGED_CONFIG and train.CONFIG.examples_dir is None
    assert checkout_train.CONFIG is not train.CONFIG
    assert checkout_train.CONFIG.default_path.endswith("experiments/configs/digits_mlp.py")


def test_the_usage_is_lent_to_the_main_module_only_while_the_flags_are_parsed(tmp_path):
    """absl's --help prints `__main__`'s docstring: jddp-train's parse lends it USAGE and gives
    the program's own back (in a child: parsing defines absl flags for the process)."""
    script = (
        '"""The main module\'s own docstring."""\n'
        "import sys\n"
        "from jddp.run import train\n"
        "train._parse(train.CONFIG, ['jddp-train', '--workdir=unused'])\n"
        "print(sys.modules['__main__'].__doc__)\n"
    )
    (tmp_path / "program.py").write_text(script)
    assert child_output(str(tmp_path / "program.py")) == "The main module's own docstring."


if __name__ == "__main__":
    print(json.dumps(library_calls(sys.argv[1])))

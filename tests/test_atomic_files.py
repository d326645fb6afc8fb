"""Files jddp writes outside orbax are whole or absent (temporary name, fsync, rename, folder
fsync); files torn by an older version are one line when read; an export replaces or writes only
what it made itself."""

import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from jddp.checkpoints import hf, hf_files
from jddp.checkpoints.export import export_params
from jddp.checkpoints.weights import load_params
from jddp.errors import CheckpointError
from jddp.run import experiment
from jddp.runtime import atomic_write
from tests.helpers import assert_one_line, snapshot, tiny_jddp_llama


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "goodput.json"
    atomic_write.write_json(str(path), {"version": 1})

    def interrupt(value):  # json.dump has written '{"version": 2, "when": ' by then
        raise KeyboardInterrupt

    for failure, options in ((TypeError, {}), (KeyboardInterrupt, {"default": interrupt})):
        with pytest.raises(failure):
            atomic_write.write_json(str(path), {"version": 2, "when": object()}, **options)
        assert json.loads(path.read_text()) == {"version": 1}
        assert os.listdir(tmp_path) == ["goodput.json"]  # the temporary file is gone

    # A write that succeeds: the file is flushed before the rename, the folder after it.
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(b), real_replace(a, b)))
    atomic_write.write_text(str(path), "é\n")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == "é\n".encode()
    temporary, replaced, folder = events
    assert temporary.startswith(str(tmp_path / ".goodput.json."))
    assert (replaced, folder) == (str(path), str(tmp_path))
    plain = tmp_path / "plain"
    plain.write_text("")  # open(..., "w")'s mode under this umask
    assert path.stat().st_mode == plain.stat().st_mode


def test_a_torn_summary_or_config_from_an_older_version_is_one_line(tmp_path, caplog):
    workdir = tmp_path / "run"
    (workdir / "export").mkdir(parents=True)
    config = ml_collections.ConfigDict({"num_train_steps": 4, "model": "mlp"})
    summary = workdir / "summary.json"
    summary.write_text('{"step": 4, "eval_loss": 0.25}')
    assert experiment._finished_summary(str(workdir), config, 4) == {"eval_loss": 0.25}

    for torn in (b'{"step": 4, "eval_lo', b'{"step": 4, "x": "\xe2\x82', b"[4]"):
        summary.write_bytes(torn)
        caplog.clear()
        assert experiment._finished_summary(str(workdir), config, 4) is None  # done again
        (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert str(summary) in warning and "\n" not in warning

    written = config.to_json_best_effort(indent=2, sort_keys=True) + "\n"
    (workdir / "config.json").write_bytes(written.encode()[:9] + b"\xe2\x82")  # cut in a char
    experiment.write_config(str(workdir), config)
    assert (workdir / "config.json").read_text() == written


def test_force_keeps_the_old_export_until_the_new_one_is_complete(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    export = str(workdir / "export")
    first = {"w": np.arange(4.0), "b": np.ones(3)}
    second = {"w": np.arange(4.0) + 2, "b": np.zeros(3)}
    experiment.write_export(str(workdir), first)
    for interruption in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(interruption):  # the new export written, then cut before the swap
            with atomic_write.replacing_directory(export) as staged:
                export_params(staged, second)
                assert sorted(os.listdir(workdir)) == ["export", "export.next"]
                raise interruption
        assert sorted(os.listdir(workdir)) == ["export"]  # nothing of the cut one is left
        jax.tree.map(np.testing.assert_array_equal, load_params(export), first)
    experiment.write_export(str(workdir), second)
    assert sorted(os.listdir(workdir)) == ["export"]
    jax.tree.map(np.testing.assert_array_equal, load_params(export), second)


def test_an_export_beside_a_partial_that_is_not_its_own_refuses_and_leaves_it(tmp_path):
    model, params = tiny_jddp_llama()
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("someone else's")
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    for marker, words in (
        (None, ["no .jddp-export"]),
        (f"{os.getppid()} {os.uname().nodename}", [f"process {os.getppid()}"]),  # alive
        (f"{dead.pid} another-host", [f"process {dead.pid} on another-host"]),
    ):
        if marker:
            (partial / hf_files.PARTIAL_MARKER).write_text(marker)
        before = snapshot(tmp_path)
        for refused in (hf.check_output, lambda out: hf.save(params, model, out)):
            with pytest.raises(CheckpointError) as error:  # jddp-export checks before reading
                refused(str(out))
            assert_one_line(error, str(partial), "not this export's", *words, "remove it")
        assert snapshot(tmp_path) == before  # untouched, and no OUT
    # Left by a jddp export on this host that was killed: taken over.
    (partial / hf_files.PARTIAL_MARKER).write_text(f"{dead.pid} {os.uname().nodename}")
    hf.save(params, model, str(out))
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert hf_files.PARTIAL_MARKER not in os.listdir(out)
    hf.check(str(out), model, params)

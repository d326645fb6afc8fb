"""Files a run reads but did not write are judged before they are used: a checkpoint's metadata
never picks code to import, a Hugging Face index names files inside its directory and tensors of
floating types, a tokenizer's ids fit the checkpoint's vocabulary, the workdir's lock file is a
plain file of its own, and a file system without flock is one line."""

import errno
import fcntl
import json
import os
import sys

import ml_collections
import numpy as np
import pytest

from jddp import data
from jddp.checkpoints import hf, hf_files
from jddp.errors import RETRYABLE_EXIT_CODE, CheckpointError, DataError, WorkdirBusy, WorkdirError
from jddp.run import experiment, resume
from jddp.runtime.workdir import hold_workdir
from tests.helpers import assert_one_line, snapshot, tiny_jddp_llama
from tests.tiny_tokenizer import VOCAB_SIZE, save_tokenizer

PLANTED = """
import os
open(os.environ["PLANTED_WITNESS"], "w").close()
import flax.linen as nn
class Net(nn.Module):
    width: int = 3
"""


def test_resume_imports_only_the_model_the_config_names(tmp_path, monkeypatch):
    # A module planted where imports find it (a workdir on sys.path), named by a checkpoint.
    (tmp_path / "planted_by_checkpoint.py").write_text(PLANTED)
    witness = tmp_path / "imported"
    monkeypatch.setenv("PLANTED_WITNESS", str(witness))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted_by_checkpoint", raising=False)  # removed after
    saved = {"model": "planted_by_checkpoint:Net", "model_args": {}}
    config = ml_collections.ConfigDict({"model": "mlp", "model_args": {}})
    changes = resume.config_changes(saved, config)
    assert changes["model"] == ["planted_by_checkpoint:Net", "mlp"]
    assert not witness.exists() and "planted_by_checkpoint" not in sys.modules
    # The config naming it itself is what imports it (and its defaults count on both sides).
    config.model = "planted_by_checkpoint:Net"
    assert resume.config_changes(saved | {"model_args": {"width": 3}}, config) == {}
    assert witness.exists()


def test_a_hugging_face_index_names_only_files_inside_its_directory(tmp_path):
    model, params = tiny_jddp_llama()
    folder = tmp_path / "hf"
    hf.save(params, model, str(folder), max_shard_bytes=2000)  # sharded: with an index
    hf.check(str(folder), model, params)
    index = json.loads((folder / hf_files.INDEX).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((folder / shard).read_bytes())  # a real shard: only the path is wrong
    for elsewhere in ("../outside.safetensors", str(outside), "sub/../../outside.safetensors"):
        index["weight_map"][name] = elsewhere
        (folder / hf_files.INDEX).write_text(json.dumps(index))
        with pytest.raises(CheckpointError) as error:
            hf.check(str(folder), model, params)
        assert_one_line(error, repr(elsewhere), "outside the directory")


def test_tensors_of_types_other_than_floating_ones_are_refused(tmp_path):
    model, params = tiny_jddp_llama()
    tensors = hf.hf_tensors(params, model)
    config = json.loads(json.dumps(hf._architecture(model).hf_config(model)))
    for dtype, refused in ((np.float16, None), (np.int8, "I8"), (np.int32, "I32")):
        folder = tmp_path / np.dtype(dtype).name
        as_dtype = {k: v.astype(dtype) for k, v in tensors.items()}
        hf_files.write(str(folder), config, as_dtype, hf_files.DEFAULT_MAX_SHARD_BYTES)
        if refused is None:
            hf.check(str(folder), model, params)
            continue
        with pytest.raises(CheckpointError) as error:
            hf.check(str(folder), model, params)
        assert_one_line(error, f"is {refused}, not a floating type", "float original")


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    folder = save_tokenizer(tmp_path / "tokenizer")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 20)
    options = data.DataOptions(text_file=str(corpus), tokenizer=folder)
    spec = data.get_dataset("text_file", options=options)
    assert spec.num_classes == VOCAB_SIZE
    config = ml_collections.ConfigDict(
        {
            "init_from": "hf:/checkpoint",
            "dataset": "text_file",
            "model_args": {"vocab_size": VOCAB_SIZE},
            "data": {"seq_len": 8},
        }
    )
    experiment.check_checkpoint_data(config, spec)  # the checkpoint's vocabulary: every id fits
    config.model_args.vocab_size = VOCAB_SIZE - 2
    with pytest.raises(DataError) as error:
        experiment.check_checkpoint_data(config, spec)
    assert_one_line(error, f"ids up to {VOCAB_SIZE - 1}", f"{VOCAB_SIZE - 2} tokens of")
    assert "'hf:/checkpoint'" in str(error.value) and "/checkpoint/tokenizer.json" in str(
        error.value
    )

    # An id of 2**31 in the file would size the embedding: refused as the tokenizer is read.
    file = os.path.join(folder, "tokenizer.json")
    edited = json.load(open(file))
    edited["model"]["vocab"]["fox"] = 2**31
    json.dump(edited, open(file, "w"))
    with pytest.raises(DataError) as error:
        data.get_dataset("text_file", options=options)
    assert_one_line(error, "'fox' the id 2147483648", f"{VOCAB_SIZE} tokens")


def test_the_workdir_lock_is_a_plain_file_of_its_own(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for link in (os.symlink, os.link):
        workdir = tmp_path / link.__name__
        workdir.mkdir()
        link(victim, workdir / ".lock")
        before = snapshot(tmp_path)
        with pytest.raises(WorkdirError) as error:
            with hold_workdir(str(workdir)):
                pass
        what = "is a symbolic link" if link is os.symlink else "has other links"
        assert_one_line(error, str(workdir / ".lock"), what, "remove it")
        assert snapshot(tmp_path) == before and victim.read_text() == "precious\n"

    workdir = tmp_path / "run"
    (workdir).mkdir()
    (workdir / ".lock").write_text("x" * 300)  # an older holder's line, longer than ours
    with hold_workdir(str(workdir)):
        assert (workdir / ".lock").read_text().split()[0] == str(os.getpid())
        with pytest.raises(WorkdirBusy) as error:  # in use: a later try may find it free
            with hold_workdir(str(workdir)):
                pass
        assert_one_line(error, "in use", f"process {os.getpid()} on", "another workdir")
        assert error.value.exit_code == RETRYABLE_EXIT_CODE


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_a_file_system_without_flock_is_one_line(tmp_path, monkeypatch, code):
    # NFS without lockd and Lustre without its flock option refuse every flock like this.
    def refused(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", refused)
    with pytest.raises(WorkdirError) as error:
        with hold_workdir(str(tmp_path / "run")):
            pass
    assert not isinstance(error.value, WorkdirBusy)  # the same command fails the same way
    assert_one_line(error, "does not lock files", os.strerror(code), "local_lock=flock")


def test_the_data_dirs_preparation_lock_is_opened_as_the_workdirs_is(tmp_path, monkeypatch):
    from jddp.data import datasets

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.symlink(victim, data_dir / ".lock")
    with pytest.raises(DataError) as error:
        with datasets._exclusive(str(data_dir / ".lock")):
            pass
    assert_one_line(error, "a symbolic link", "remove it")
    assert victim.read_text() == "precious\n"  # neither followed nor truncated
    (data_dir / ".held").write_text("an older holder\n")
    with datasets._exclusive(str(data_dir / ".held")):
        assert (data_dir / ".held").read_text() == "an older holder\n"

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refused)
    with pytest.raises(DataError) as error:
        with datasets._exclusive(str(data_dir / ".held")):
            pass
    assert_one_line(error, "no working flock", "local disk")

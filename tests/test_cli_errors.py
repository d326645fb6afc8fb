"""User mistakes on the command line: one line on stderr naming problem and fix, exit code 2,
and nothing created. `{tmp}` in a flag is a folder holding `no_get_config.py` (a config file
without `get_config`) and `corpus.txt` (a small text). Checks of values the CLI merely passes on
to the library are tested in-process (tests/test_bad_input.py). The mistakes' commands run in
one process, one after another (tests/commands_in_one_process.py), with a workdir already holding
a run; a workdir that is a file is refused in a process of its own, as a user's command is."""

import os

import pytest

from tests.commands_in_one_process import run_commands
from tests.helpers import assert_error_exit, run_cli

# (flags, words the one-line message must contain)
MISTAKES = [
    (["--config.global_batch_size=100"], ["global_batch_size=100", "divisible", "8 x 1", "104"]),
    (["--config.grad_accum_steps=3"], ["global_batch_size=128", "8 x 3 = 24", "multiple of 24"]),
    (["--config.model=mpl"], ["unknown model 'mpl'", "mlp", "cnn"]),
    (["--config.dataset=digitz"], ["unknown dataset 'digitz'", "digits"]),
    (["--config.parallel.strategy=fsdq"], ["unknown parallel.strategy 'fsdq'", "ddp"]),
    (["--config.num_train_steps=0"], ["num_train_steps", "positive", "--config.num_train_steps"]),
    (["--config.global_batch_size=0"], ["global_batch_size", "positive"]),
    (["--config.learning_rate=0"], ["learning_rate", "> 0"]),
    (["--config=experiments/configs/nope.py"], ["not found", "nope.py", "digits_mlp"]),
    (["--config.no_such_key=1"], ["no key", "no_such_key"]),
    (["--config.num_train_steps=many"], ["num_train_steps", "many"]),
    (["--config.compute_dtype=float8"], ["compute_dtype", "float8", "bfloat16"]),
    (["--config.model_args.depth=3"], ["model 'mlp' has no argument depth", "hidden_sizes"]),
    (["--config={tmp}/no_get_config.py"], ["no_get_config.py", "defines no get_config()"]),
    (["--config.lerning_rate=0.1"], ["no key 'lerning_rate'", "did you mean 'learning_rate'"]),
    (["--config.parallel.strateg=zero3"], ["no key 'strateg'", "did you mean 'strategy'"]),
    (  # get_config() itself raised: not an override's fault
        ["--config={tmp}/needs_env.py"],
        ["needs_env.py", "failed to load", "KeyError", "JDDP_TEST_UNSET_ROOT"],
    ),
    (  # a model argument the file does not set, accepted from the command line
        [
            "--config=experiments/configs/shakespeare_gpt_tiny.py",
            "--config.dataset=text_file",
            "--config.data.text_file={tmp}/corpus.txt",
            "--config.model_args.vocab_size=2",
        ],
        ["model_args.vocab_size=2 is smaller than the dataset's 8"],
    ),
    (["--config.eval_batch_size=100"], ["eval_batch_size=100", "8 devices", "96 or 104"]),
    (
        ["--config.parallel.strategy=zero3", "--config.parallel.mesh=data:3"],
        ["parallel.mesh 'data:3'", "3 devices but 8 are present"],
    ),
    (
        ["--config.parallel.strategy=zero1", "--config.parallel.rules=(('kernel','model'),)"],
        ["names mesh axis 'model'", "fsdp"],
    ),
    (
        [
            "--config.parallel.strategy=zero3",
            "--config.parallel.rules=(('hidden_1/kernel','None,None,fsdp'),)",
        ],
        ["3 entries", "'hidden_1/kernel'", "(256, 256)"],
    ),
    (["--config.dataset=fashion_mnst"], ["unknown dataset 'fashion_mnst'", "close: fashion_mnist"]),
    (
        ["--config.dataset=imagenet2012", "--config.data.manual_dir=/no/such/dir"],
        ["imagenet2012", "ILSVRC2012_img_train.tar", "/no/such/dir", "image-net.org"],
    ),
    (
        ["--config=experiments/configs/digits_cnn.py", "--config.model_args.channels=(8,8,8,8,8)"],
        ["model 'cnn' cannot take the 'image' of digits", "8x8 images"],
    ),
    (["--config.data.seq_len=0"], ["data.seq_len", ">= 1"]),
    (
        ["--config.parallel.grad_comm_dtype=float16"],
        ["parallel.grad_comm_dtype", "float16", "bfloat16"],
    ),
    (
        ["--config.parallel.grad_compression=powersgd", "--config.parallel.strategy=zero3"],
        ["powersgd", "ddp only", "zero3"],
    ),
    (["--config.hang_timeout_s=-1"], ["hang_timeout_s", ">= 0"]),
    (
        ["--config.parallel.strategy=zero3", "--config.parallel.mesh=fsdp:2,context:4"],
        ["parallel.mesh has a context axis", "model MLP has no context-parallel attention"],
    ),
    (
        [
            "--config=experiments/configs/shakespeare_gpt_tiny.py",
            "--config.dataset=text_file",
            "--config.data.text_file={tmp}/corpus.txt",
            "--config.data.seq_len=12",
            "--config.parallel.strategy=zero3",
            "--config.parallel.mesh=fsdp:2,context:4",
        ],
        ["2 x context = 8 equal chunks", "12 tokens", "multiple of 8, e.g. 8 or 16"],
    ),
    # Once refused only by trainer.init, after the workdir and its checkpoints folder existed.
    (["--config.seed=-1"], ["seed must be an integer from 0", "got -1", "--config.seed"]),
]


@pytest.fixture(scope="module")
def mistakes_run(tmp_path_factory):
    """Each mistake's command run with its own workdir (`run-INDEX`, under the folder `{tmp}`
    names), then a run into `held` (a workdir holding a run's metrics), all in one process:
    their results, by index (`held`'s last), and that folder."""
    tmp = tmp_path_factory.mktemp("mistakes")
    (tmp / "no_get_config.py").write_text("def config():\n    return None\n")
    (tmp / "needs_env.py").write_text(
        "import os\n\ndef get_config():\n    return os.environ['JDDP_TEST_UNSET_ROOT']\n"
    )
    (tmp / "corpus.txt").write_text("to be or not to be\n" * 40)
    commands = [
        ["experiments.train", f"--workdir={tmp / f'run-{i}'}", *(f.format(tmp=tmp) for f in flags)]
        for i, (flags, _) in enumerate(MISTAKES)
    ]
    (tmp / "held").mkdir()
    (tmp / "held" / "metrics.jsonl").write_text('{"step": 1}\n')
    commands.append(["experiments.train", f"--workdir={tmp / 'held'}"])
    return run_commands(commands), tmp


@pytest.mark.parametrize("index", range(len(MISTAKES)), ids=[m[0][0] for m in MISTAKES])
def test_bad_flag_is_one_line_and_exit_2(mistakes_run, index):
    results, tmp = mistakes_run
    assert_error_exit(results[index], *MISTAKES[index][1])
    assert not (tmp / f"run-{index}").exists()  # nothing created for a run that never started


def test_workdir_that_is_a_file_is_refused_and_untouched(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    result = run_cli(f"--workdir={path}")
    assert_error_exit(result, "is a file", "directory")
    assert path.read_text() == "keep me"


def test_workdir_holding_a_run_is_refused_and_untouched(mistakes_run):
    results, tmp = mistakes_run
    assert_error_exit(results[-1], "already holds a run", "new --workdir")
    assert os.listdir(tmp / "held") == ["metrics.jsonl"]
    assert (tmp / "held" / "metrics.jsonl").read_text() == '{"step": 1}\n'

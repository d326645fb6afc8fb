"""The README's library example runs as written and learns."""

import os
import re

from tests.helpers import REPO


def readme_example() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    block = re.search(
        r"<!-- library-example:start -->\s*```python\n(.*?)```\s*<!-- library-example:end -->",
        text,
        re.DOTALL,
    )
    assert block, "README lost its library-example markers"
    return block.group(1)


def test_library_example_runs_and_learns(capsys):
    code = readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 25
    namespace = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)  # our own README
    result = namespace["trainer"].evaluate(namespace["state"], [namespace["data"]])
    assert result["count"] == 1797
    assert result["accuracy"] > 0.9
    assert "accuracy" in capsys.readouterr().out
    assert namespace["trainer"].num_devices == 8


def test_pipeline_example_runs():
    """The README's pipelined model: 8 blocks over 4 stages, 1F1B, with replicas."""
    code = re.search(
        r"<!-- pipeline-example:start -->\s*```python\n(.*?)```\s*<!-- pipeline-example:end -->",
        open(os.path.join(REPO, "README.md")).read(),
        re.DOTALL,
    ).group(1)
    namespace = {"__name__": "readme_pipeline_example"}
    exec(compile(code, "README.md", "exec"), namespace)  # our own README
    state, metrics = namespace["state"], namespace["metrics"]
    assert 0 < float(metrics["loss"]) < 10
    kernel = state.params["blocks"]["Dense_0"]["kernel"]
    assert kernel.shape == (8, 32, 32) and kernel.sharding.spec[0] == "stage"
    assert {s.data.shape[0] for s in kernel.addressable_shards} == {2}

"""Test setup: 8 simulated CPU devices and a private TFDS data dir, before JAX is imported."""

import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TFDS_DATA_DIR", os.path.join(tempfile.gettempdir(), "jddp-test-tfds"))

import jax  # noqa: E402

assert jax.device_count() == 8, "conftest must run before anything imports jax"


@pytest.fixture(scope="session", autouse=True)
def shared_digits_prepared():
    """The shared digits dataset is prepared before any test runs, so no test's output depends on
    whether it happened to be the one that prepared it (one preparer at a time: a file lock)."""
    from jddp import data

    data.open_dataset(data.get_dataset("digits"))

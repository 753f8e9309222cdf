"""Shared test set-up: 8 simulated CPU devices, and `gpu`-marked tests only on a GPU.

Without a GPU, XLA:CPU's LLVM backend also runs unoptimised: the suite is mostly compile
time (sharded train steps, pipeline executors on tiny shapes), which this cuts by a sixth;
the float ops are the same (no fast-math either way) and these tests check values, not
speed.
"""

import os
import shutil

_CPU_FLAGS = "--xla_force_host_platform_device_count=8"
if shutil.which("nvidia-smi") is None:
    _CPU_FLAGS += " --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", _CPU_FLAGS)

import jax  # noqa: E402  (XLA_FLAGS must be set before jax initialises)
import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

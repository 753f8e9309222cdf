"""Shared test set-up: 8 simulated CPU devices, `gpu`-marked tests only on a GPU, and
`mosaic`-marked ones only where the Mosaic GPU kernels run (a Hopper, jax >= 0.11).

Without a GPU, XLA:CPU's LLVM backend also runs unoptimised: the suite is mostly compile
time (sharded train steps, pipeline executors on tiny shapes), which this cuts by a sixth;
these tests check values, not speed. No fast-math either way, but the last bits can
differ from -O2's: a tiny FP8 run's loss moved by up to 2.8% on one step against BF16
(tests/test_precision.py, session 42), so tolerances are set under this codegen. Before
jax 0.11, XLA:CPU's MLIR fusion emitters are off too: its older elemental emitters compile
the same fusions in about two thirds of the time (tests/test_train_layouts.py 52.7 ->
33.0 s, the FP8 pipeline executor test 79 -> 54 s on 2 cores; session 45). jax 0.11's
XLA has no such flag (it aborts on unknown flags).

Many tests compile the same step (the train CLI's runs against their one-device
reference, a resumed run against its first half), so the session shares JAX's persistent
compilation cache: one folder per test session, made here (xdist's workers and the CLI
subprocesses inherit it) and removed when the session's first process exits.
"""

import atexit
import os
import shutil
import tempfile
from importlib.metadata import version

_CPU_FLAGS = "--xla_force_host_platform_device_count=8"
if shutil.which("nvidia-smi") is None:
    _CPU_FLAGS += " --xla_backend_optimization_level=0"
    if tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11):
        _CPU_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", _CPU_FLAGS)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="moejax-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402  (XLA_FLAGS must be set before jax initialises)
import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from pallas_kernels import mosaic_common

    on_gpu, mosaic = jax.default_backend() == "gpu", mosaic_common.available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    skip_mosaic = pytest.mark.skip(reason="needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
    for item in items:
        if not on_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not mosaic and item.get_closest_marker("mosaic"):
            item.add_marker(skip_mosaic)

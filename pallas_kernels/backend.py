"""Which implementation the public GEMM and token-movement ops run, visible and overridable.

- "triton": the Pallas kernels in `triton_gemm`, lowered through Triton (any CUDA GPU).
- "interpret": the same kernels in Pallas interpret mode (CPU tests of kernel logic).
- "reference": the pure-JAX reference in `reference` (FP32 math; CPU default).
A Mosaic GPU (Hopper WGMMA) backend is not written yet; on sm_90 "triton" is used.

Priority: set_backend()/use_backend() > $MOEJAX_GEMM_BACKEND > platform default.
The choice is read when an op is traced: jit a caller after choosing.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax

from pallas_kernels import reference, triton_gemm

BACKENDS = ("triton", "interpret", "reference")
ENV_VAR = "MOEJAX_GEMM_BACKEND"
_override: str | None = None


class Ops(NamedTuple):
    grouped_matmul: Callable[..., jax.Array]
    grouped_matmul_tn: Callable[..., jax.Array]


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; choose one of {BACKENDS}")
    return name


def default_backend() -> str:
    return "triton" if jax.default_backend() == "gpu" else "reference"


def backend() -> str:
    """The backend the next traced op will use."""
    return _validate(_override or os.environ.get(ENV_VAR) or default_backend())


def set_backend(name: str | None) -> None:
    """Force a backend (None restores the environment/platform default)."""
    global _override
    _override = None if name is None else _validate(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    global _override
    previous, _override = _override, _validate(name)
    try:
        yield
    finally:
        _override = previous


def ops(name: str | None = None) -> Ops:
    name = _validate(name) if name else backend()
    if name == "reference":
        return Ops(reference.grouped_matmul, reference.grouped_matmul_tn)
    interpret = name == "interpret"
    return Ops(functools.partial(triton_gemm.grouped_matmul, interpret=interpret),
               functools.partial(triton_gemm.grouped_matmul_tn, interpret=interpret))

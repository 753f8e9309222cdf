"""Which implementation the public GEMM and token-movement ops run, visible and overridable.

- "mosaic": the block-scaled FP8 GEMMs (fprop, dgrad: 128x128 weight scales) run the
  warp-specialized Mosaic GPU WGMMA kernel in `mosaic_gemm` (Hopper, jax >= 0.11); the
  BF16 grouped GEMM, the FP8 wgrad and token movement run the Triton kernels.
  Default on an sm_90 GPU.
- "triton": the Pallas kernels in `triton_gemm`, lowered through Triton (any CUDA GPU).
- "interpret": the same kernels in Pallas interpret mode (CPU tests of kernel logic).
- "reference": the pure-JAX reference in `reference` (FP32 math; CPU default).

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
import jax.numpy as jnp

from pallas_kernels import mosaic_gemm, reference, triton_gemm
from pallas_kernels.quantize import TILE

BACKENDS = ("mosaic", "triton", "interpret", "reference")
ENV_VAR = "MOEJAX_GEMM_BACKEND"
_override: str | None = None


class Ops(NamedTuple):
    grouped_matmul: Callable[..., jax.Array]
    grouped_matmul_tn: Callable[..., jax.Array]


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}; choose one of {BACKENDS}")
    if name == "mosaic" and not mosaic_gemm.available():
        raise ValueError(f"GEMM backend 'mosaic' needs a Hopper (sm_90) GPU and jax >= 0.11; "
                         f"this process has {jax.devices()[0].device_kind} and jax "
                         f"{jax.__version__}: choose one of {BACKENDS[1:]}")
    return name


def default_backend() -> str:
    if jax.default_backend() != "gpu":
        return "reference"
    return "mosaic" if mosaic_gemm.available() else "triton"


def _mosaic_grouped_matmul(a, b, group_sizes, *, a_scale=None, b_scale=None, b_row_tile=TILE,
                           b_kn=False, out_dtype=jnp.bfloat16, **triton_only) -> jax.Array:
    """The WGMMA kernel where it applies (FP8 with 128x128 weight scales), else Triton."""
    if a_scale is not None and b_row_tile == TILE and not b_kn and not triton_only:
        return mosaic_gemm.scaled_grouped_matmul(a, b, group_sizes, a_scale=a_scale,
                                                 b_scale=b_scale, out_dtype=out_dtype)
    return triton_gemm.grouped_matmul(a, b, group_sizes, a_scale=a_scale, b_scale=b_scale,
                                      b_row_tile=b_row_tile, b_kn=b_kn, out_dtype=out_dtype,
                                      **triton_only)


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
    if name == "mosaic":
        return Ops(_mosaic_grouped_matmul, triton_gemm.grouped_matmul_tn)
    interpret = name == "interpret"
    return Ops(functools.partial(triton_gemm.grouped_matmul, interpret=interpret),
               functools.partial(triton_gemm.grouped_matmul_tn, interpret=interpret))

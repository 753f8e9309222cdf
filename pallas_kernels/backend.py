"""Which implementation the public GEMM and token-movement ops run, visible and overridable.

- "mosaic": warp-specialized Mosaic GPU WGMMA kernels (Hopper, jax >= 0.11): the
  block-scaled FP8 GEMMs in `mosaic_gemm` (fprop and dgrad with 128x128 weight scales;
  wgrad with 1x128 token scales on both operands, in a tile-aligned token layout), all
  three BF16 grouped GEMMs in `mosaic_bf16_gemm`; token movement runs the Triton
  kernels but for quantize_along_tokens in the plain token layout and a dense linear's
  quantize_both_ways, which stream through TMA (`mosaic_movement`).
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

from pallas_kernels import mosaic_bf16_gemm, mosaic_common, mosaic_gemm, reference, triton_gemm
from pallas_kernels.quantize import TILE

BACKENDS = ("mosaic", "triton", "interpret", "reference")
ENV_VAR = "MOEJAX_GEMM_BACKEND"
_override: str | None = None


class Ops(NamedTuple):
    grouped_matmul: Callable[..., jax.Array]
    grouped_matmul_tn: Callable[..., jax.Array]


def _validate(name: str, origin: str = "") -> str:
    """``name`` if this process can run it; ``origin`` says where it came from."""
    if name not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {name!r}{origin}; choose one of {BACKENDS}")
    if name == "mosaic" and not mosaic_common.available():
        runnable = BACKENDS[1:] if jax.default_backend() == "gpu" else BACKENDS[2:]
        raise ValueError(f"GEMM backend 'mosaic'{origin} needs a Hopper (sm_90) GPU and jax "
                         f">= 0.11; this process has {jax.devices()[0].device_kind} and jax "
                         f"{jax.__version__}: choose one of {runnable}")
    return name


def default_backend() -> str:
    if jax.default_backend() != "gpu":
        return "reference"
    return "mosaic" if mosaic_common.available() else "triton"


def _mosaic_grouped_matmul(a, b, group_sizes, *, a_scale=None, b_scale=None, b_row_tile=TILE,
                           b_kn=False, out_dtype=jnp.bfloat16, **triton_only) -> jax.Array:
    """The WGMMA kernels where they apply (FP8 with 128x128 weight scales, 16-bit), else
    Triton."""
    if not triton_only and a_scale is not None and b_row_tile == TILE and not b_kn:
        return mosaic_gemm.scaled_grouped_matmul(a, b, group_sizes, a_scale=a_scale,
                                                 b_scale=b_scale, out_dtype=out_dtype)
    if not triton_only and a_scale is None and a.dtype.itemsize == 2 and a.dtype == b.dtype:
        return mosaic_bf16_gemm.grouped_matmul(a, b, group_sizes, b_kn=b_kn,
                                               out_dtype=out_dtype)
    return triton_gemm.grouped_matmul(a, b, group_sizes, a_scale=a_scale, b_scale=b_scale,
                                      b_row_tile=b_row_tile, b_kn=b_kn, out_dtype=out_dtype,
                                      **triton_only)


def _mosaic_grouped_matmul_tn(x, y, group_sizes, *, x_scale=None, y_scale=None,
                              token_major=True, out_dtype=jnp.bfloat16, tile_aligned=False,
                              **triton_only):
    """The WGMMA wgrad kernels where they apply (16-bit token-major; FP8 token-minor in a
    tile-aligned layout), else Triton."""
    if not triton_only and x_scale is not None and not token_major and tile_aligned:
        return mosaic_gemm.scaled_grouped_matmul_tn(x, y, group_sizes, x_scale=x_scale,
                                                    y_scale=y_scale, out_dtype=out_dtype)
    if (x_scale is None and token_major and not triton_only and x.dtype.itemsize == 2
            and x.dtype == y.dtype):
        return mosaic_bf16_gemm.grouped_matmul_tn(x, y, group_sizes, out_dtype=out_dtype)
    return triton_gemm.grouped_matmul_tn(x, y, group_sizes, x_scale=x_scale, y_scale=y_scale,
                                         token_major=token_major, out_dtype=out_dtype,
                                         **triton_only)


def _alignment_blind(grouped_matmul_tn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A wgrad that masks every group's tokens itself, so the `tile_aligned` promise (each
    group starts on a 128-token tile) changes nothing for it."""
    def call(*args, tile_aligned: bool = False, **kwargs) -> jax.Array:
        del tile_aligned
        return grouped_matmul_tn(*args, **kwargs)

    return call


def backend() -> str:
    """The backend the next traced op will use."""
    if _override:
        return _validate(_override)
    if os.environ.get(ENV_VAR):
        return _validate(os.environ[ENV_VAR], f" (from ${ENV_VAR})")
    return default_backend()


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
    """The GEMMs of a backend. ``grouped_matmul_tn`` (wgrad) also takes ``tile_aligned``:
    the caller's promise that every group starts on a 128-token tile and its size is a
    multiple of 128 (`group_schedule.AlignedLayout`), which the FP8 WGMMA kernel needs."""
    name = _validate(name) if name else backend()
    if name == "reference":
        return Ops(reference.grouped_matmul, _alignment_blind(reference.grouped_matmul_tn))
    if name == "mosaic":
        return Ops(_mosaic_grouped_matmul, _mosaic_grouped_matmul_tn)
    interpret = name == "interpret"
    return Ops(functools.partial(triton_gemm.grouped_matmul, interpret=interpret),
               _alignment_blind(functools.partial(triton_gemm.grouped_matmul_tn,
                                                  interpret=interpret)))

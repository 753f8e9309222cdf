"""Public GEMM ops: block-scaled FP8 (dense and grouped) and the BF16 grouped GEMM.

Shapes are checked here with errors that name them; the kernels handle sizes that
are not multiples of their tiles (masking, or zero-padding K).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.backend import ops
from pallas_kernels.quantize import FP8, TILE, cdiv


def _group_sizes(group_sizes: Any, groups: int) -> jax.Array:
    """(groups,) integer sizes as int32: float sizes were truncated without a word."""
    sizes = jnp.asarray(group_sizes)
    _expect("group_sizes", sizes, (groups,))
    if not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes has dtype {sizes.dtype}; expected an integer dtype")
    return sizes.astype(jnp.int32)


def _expect(name: str, arr: jax.Array, shape: tuple[int, ...], dtype=None) -> None:
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}; expected {shape}")
    if dtype is not None and arr.dtype != dtype:
        raise ValueError(f"{name} has dtype {arr.dtype}; expected {jnp.dtype(dtype)}")


def scaled_matmul(a, a_scale, b, b_scale, group_sizes, *, b_row_tile: int,
                  out_dtype=jnp.bfloat16) -> jax.Array:
    """Grouped dequant(a) @ dequant(b[g])^T for FP8 a (M, K) and b (G, N, K).

    b_row_tile=128: b has 128x128 block scales (G, N/128, K/128) (weights);
    b_row_tile=1: b has 1x128 scales (G, N, K/128) (activations, as in wgrad).
    """
    (m, k), (g, n, _) = a.shape, b.shape
    kb = cdiv(k, TILE)
    _expect("a", a, (m, k), FP8)
    _expect("b", b, (g, n, k), FP8)
    _expect("a_scale", a_scale, (m, kb), jnp.float32)
    _expect("b_scale", b_scale, (g, cdiv(n, b_row_tile), kb), jnp.float32)
    return ops().grouped_matmul(a, b, _group_sizes(group_sizes, g), a_scale=a_scale,
                                b_scale=b_scale, b_row_tile=b_row_tile, out_dtype=out_dtype)


def fp8_gemm(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16) -> jax.Array:
    """(M, N) = dequant(a) @ dequant(b)^T; a (M, K) 1x128-scaled, b (N, K) 128x128-scaled."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"fp8_gemm wants 2-D a and b, got {a.shape} and {b.shape}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: K differs: a {a.shape}, b {b.shape}")
    sizes = jnp.array([a.shape[0]], jnp.int32)
    return scaled_matmul(a, a_scale, b[None], b_scale[None], sizes, b_row_tile=TILE,
                         out_dtype=out_dtype)


def fp8_grouped_gemm(a, a_scale, b, b_scale, group_sizes, out_dtype=jnp.bfloat16):
    """Row r of group g: dequant(a[r]) @ dequant(b[g])^T; rows past sum(group_sizes) are 0."""
    if a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"fp8_grouped_gemm wants a (M, K), b (G, N, K); got {a.shape}, {b.shape}")
    return scaled_matmul(a, a_scale, b, b_scale, group_sizes, b_row_tile=TILE,
                         out_dtype=out_dtype)


@jax.custom_vjp
def grouped_gemm(a: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """BF16 drop-in for jax.lax.ragged_dot(a (M, K), b (G, K, N), group_sizes) -> (M, N).

    b may be FP32 master weights: the GEMMs take them cast to a's dtype, and the weight
    gradient comes back in b's dtype straight from the kernel's FP32 accumulator (so
    backward keeps no 16-bit copy of b, and no 16-bit rounding of its gradient)."""
    if a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"grouped_gemm wants a (M, K), b (G, K, N); got {a.shape}, {b.shape}")
    out = ops().grouped_matmul(a, b.astype(a.dtype), _group_sizes(group_sizes, b.shape[0]),
                               b_kn=True, out_dtype=a.dtype)
    return _unclonable(out)


def _unclonable(out: jax.Array) -> jax.Array:
    """``out`` behind an optimization barrier, so that XLA cannot clone the kernel call.

    Why: in a layer loop the output is both read by the layer and kept as a residual,
    written into its layer-stack slot. XLA's GPU dynamic-slice fusion (jax 0.11) then
    emits the custom call twice, once into the slot and once for the reader: every
    forward expert GEMM of the `small` BF16 step ran twice (33 extra ~270 us calls a
    step). Behind the barrier the slot write is a copy, a third of the GEMM's time
    (docs/performance.md, session 26)."""
    return jax.lax.optimization_barrier(out)


def _grouped_gemm_fwd(a, b, group_sizes):
    return grouped_gemm(a, b, group_sizes), (a, b, group_sizes)


def _grouped_gemm_bwd(res, dy):
    a, b, group_sizes = res
    sizes = group_sizes.astype(jnp.int32)
    dy = dy.astype(a.dtype)
    # dgrad: dA[r] = dY[r] @ b[g]^T, i.e. b (G, K, N) read as (G, out=K, contract=N).
    da = ops().grouped_matmul(dy, b.astype(a.dtype), sizes, b_kn=False, out_dtype=a.dtype)
    # wgrad: dB[g] = A_g^T dY_g, contracting over the group's rows.
    db = ops().grouped_matmul_tn(a, dy, sizes, token_major=True, out_dtype=b.dtype)
    return da, db, None


grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)

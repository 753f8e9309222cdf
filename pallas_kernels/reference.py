"""Pure-JAX references for the GEMM kernels (FP32 math on dequantized operands).

Same signatures as `triton_gemm`, so the backend switch is a module swap.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.group_schedule import group_bounds
from pallas_kernels.quantize import dequantize

_HI = jax.lax.Precision.HIGHEST


def _operand(x: jax.Array, scale: jax.Array | None, row_tile: int) -> jax.Array:
    return x.astype(jnp.float32) if scale is None else dequantize(x, scale, row_tile)


def _group_onehot(group_sizes: jax.Array, m: int) -> jax.Array:
    starts, ends = group_bounds(group_sizes, m)
    rows = jnp.arange(m)[:, None]
    return ((rows >= starts) & (rows < ends)).astype(jnp.float32)


def grouped_matmul(a, b, group_sizes, *, a_scale=None, b_scale=None, b_row_tile=128,
                   b_kn=False, out_dtype=jnp.bfloat16):
    """out[r] = a[r] @ b[g(r)]^T (b (G, N, K)) or a[r] @ b[g(r)] (b_kn: b (G, K, N))."""
    af = _operand(a, a_scale, 1)
    bf = _operand(b, b_scale, b_row_tile)
    if not b_kn:
        bf = jnp.swapaxes(bf, 1, 2)
    onehot = _group_onehot(group_sizes, a.shape[0])
    out = jnp.einsum("mg,mk,gkn->mn", onehot, af, bf, precision=_HI)
    return out.astype(out_dtype)


def grouped_matmul_tn(x, y, group_sizes, *, x_scale=None, y_scale=None,
                      token_major=True, out_dtype=jnp.bfloat16):
    """out[g] = x_g^T y_g over each group's tokens; x (M, P), y (M, Q) if token_major,
    else x (P, M), y (Q, M) with 1x128 scales along M."""
    xf = _operand(x, x_scale, 1)
    yf = _operand(y, y_scale, 1)
    if not token_major:
        xf, yf = xf.T, yf.T
    onehot = _group_onehot(group_sizes, xf.shape[0])
    out = jnp.einsum("mg,mp,mq->gpq", onehot, xf, yf, precision=_HI)
    return out.astype(out_dtype)

"""FP8 training linears (DeepSeek-V3 recipe): all three GEMMs in block-scaled E4M3.

Quantization is online. Each GEMM's scale tiles follow its contraction axis:
fprop contracts K (x 1x128 along K, w 128x128), dgrad contracts N (dy 1x128 along
N, w^T 128x128), wgrad contracts tokens (dy^T and x^T 1x128 along tokens).
Residuals are the unquantized x and w; the backward re-quantizes them (the fused
FP8 dequantize-transpose-requantize of saved activations is future work).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import ops
from pallas_kernels.gemm import scaled_matmul
from pallas_kernels.quantize import TILE, quantize_1x128, quantize_128x128

_quantize_weights = jax.vmap(quantize_128x128)


def _full(m: int) -> jax.Array:
    return jnp.array([m], jnp.int32)


def _fprop(x, w, group_sizes):
    xq, xs = quantize_1x128(x)
    wq, ws = _quantize_weights(w)
    return scaled_matmul(xq, xs, wq, ws, group_sizes, b_row_tile=TILE, out_dtype=x.dtype)


def _dgrad(dy, w, group_sizes, dtype):
    dyq, dys = quantize_1x128(dy)
    wq, ws = _quantize_weights(w)
    # w^T's 128x128 blocks are w's blocks transposed: same FP8 values and scales.
    return scaled_matmul(dyq, dys, jnp.swapaxes(wq, 1, 2), jnp.swapaxes(ws, 1, 2),
                         group_sizes, b_row_tile=TILE, out_dtype=dtype)


def _wgrad_tiles(dy, x):
    """dy^T (N, M) and x^T (K, M), quantized 1x128 along the token axis."""
    return quantize_1x128(dy.T), quantize_1x128(x.T)


@jax.custom_vjp
def fp8_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """y (M, N) = x (M, K) @ w (N, K)^T with FP8 operands, in x's dtype."""
    return _fprop(x, w[None], _full(x.shape[0]))


def _linear_fwd(x, w):
    return fp8_linear(x, w), (x, w)


def _linear_bwd(res, dy):
    x, w = res
    dx = _dgrad(dy, w[None], _full(x.shape[0]), x.dtype)
    (dyq, dys), (xq, xs) = _wgrad_tiles(dy, x)
    dw = scaled_matmul(dyq, dys, xq[None], xs[None], _full(dyq.shape[0]), b_row_tile=1,
                       out_dtype=w.dtype)
    return dx, dw


fp8_linear.defvjp(_linear_fwd, _linear_bwd)


@jax.custom_vjp
def fp8_grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Row r of group g: y[r] = x[r] @ w[g]^T, x (M, K), w (G, N, K); FP8 operands."""
    return _fprop(x, w, group_sizes.astype(jnp.int32))


def _grouped_fwd(x, w, group_sizes):
    return fp8_grouped_linear(x, w, group_sizes), (x, w, group_sizes)


def _grouped_bwd(res, dy):
    x, w, group_sizes = res
    sizes = group_sizes.astype(jnp.int32)
    dx = _dgrad(dy, w, sizes, x.dtype)
    (dyq, dys), (xq, xs) = _wgrad_tiles(dy, x)
    dw = ops().grouped_matmul_tn(dyq, xq, sizes, x_scale=dys, y_scale=xs,
                                 token_major=False, out_dtype=w.dtype)
    return dx, dw, None


fp8_grouped_linear.defvjp(_grouped_fwd, _grouped_bwd)

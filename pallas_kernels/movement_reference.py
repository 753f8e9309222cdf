"""Pure-JAX references for the token-movement kernels (XLA compiles them as it likes).

Same signatures as `triton_movement`, so the backend switch is a module swap. All take the
permutation made by `movement.sort_by_expert`: sorted row j holds the flat token copy
permutation[j] = token * k + slot.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.group_schedule import AlignedLayout, gather_aligned
from pallas_kernels.quantize import dequantize, quantize_1x128, quantize_128x128

_HI = jax.lax.Precision.HIGHEST


def inverse_permutation(permutation: jax.Array) -> jax.Array:
    """inverse[permutation[j]] = j: the sorted row that holds each flat copy."""
    rows = jnp.arange(permutation.shape[0], dtype=permutation.dtype)
    return jnp.zeros_like(permutation).at[permutation].set(rows, unique_indices=True)


def permute(x: jax.Array, permutation: jax.Array, k: int, *,
            quantize: bool) -> tuple[jax.Array, jax.Array | None]:
    """Sorted copies x[permutation // k], FP8 with 1x128 scales if quantize, else x's dtype."""
    rows = x[permutation // k]
    return quantize_1x128(rows) if quantize else (rows, None)


def combine(y: jax.Array, permutation: jax.Array, weights: jax.Array) -> jax.Array:
    """out[t] = sum_s weights[t, s] * y[row of copy (t, s)], summed in FP32, in y's dtype."""
    tokens, k = weights.shape
    copies = y[inverse_permutation(permutation)].reshape(tokens, k, -1).astype(jnp.float32)
    out = jnp.einsum("tkh,tk->th", copies, weights.astype(jnp.float32), precision=_HI)
    return out.astype(y.dtype)


def combine_backward(g: jax.Array, y: jax.Array, permutation: jax.Array,
                     weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cotangents of combine: dy[j] = w(copy j) * g[token j] (a weighted dispatch of g) and
    dweights[t, s] = <g[t], y[row of (t, s)]> (one dot per copy), both from FP32 math."""
    tokens, k = weights.shape
    token_of_row = permutation // k
    w_of_row = weights.reshape(-1)[permutation].astype(jnp.float32)
    g_rows = g[token_of_row].astype(jnp.float32)
    dy = (w_of_row[:, None] * g_rows).astype(y.dtype)
    dots = jnp.einsum("jh,jh->j", g_rows, y.astype(jnp.float32), precision=_HI)
    dweights = jnp.zeros((tokens * k,), jnp.float32).at[permutation].set(dots, unique_indices=True)
    return dy, dweights.reshape(tokens, k).astype(weights.dtype)


def quantize_along_tokens(x: jax.Array, layout: AlignedLayout | None = None,
                          scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x (M, K) row-major -> quantize_1x128(x.T): (K, M) FP8 and (K, ceil(M/128)) scales,
    the layout the token-contracting wgrad GEMM wants. With a `layout`, the rows are
    first placed in that tile-aligned layout (K, R), so no scale tile spans two groups.
    With a `scale`, x is FP8 with its 1x128 scales along K, (M, ceil(K/128)), and is
    dequantized first (to FP32: the second rounding of an FP8 linear's saved input)."""
    if scale is not None:
        x = dequantize(x, scale, row_tile=1)
    return quantize_1x128((x if layout is None else gather_aligned(x, layout)).T)


def quantize_both_ways(x: jax.Array, layout: AlignedLayout
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """An FP8 linear's output gradient x (M, K) for both of its GEMMs: quantize_1x128(x)
    (dgrad contracts K) and quantize_along_tokens(x, layout) (wgrad contracts the tokens):
    (M, K) FP8, (M, ceil(K/128)) scales, (K, R) FP8, (K, R/128) scales. Rows the layout
    leaves out (past the groups' sum) may come back unwritten in the first pair: no GEMM
    uses them."""
    return quantize_1x128(x) + quantize_along_tokens(x, layout)


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w (G, K, N) -> its 128x128 quantization in both layouts: (G, K, N) FP8 (dgrad's
    operand), (G, N, K) FP8 (fprop's: the same blocks transposed) and the (G, ceil(K/128),
    ceil(N/128)) FP32 block scales, which both layouts share."""
    q, scale = jax.vmap(quantize_128x128)(w)
    return q, jnp.swapaxes(q, 1, 2), scale


# The one-pass kernel's reference is quantize_1x128 itself.
quantize_rows = quantize_1x128


def swiglu_fp32(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU, silu(gate) * up, in FP32 math whatever the inputs' dtype."""
    return jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def swiglu_quantize(gate: jax.Array, up: jax.Array, with_inputs: bool = False
                    ) -> tuple[jax.Array, ...]:
    """quantize_1x128 of SwiGLU(gate, up) (M, I) rounded to gate's dtype: (M, I) FP8 and
    (M, ceil(I/128)) FP32 scales, the FP8 down projection's fprop operand. ``with_inputs``:
    followed by quantize_1x128(gate) and quantize_1x128(up) (what its backward keeps)."""
    hidden = quantize_1x128(swiglu_fp32(gate, up).astype(gate.dtype))
    if not with_inputs:
        return hidden
    return hidden + quantize_1x128(gate) + quantize_1x128(up)

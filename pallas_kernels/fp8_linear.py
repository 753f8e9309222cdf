"""FP8 training linears (DeepSeek-V3 recipe): all three GEMMs in block-scaled E4M3.

Quantization is online. Each GEMM's scale tiles follow its contraction axis:
fprop contracts K (x 1x128 along K, w 128x128), dgrad contracts N (dy 1x128 along
N, w^T 128x128), wgrad contracts tokens (dy^T and x^T 1x128 along tokens, read
row-major with no transpose pass). dy's two quantizations come from one read of it
(``movement.quantize_both_ways``); ``quantize_along_tokens`` quantizes the recomputed
SwiGLU output. The wgrad operands are laid out tile-aligned
(``group_schedule.AlignedLayout``: each group's tokens start on a 128-token tile), so no
scale tile mixes two experts' tokens and the WGMMA kernel needs no masking.

Weights come as stored, (K, N) or (G, K, N), and their gradients leave in that layout, so
the optimizer updates them in place (a (G, N, K) gradient made XLA's AdamW fusion transpose
every expert stack, write it to a temporary and copy it back into the donated buffer). The
128x128 blocks are quantized once, by one pass that writes both FP8 layouts
(``movement.quantize_weights``); dgrad reads them as they are, fprop reads the FP8 transpose
(w^T's blocks are w's blocks transposed: same scales, same values), and wgrad computes x^T dy.

FP8 activation storage: the residuals are the FP8 copies made for fprop (x with its
1x128 scales, w with its 128x128 scales), not the BF16/FP32 inputs. wgrad needs x quantized
along tokens, which is derived from the saved copy by dequantize-transpose-requantize,
as DeepSeek-V3 does. That is a second rounding: x is first rounded to E4M3 on its
K-tile scale, then re-rounded on its token-tile scale, so wgrad sees up to two E4M3
half-ulps (2 x 2^-4 relative) per element instead of one; where a token tile's scale equals
the K tile's (or differs by a power of two) the second rounding is exact. The SwiGLU
down projection below avoids it: its wgrad operand is recomputed and rounded once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import ops
from pallas_kernels.gemm import scaled_matmul
from pallas_kernels.group_schedule import AlignedLayout, aligned_layout
from pallas_kernels.movement import (quantize_along_tokens, quantize_both_ways, quantize_rows,
                                     quantize_weights, swiglu_quantize)
from pallas_kernels.movement_reference import swiglu_fp32
from pallas_kernels.quantize import TILE, as_residual, dequantize, from_residual

# An FP8 operand: values and their FP32 tile scales (saved as ``quantize.as_residual`` keeps
# them: the values as uint8 bits).
Quantized = tuple[jax.Array, jax.Array]


def _full(m: int) -> jax.Array:
    return jnp.array([m], jnp.int32)


def _dtype_marker(x: jax.Array) -> jax.Array:
    """A zero-size residual that carries a dtype into the backward (no bytes saved)."""
    return jnp.zeros((0,), x.dtype)


def _fprop(x: Quantized, w_t: Quantized, group_sizes, dtype) -> jax.Array:
    """y = x w: the kernel contracts K-major operands, so it reads w^T (G, N, K) with its
    (G, N/128, K/128) block scales."""
    return scaled_matmul(*x, *w_t, group_sizes, b_row_tile=TILE, out_dtype=dtype)


def _quantized_weights(w: jax.Array) -> tuple[Quantized, Quantized]:
    """w (G, K, N) for dgrad and w^T (G, N, K) for fprop, FP8 with their block scales."""
    wq, wq_t, scale = quantize_weights(w)
    return (wq, scale), (wq_t, jnp.swapaxes(scale, 1, 2))


def _output_gradient(dy, layout: AlignedLayout | None) -> tuple[Quantized, Quantized]:
    """dy (M, N) for both GEMMs, from one read: 1x128 along N for dgrad, and dy^T (N, R)
    1x128 along the tokens in `layout` for wgrad (None: one group of all M rows, M a
    multiple of 128, where R = M)."""
    dyq, dys, dyq_t, dys_t = quantize_both_ways(dy, layout)
    return (dyq, dys), (dyq_t, dys_t)


def _dgrad(dy: Quantized, w: Quantized, group_sizes, dtype) -> jax.Array:
    """dx = dy w^T: w (G, K, N) is already N-major, as the kernel reads it."""
    return scaled_matmul(*dy, *w, group_sizes, b_row_tile=TILE, out_dtype=dtype)


def _along_tokens(x: Quantized, layout: AlignedLayout) -> Quantized:
    """x^T (K, R) quantized 1x128 along tokens in the tile-aligned layout, from the saved
    K-tiled FP8 copy of x (M, K): dequantized, gathered and re-quantized in one pass (XLA
    compiled the same expression as three kernels: an amax reduce, a transpose-quantize
    and a second transpose; docs/performance.md, session 18)."""
    xq, xs = x
    return quantize_along_tokens(xq, layout, xs)


def _wgrad(dy_t: Quantized, x_t: Quantized, layout: AlignedLayout, dtype) -> jax.Array:
    """dw (G, K, N) = x^T dy per group, in the weights' own layout; x_t is x^T (K, R) and
    dy_t is dy^T (N, R), both quantized along tokens in `layout`. One group is the dense
    case."""
    (xq, xs), (dyq, dys) = x_t, dy_t
    return ops().grouped_matmul_tn(xq, dyq, layout.sizes, x_scale=xs, y_scale=dys,
                                   token_major=False, out_dtype=dtype, tile_aligned=True)


def _backward(res, dy, dense: bool = False):
    """dx and dw; ``dense``: one group holds every row (``fp8_linear``), so where M is a
    multiple of 128 dy's token layout is already the aligned one."""
    x, w, sizes, x_dtype, w_dtype = res
    x, w = from_residual(x), from_residual(w)
    layout = aligned_layout(sizes, dy.shape[0])
    plain = dense and dy.shape[0] % TILE == 0
    dy_rows, dy_t = _output_gradient(dy, None if plain else layout)
    dx = _dgrad(dy_rows, w, sizes, x_dtype.dtype)
    return dx, _wgrad(dy_t, _along_tokens(x, layout), layout, w_dtype.dtype)


def _forward(x, w, sizes, x_kept: Quantized | None = None):
    """y and the FP8 residuals (in ``quantize.as_residual`` form); w is (G, K, N).
    ``x_kept``: x's 1x128 quantization in that form if the caller already has it (then x
    itself is not read, and the caller's copy is the residual: GEMMs sharing it keep one)."""
    x_kept = as_residual(quantize_rows(x)) if x_kept is None else x_kept
    wq, wq_t = _quantized_weights(w)
    return _fprop(from_residual(x_kept), wq_t, sizes, x.dtype), (
        x_kept, as_residual(wq), sizes, _dtype_marker(x), _dtype_marker(w))


@jax.custom_vjp
def fp8_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """y (M, N) = x (M, K) @ w (K, N) with FP8 operands, in x's dtype; dw in w's dtype."""
    return _forward(x, w[None], _full(x.shape[0]))[0]


def _linear_fwd(x, w):
    return _forward(x, w[None], _full(x.shape[0]))


def _linear_bwd(res, dy):
    dx, dw = _backward(res, dy, dense=True)
    return dx, dw[0]


fp8_linear.defvjp(_linear_fwd, _linear_bwd)


@jax.custom_vjp
def fp8_grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                       x_fp8: Quantized | None = None) -> jax.Array:
    """Row r of group g: y[r] = x[r] @ w[g], x (M, K), w (G, K, N); FP8 operands.

    ``x_fp8`` = ``quantize.as_residual(quantize_1x128(x))`` where the caller has it
    already (tokens that travelled in FP8; one copy for the gate and up GEMMs): the GEMM
    takes it as is instead of re-rounding x and keeps it for backward, and x is then only
    the straight-through handle of the gradient (x_fp8 gets none)."""
    return _forward(x, w, group_sizes.astype(jnp.int32), x_fp8)[0]


def _grouped_fwd(x, w, group_sizes, x_fp8):
    return _forward(x, w, group_sizes.astype(jnp.int32), x_fp8)


def _grouped_bwd(res, dy):
    return (*_backward(res, dy), None, None)


fp8_grouped_linear.defvjp(_grouped_fwd, _grouped_bwd)


@jax.custom_vjp
def fp8_swiglu_grouped_linear(gate: jax.Array, up: jax.Array, w: jax.Array,
                              group_sizes: jax.Array, row_weights: jax.Array | None = None
                              ) -> jax.Array:
    """y[r] = (SwiGLU(gate, up)[r] * row_weights[r]) @ w[g], w (G, I, N): a SwiGLU MLP's
    down projection, with SwiGLU in FP32 rounded to gate's dtype; ``row_weights`` (M,)
    FP32 (the router's weight of each expert row; None: 1) scale each row's input.

    Forward makes the FP8 operand in one pass (``movement.swiglu_quantize``); a row's
    weight multiplies its 1x128 scales, which is the quantization of the weighted row
    (its tiles' FP8 values are the same). Backward keeps gate and up as FP8 copies (1x128
    scales, written by that same pass) and recomputes SwiGLU from them, instead of keeping
    gate, up (BF16) and SwiGLU's FP8 copy: 2 bytes per intermediate element, not 5.
    """
    return _swiglu_forward(gate, up, w, group_sizes, row_weights, keep=False)[0]


def _swiglu(gate, up, dtype) -> jax.Array:
    return swiglu_fp32(gate, up).astype(dtype)


def _swiglu_forward(gate, up, w, group_sizes, row_weights, keep: bool):
    """y, and with ``keep`` the residuals: gate and up quantized 1x128 by the same pass
    that makes the down projection's operand."""
    sizes = group_sizes.astype(jnp.int32)
    wq, wq_t = _quantized_weights(w)
    hq, hs, *inputs = swiglu_quantize(gate, up, with_inputs=keep)
    if row_weights is not None:
        hs = hs * row_weights.astype(jnp.float32)[:, None]
    y = _fprop((hq, hs), wq_t, sizes, gate.dtype)
    if not keep:
        return y, None
    gate_q, up_q = as_residual(inputs[:2]), as_residual(inputs[2:])
    return y, (gate_q, up_q, as_residual(wq), sizes, row_weights, _dtype_marker(gate),
               _dtype_marker(w))


def _swiglu_fwd(gate, up, w, group_sizes, row_weights):
    return _swiglu_forward(gate, up, w, group_sizes, row_weights, keep=True)


def _swiglu_bwd(res, dy):
    gate_q, up_q, wq, sizes, row_weights, x_dtype, w_dtype = res
    gate_q, up_q, wq = map(from_residual, (gate_q, up_q, wq))
    dtype = x_dtype.dtype
    gate, up = (dequantize(*q, row_tile=1) for q in (gate_q, up_q))  # FP32
    hidden, swiglu_vjp = jax.vjp(lambda g, u: _swiglu(g, u, dtype), gate, up)
    layout = aligned_layout(sizes, dy.shape[0])
    dy_rows, dy_t = _output_gradient(dy, layout)
    d_hidden = _dgrad(dy_rows, wq, sizes, dtype)
    d_row_weights = None
    if row_weights is not None:
        weights = row_weights.astype(jnp.float32)[:, None]
        d_row_weights = jnp.sum(d_hidden.astype(jnp.float32) * hidden.astype(jnp.float32),
                                axis=1).astype(row_weights.dtype)
        hidden = (hidden.astype(jnp.float32) * weights).astype(dtype)
        d_hidden = (d_hidden.astype(jnp.float32) * weights).astype(dtype)
    # The recomputed SwiGLU is quantized along tokens straight from its BF16 value:
    # one rounding for wgrad here, unlike a plain FP8 linear's saved input.
    dw = _wgrad(dy_t, quantize_along_tokens(hidden, layout), layout, w_dtype.dtype)
    d_gate, d_up = swiglu_vjp(d_hidden)
    return d_gate.astype(dtype), d_up.astype(dtype), dw, None, d_row_weights


fp8_swiglu_grouped_linear.defvjp(_swiglu_fwd, _swiglu_bwd)

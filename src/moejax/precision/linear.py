"""The linears of attention and of the SwiGLU MLPs, in the run's precision.

Kernels arrive as stored (FP32 master weights, ``(in, out)``; experts ``(E, in, out)``).
BF16 casts them to the compute dtype and accumulates in FP32. FP8 hands the FP32 weights to
``pallas_kernels``' FP8 linears, which quantize them online and return FP32 weight
gradients; the SwiGLU and its down projection become one op that keeps the SwiGLU inputs in
FP8 and recomputes its output in backward.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from pallas_kernels import grouped_gemm
from pallas_kernels.fp8_linear import fp8_grouped_linear, fp8_linear, fp8_swiglu_grouped_linear
from pallas_kernels.movement_reference import swiglu_fp32

from moejax.memory.remat import SWIGLU_OUTPUT, tag
from moejax.precision.policy import Precision


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array, row_weights: jax.Array | None = None) -> jax.Array:
    """SiLU-gated linear unit, computed in FP32 and returned in the inputs' dtype; backward
    keeps only the inputs. ``row_weights`` (rows,) scale each row (the router's weight
    of an expert row: the MoE layer weights its experts' outputs here, inside the expert,
    so that summing them keeps nothing for backward)."""
    out = swiglu_fp32(gate, up)
    if row_weights is not None:
        out = out * _column(row_weights)
    return tag(out.astype(gate.dtype), SWIGLU_OUTPUT)  # selective recomputes


def _column(row_weights: jax.Array) -> jax.Array:
    return row_weights.astype(jnp.float32)[:, None]


def _swiglu_fwd(gate, up, row_weights):
    return swiglu(gate, up, row_weights), (gate, up, row_weights)


def _swiglu_bwd(residuals, g):
    """From the 16-bit inputs alone; JAX's own rule would keep the FP32 sigmoid, SiLU and
    upcasts of every expert row (five FP32 copies per MoE layer on the GPU)."""
    gate, up, row_weights = residuals
    gate32, up32, g32 = (t.astype(jnp.float32) for t in (gate, up, g))
    sig = jax.nn.sigmoid(gate32)
    d_row_weights = None
    if row_weights is not None:
        d_row_weights = jnp.sum(g32 * gate32 * sig * up32, axis=1).astype(row_weights.dtype)
        g32 = g32 * _column(row_weights)
    dgate = g32 * up32 * sig * (1 + gate32 * (1 - sig))
    return dgate.astype(gate.dtype), (g32 * gate32 * sig).astype(up.dtype), d_row_weights


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _one_group(x: jax.Array) -> jax.Array:
    return jnp.array([x.shape[0]], jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_matmul(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """``x @ kernel`` for x (..., in) and kernel (in, out) cast to x's dtype, accumulated in
    FP32 and returned in ``out_dtype``; its backward GEMMs take x's dtype too.

    Why not ``jnp.dot(..., preferred_element_type=float32)`` alone: JAX transposes it into
    backward GEMMs on the FP32 cotangent, which turns both into FP32 GEMMs (TF32 on Hopper:
    half the BF16 rate, twice the bytes; on the small preset they were most of XLA's GEMM
    time). Here the cotangent is rounded to x's dtype once (for the head's FP32 logits,
    once more than JAX would); the weight gradient still accumulates in FP32 and comes back
    in the kernel's dtype.
    """
    return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32
                   ).astype(out_dtype)


def _dense_matmul_fwd(x, kernel, out_dtype):
    return dense_matmul(x, kernel, out_dtype), (x, kernel)


def _dense_matmul_bwd(out_dtype, residuals, g):
    x, kernel = residuals
    g = g.astype(x.dtype)
    dx = jnp.dot(g, kernel.astype(x.dtype).T, preferred_element_type=jnp.float32)
    dkernel = jnp.dot(_rows(x).T, _rows(g), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


dense_matmul.defvjp(_dense_matmul_fwd, _dense_matmul_bwd)


def linear(x: jax.Array, kernel: jax.Array, precision: Precision, dtype: jnp.dtype) -> jax.Array:
    """``x @ kernel`` for x (..., in) and kernel (in, out), returned in ``dtype``."""
    x = x.astype(dtype)
    if precision is Precision.FP8:
        return fp8_linear(_rows(x), kernel).reshape(*x.shape[:-1], kernel.shape[1])
    return dense_matmul(x, kernel, dtype)


def swiglu_linear(gate: jax.Array, up: jax.Array, kernel: jax.Array, precision: Precision,
                  dtype: jnp.dtype) -> jax.Array:
    """``swiglu(gate, up) @ kernel`` (a SwiGLU MLP's down projection)."""
    if precision is Precision.FP8:
        g, u = _rows(gate.astype(dtype)), _rows(up.astype(dtype))
        y = fp8_swiglu_grouped_linear(g, u, kernel[None], _one_group(g))
        return y.reshape(*gate.shape[:-1], kernel.shape[1])
    return linear(swiglu(gate, up), kernel, precision, dtype)


def grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   precision: Precision, x_fp8: Any = None) -> jax.Array:
    """Row r of group g: ``x[r] @ w[g]``; x (M, in), w (G, in, out), in x's dtype.
    ``x_fp8``: x's ``quantize_1x128`` in ``pallas_kernels.quantize.as_residual`` form when
    it exists already (FP8 uses it; BF16 ignores it)."""
    if precision is Precision.FP8:
        return fp8_grouped_linear(x, w, group_sizes, x_fp8)
    return grouped_gemm(x, w, group_sizes)


def grouped_swiglu_linear(gate: jax.Array, up: jax.Array, w: jax.Array, group_sizes: jax.Array,
                          precision: Precision, row_weights: jax.Array | None = None
                          ) -> jax.Array:
    """Row r of group g: ``swiglu(gate, up, row_weights)[r] @ w[g]`` (the routed experts'
    down projection, each row weighted by its router weight where given)."""
    if precision is Precision.FP8:
        return fp8_swiglu_grouped_linear(gate, up, w, group_sizes, row_weights)
    return grouped_linear(swiglu(gate, up, row_weights), w, group_sizes, precision)

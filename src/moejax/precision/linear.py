"""The linears of attention and of the SwiGLU MLPs, in the run's precision.

Kernels arrive as stored (FP32 master weights, ``(in, out)``; experts ``(E, in, out)``).
BF16 casts them to the compute dtype and accumulates in FP32. FP8 hands the FP32 weights to
``pallas_kernels``' FP8 linears, which quantize them online and return FP32 weight
gradients; the SwiGLU and its down projection become one op that keeps the SwiGLU inputs in
FP8 and recomputes its output in backward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from pallas_kernels import grouped_gemm
from pallas_kernels.fp8_linear import fp8_gated_grouped_linear, fp8_grouped_linear, fp8_linear

from moejax.memory.remat import SWIGLU_OUTPUT, tag
from moejax.precision.policy import Precision


def _swiglu_fp32(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU-gated linear unit, computed in FP32 and returned in the inputs' dtype."""
    return tag(_swiglu_fp32(gate, up).astype(gate.dtype), SWIGLU_OUTPUT)


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _one_group(x: jax.Array) -> jax.Array:
    return jnp.array([x.shape[0]], jnp.int32)


def linear(x: jax.Array, kernel: jax.Array, precision: Precision, dtype: jnp.dtype) -> jax.Array:
    """``x @ kernel`` for x (..., in) and kernel (in, out), returned in ``dtype``."""
    x = x.astype(dtype)
    if precision is Precision.FP8:
        return fp8_linear(_rows(x), kernel.T).reshape(*x.shape[:-1], kernel.shape[1])
    y = jnp.dot(x, kernel.astype(dtype), preferred_element_type=jnp.float32)
    return y.astype(dtype)


def swiglu_linear(gate: jax.Array, up: jax.Array, kernel: jax.Array, precision: Precision,
                  dtype: jnp.dtype) -> jax.Array:
    """``swiglu(gate, up) @ kernel`` (a SwiGLU MLP's down projection)."""
    if precision is Precision.FP8:
        g, u = _rows(gate.astype(dtype)), _rows(up.astype(dtype))
        y = fp8_gated_grouped_linear(g, u, kernel.T[None], _one_group(g), _swiglu_fp32)
        return y.reshape(*gate.shape[:-1], kernel.shape[1])
    return linear(swiglu(gate, up), kernel, precision, dtype)


def grouped_linear(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   precision: Precision, x_fp8: Any = None) -> jax.Array:
    """Row r of group g: ``x[r] @ w[g]``; x (M, in), w (G, in, out), in x's dtype.
    ``x_fp8``: x's ``quantize_1x128`` when it exists already (FP8 uses it; BF16 ignores it)."""
    if precision is Precision.FP8:
        return fp8_grouped_linear(x, jnp.swapaxes(w, 1, 2), group_sizes, x_fp8)
    return grouped_gemm(x, w.astype(x.dtype), group_sizes)


def grouped_swiglu_linear(gate: jax.Array, up: jax.Array, w: jax.Array, group_sizes: jax.Array,
                          precision: Precision) -> jax.Array:
    """Row r of group g: ``swiglu(gate, up)[r] @ w[g]`` (the routed experts' down projection)."""
    if precision is Precision.FP8:
        return fp8_gated_grouped_linear(gate, up, jnp.swapaxes(w, 1, 2), group_sizes,
                                        _swiglu_fp32)
    return grouped_linear(swiglu(gate, up), w, group_sizes, precision)

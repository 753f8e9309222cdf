"""Basic layers: a linear map with FP32 accumulation and an FP32 RMSNorm.

Parameters are stored in ``param_dtype`` (FP32 master weights) and cast to the compute
``dtype`` at use, so the optimizer always sees FP32 while the matmuls run in BF16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.memory.remat import NORM_OUTPUT, tag
from moejax.precision import Precision, linear, swiglu_linear


class Linear(nnx.Module):
    """``y = x @ kernel`` without bias; kernel is (in, out), products accumulate in FP32.

    ``precision`` picks the GEMM inputs' format (``moejax.precision``); BF16 unless the
    layer is one that DeepSeek-V3 runs in FP8.
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, std: float,
                 precision: Precision = Precision.BF16) -> None:
        init = jax.nn.initializers.normal(std)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.dtype = dtype
        self.precision = precision

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.kernel[...], self.precision, self.dtype)

    def after_swiglu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """``self(swiglu(gate, up))``; in FP8 the SwiGLU output is recomputed in backward."""
        return swiglu_linear(gate, up, self.kernel[...], self.precision, self.dtype)


def _inverse_rms(x32: jax.Array, eps: float) -> jax.Array:
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in FP32; the result keeps the input's dtype."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * _inverse_rms(x32, eps)).astype(x.dtype)  # rounded as HF's model does
    out = (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)
    return tag(out, NORM_OUTPUT)  # inside the op: selective remat recomputes it


def _rms_norm_fwd(x, weight, eps):
    return rms_norm(x, weight, eps), (x, weight)


def _rms_norm_bwd(eps, residuals, g):
    """From x and the weight alone (the rounding of the normalised value passes gradients
    straight through); JAX's own rule would keep FP32 copies of x and its products."""
    x, weight = residuals
    x32 = x.astype(jnp.float32)
    inv = _inverse_rms(x32, eps)
    normed, g32 = x32 * inv, g.astype(jnp.float32)
    dnormed = g32 * weight.astype(jnp.float32)
    dx = inv * (dnormed - normed * jnp.mean(dnormed * normed, axis=-1, keepdims=True))
    dweight = jnp.sum((g32 * normed).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dweight.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, param_dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: the dense layers' FFN and the shared experts of a MoE layer."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, std: float,
                 precision: Precision = Precision.BF16) -> None:
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std, precision=precision)
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj.after_swiglu(self.gate_proj(x), self.up_proj(x))

"""Basic layers: a linear map with FP32 accumulation and an FP32 RMSNorm.

Parameters are stored in ``param_dtype`` (FP32 master weights) and cast to the compute
``dtype`` at use, so the optimizer always sees FP32 while the matmuls run in BF16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.memory.remat import NORM_OUTPUT, SWIGLU_OUTPUT, tag


class Linear(nnx.Module):
    """``y = x @ kernel`` without bias; kernel is (in, out), products accumulate in FP32."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, std: float) -> None:
        init = jax.nn.initializers.normal(std)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                    preferred_element_type=jnp.float32)
        return y.astype(self.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in FP32; the result keeps the input's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    out = weight.astype(jnp.float32) * normed.astype(x.dtype).astype(jnp.float32)
    return tag(out.astype(x.dtype), NORM_OUTPUT)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, *, eps: float, param_dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU-gated linear unit, computed in FP32 and returned in the inputs' dtype."""
    out = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return tag(out.astype(gate.dtype), SWIGLU_OUTPUT)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: the dense layers' FFN and the shared experts of a MoE layer."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, std: float) -> None:
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

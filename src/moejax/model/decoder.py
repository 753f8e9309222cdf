"""One transformer block: pre-norm MLA attention, then a dense MLP or a MoE FFN."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.model.attention import MLAttention
from moejax.model.layers import DenseMLP, RMSNorm
from moejax.model.moe import MoE
from moejax.model.routing import RoutingStats
from moejax.parallel.sharding import constrain_batch
from moejax.precision import Precision


class BlockOutput(NamedTuple):
    h: jax.Array
    stats: RoutingStats  # zeros for a dense block


class DecoderBlock(nnx.Module):
    def __init__(self, config: ModelConfig, *, moe: bool, rngs: nnx.Rngs, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, precision: Precision = Precision.BF16,
                 attention: str = "xla") -> None:
        c = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, precision=precision)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = MLAttention(c, attention=attention, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps,
                                                param_dtype=param_dtype)
        if moe:
            self.mlp = MoE(c, **kw)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, std=c.initializer_range,
                                **kw)
        self.config = config

    def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array,
                 bias: jax.Array | None = None) -> BlockOutput:
        h = constrain_batch(h)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        normed = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            out = self.mlp(normed, bias)
            return BlockOutput(h + out.y, out.stats)
        return BlockOutput(h + self.mlp(normed), RoutingStats.zeros(self.config.n_routed_experts))

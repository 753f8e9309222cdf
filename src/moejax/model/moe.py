"""DeepSeekMoE: shared experts plus fine-grained routed SwiGLU experts.

The router runs in FP32. Routed experts' weights are stacked (E, ...) so the expert FFN
is three grouped matmuls over expert-sorted tokens (``jax.lax.ragged_dot``), dropless.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.model.dispatch import combine, dispatch
from moejax.model.layers import DenseMLP, swiglu
from moejax.model.routing import route, sequence_balance_loss


class MoEOutput(NamedTuple):
    y: jax.Array  # (B, S, H)
    counts: jax.Array  # (E,) int32 token copies per expert
    balance_loss: jax.Array  # unweighted sequence-wise balance loss


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """Expert FFN over expert-sorted rows: down_g(silu(x gate_g) * (x up_g)) for each group g."""

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes,
                                 preferred_element_type=jnp.float32)
        return out.astype(lhs.dtype)

    return grouped(swiglu(grouped(x, gate), grouped(x, up)), down)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype,
                 param_dtype: jnp.dtype) -> None:
        c = config
        init = jax.nn.initializers.normal(c.initializer_range)
        experts, hidden, inner = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        # Router weight stays FP32 whatever param_dtype is: gating is precision-sensitive.
        self.router = nnx.Param(init(rngs.params(), (hidden, experts), jnp.float32))
        self.gate_proj = nnx.Param(init(rngs.params(), (experts, hidden, inner), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (experts, hidden, inner), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (experts, inner, hidden), param_dtype))
        self.shared_experts = (DenseMLP(hidden, inner * c.n_shared_experts, rngs=rngs, dtype=dtype,
                                        param_dtype=param_dtype, std=c.initializer_range)
                               if c.n_shared_experts else None)
        self.config = config
        self.dtype = dtype

    def __call__(self, x: jax.Array, bias: jax.Array) -> MoEOutput:
        c = self.config
        batch, seq, hidden = x.shape
        flat = x.reshape(batch * seq, hidden)
        logits = jnp.dot(flat.astype(jnp.float32), self.router[...],
                         precision=jax.lax.Precision.HIGHEST)
        routing = route(logits, bias, c)
        sent = dispatch(flat, routing.experts, c.n_routed_experts)
        y_sorted = grouped_swiglu(sent.tokens, sent.group_sizes, self.gate_proj[...],
                                  self.up_proj[...], self.down_proj[...])
        y = combine(y_sorted, sent.order, routing.weights).reshape(batch, seq, hidden)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        balance = (sequence_balance_loss(routing.scores, routing.experts, batch, c)
                   if c.aux_loss_alpha else jnp.zeros((), jnp.float32))
        return MoEOutput(y, sent.group_sizes, balance)

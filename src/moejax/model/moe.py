"""DeepSeekMoE: shared experts plus fine-grained routed SwiGLU experts.

The router runs in FP32. Routed experts' weights are stacked (E, ...) so the expert FFN
is three grouped matmuls over expert-sorted tokens, dropless on one device. Traced under a
mesh whose ``expert`` axis has more than one device, the routed part runs expert-parallel
(``moejax.parallel.expert``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.model.dispatch import combine, dispatch
from moejax.model.expert_ffn import ExpertWeights, grouped_swiglu
from moejax.model.layers import DenseMLP
from moejax.model.routing import RoutingStats, balance_loss, route, router_logits
from moejax.parallel import expert as expert_parallel  # module: the two import each other
from moejax.precision import Precision


class MoEOutput(NamedTuple):
    y: jax.Array  # (B, S, H)
    stats: RoutingStats


def routed_experts_local(x: jax.Array, router: jax.Array, bias: jax.Array,
                         weights: ExpertWeights, config: ModelConfig,
                         run_experts: expert_parallel.RunExperts = grouped_swiglu,
                         precision: Precision = Precision.BF16) -> MoEOutput:
    """Single-device routed experts: route, sort by expert, grouped FFN, un-sort, combine
    (which keeps the expert outputs for backward in FP8 when ``precision`` is FP8)."""
    batch, seq, hidden = x.shape
    logits = router_logits(x, router).reshape(batch * seq, -1)
    routing = route(logits, bias, config)
    fp8 = precision is Precision.FP8
    sent = dispatch(x, routing.experts, config.n_routed_experts, quantize=fp8)
    y_sorted = run_experts(sent.tokens, sent.group_sizes, weights, sent.tokens_fp8)
    y = combine(y_sorted, sent.order, routing.weights, fp8).reshape(batch, seq, hidden)
    balance = balance_loss(routing, batch, config)
    no_copies = jnp.zeros((), jnp.int32)
    return MoEOutput(y, RoutingStats(sent.group_sizes, balance, no_copies, no_copies))


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, precision: Precision = Precision.BF16) -> None:
        c = config
        init = jax.nn.initializers.normal(c.initializer_range)
        experts, hidden, inner = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        # Router weight stays FP32 whatever param_dtype is: gating is precision-sensitive.
        self.router = nnx.Param(init(rngs.params(), (hidden, experts), jnp.float32))
        self.gate_proj = nnx.Param(init(rngs.params(), (experts, hidden, inner), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (experts, hidden, inner), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (experts, inner, hidden), param_dtype))
        self.shared_experts = (DenseMLP(hidden, inner * c.n_shared_experts, rngs=rngs, dtype=dtype,
                                        param_dtype=param_dtype, std=c.initializer_range,
                                        precision=precision)
                               if c.n_shared_experts else None)
        self.config = config
        self.precision = precision

    def __call__(self, x: jax.Array, bias: jax.Array) -> MoEOutput:
        weights = ExpertWeights(self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        routed = (expert_parallel.expert_parallel_moe if expert_parallel.expert_axis_size() > 1
                  else routed_experts_local)
        run_experts = functools.partial(grouped_swiglu, precision=self.precision)
        y, stats = routed(x, self.router[...], bias, weights, self.config, run_experts,
                          self.precision)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return MoEOutput(y, stats)

"""DeepSeekMoE: shared experts plus fine-grained routed SwiGLU experts.

The router runs in FP32. Routed experts' weights are stacked (E, ...) so the expert FFN
is three grouped matmuls over expert-sorted tokens, dropless on one device. Traced under a
mesh whose ``expert`` axis has more than one device, the routed part runs expert-parallel
(``moejax.parallel.expert``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.config import ModelConfig
from moejax.model.dispatch import dispatch, sorted_weights, sum_copies
from moejax.model.expert_ffn import ExpertWeights, grouped_swiglu
from moejax.model.layers import DenseMLP
from moejax.model.routing import RoutingStats, balance_loss, route, router_logits
from moejax.parallel import expert as expert_parallel  # module: the two import each other
from moejax.parallel.sharding import (check_batch_divides, manual_batch_axes, per_device,
                                      traced_batch_axes)
from moejax.precision import Precision


class MoEOutput(NamedTuple):
    y: jax.Array  # (B, S, H)
    stats: RoutingStats


_EXPERT_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "one_device_expert_rows", default=None)


@contextlib.contextmanager
def experts_on_rows(rows: int | None) -> Iterator[None]:
    """Traced inside, a one-device MoE layer runs its routed experts on ``rows`` rows: its
    routed copies, then zero rows that no expert's group covers, as an expert-parallel
    device's receive buffer holds them (``expert.make_transport``). The outputs are the
    same; the memory budget compiles its one-device probes so, to measure what that buffer
    costs every MoE layer's backward (``memory.budget``)."""
    token = _EXPERT_ROWS.set(rows)
    try:
        yield
    finally:
        _EXPERT_ROWS.reset(token)


def _pad_rows(tree: Any, rows: int) -> Any:
    """Each array of ``tree`` (leading axis: rows) zero-padded to ``rows`` rows."""
    return jax.tree.map(lambda a: jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)),
                        tree)


def routed_experts_local(x: jax.Array, router: jax.Array, bias: jax.Array,
                         weights: ExpertWeights, config: ModelConfig,
                         run_experts: expert_parallel.RunExperts = grouped_swiglu,
                         precision: Precision = Precision.BF16) -> MoEOutput:
    """Single-device routed experts: route, sort by expert, grouped FFN weighting each row
    by its router weight, un-sort and sum each token's copies (``experts_on_rows``: the FFN
    on a padded buffer)."""
    batch, seq, hidden = x.shape
    logits = router_logits(x, router).reshape(batch * seq, -1)
    routing = route(logits, bias, config)
    sent = dispatch(x, routing.experts, config.n_routed_experts,
                    quantize=precision is Precision.FP8)
    routed = sent.tokens.shape[0]
    inputs = (sent.tokens, sent.tokens_fp8, sorted_weights(routing.weights, sent.order))
    if (rows := _EXPERT_ROWS.get()) is not None and rows > routed:
        inputs = _pad_rows(inputs, rows)
    tokens, tokens_fp8, row_weights = inputs
    y_sorted = run_experts(tokens, sent.group_sizes, weights, tokens_fp8, row_weights)
    y = sum_copies(y_sorted[:routed], sent.order, config.num_experts_per_tok
                   ).reshape(batch, seq, hidden)
    balance = balance_loss(routing, batch, config)
    no_copies = jnp.zeros((), jnp.int32)
    return MoEOutput(y, RoutingStats(sent.group_sizes, balance, no_copies, no_copies))


def routed_experts_data_parallel(x: jax.Array, router: jax.Array, bias: jax.Array,
                                 weights: ExpertWeights, config: ModelConfig,
                                 run_experts: expert_parallel.RunExperts,
                                 precision: Precision, batch_axes: tuple[str, ...]) -> MoEOutput:
    """Data parallelism without an expert axis: each device routes its own tokens through
    a whole copy of the experts (gathered where ZeRO-3 splits them), and the routing totals
    are summed over ``batch_axes``. Why a ``shard_map``: XLA cannot split the expert sort
    or the grouped GEMM kernels over a sharded batch, so left to itself it gathered the
    batch and ran every device's experts on all of it (4 x H200, ``data=4``: 4x the GEMM
    work; session 37). Inside a ``shard_map`` already manual over ``batch_axes`` (the
    pipeline executor's) the body runs as is."""
    if not manual_batch_axes():
        check_batch_divides(x.shape[0], batch_axes)

    def body(x, router, bias, weights):
        weights = expert_parallel.varying_over(weights, batch_axes)
        out = routed_experts_local(x, router, bias, weights, config, run_experts, precision)
        s = out.stats
        return out.y, RoutingStats(jax.lax.psum(s.counts, batch_axes),
                                   jax.lax.pmean(s.balance_loss, batch_axes),
                                   s.dropped, s.cross_node)

    tokens = P(batch_axes)
    return MoEOutput(*per_device(
        body, batch_axes, in_specs=(tokens, P(), P(), ExpertWeights(P(), P(), P())),
        out_specs=(tokens, RoutingStats(P(), P(), P(), P())))(x, router, bias, weights))


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
        run_experts = functools.partial(grouped_swiglu, precision=self.precision)
        if expert_parallel.expert_axis_size() > 1:
            y, stats = expert_parallel.expert_parallel_moe(x, self.router[...], bias, weights,
                                                           self.config, run_experts)
        elif batch_axes := traced_batch_axes() or manual_batch_axes():
            y, stats = routed_experts_data_parallel(x, self.router[...], bias, weights,
                                                    self.config, run_experts, self.precision,
                                                    batch_axes)
        else:
            y, stats = routed_experts_local(x, self.router[...], bias, weights, self.config,
                                            run_experts, self.precision)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return MoEOutput(y, stats)

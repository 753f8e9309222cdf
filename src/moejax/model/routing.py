"""DeepSeek-V3 expert routing as pure functions.

Sigmoid affinities pick experts after adding a per-expert bias; the bias only changes
*which* experts win, never the combine weights (aux-loss-free balancing). Group-limited
routing first keeps the ``topk_group`` best of ``n_group`` groups (ranked by the sum of
each group's two best biased scores), which with one group per node caps how many nodes
a token's copies reach.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from pallas_kernels.varying import mark_varying, varying_union

from moejax.config import ModelConfig


class RoutingStats(NamedTuple):
    """What one MoE layer reports about its routing (global under a mesh)."""

    counts: jax.Array  # (E,) int32 token copies routed to each expert
    balance_loss: jax.Array  # unweighted sequence-wise balance loss
    dropped: jax.Array  # int32 copies dropped by an expert capacity limit (0 when dropless)
    cross_node: jax.Array  # int32 copies sent to an expert on another node

    @classmethod
    def zeros(cls, num_experts: int) -> "RoutingStats":
        scalar = jnp.zeros((), jnp.int32)
        return cls(jnp.zeros((num_experts,), jnp.int32), jnp.zeros((), jnp.float32), scalar,
                   scalar)


_HIGHEST = jax.lax.Precision.HIGHEST


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """(..., E) FP32 logits of x (..., H), any float dtype, against the FP32 router (H, E).

    The gating GEMM runs in FP32 (DeepSeek-V3 keeps it out of low precision). Its VJP keeps
    x as given (dtype and shape: a reshape of a recomputed norm output would be a value of
    its own to keep) and upcasts it again in backward; JAX's rule would keep the FP32 copy
    (twice the bytes of BF16 x, per MoE layer). Under shard_map the router is first typed
    as varying like x, so autodiff sums its per-device gradients."""
    return _router_logits(x, mark_varying(router, varying_union(x)))


@jax.custom_vjp
def _router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    return jnp.dot(x.astype(jnp.float32), router, precision=_HIGHEST)


def _router_logits_fwd(x, router):
    return _router_logits(x, router), (x, router)


def _router_logits_bwd(residuals, g):
    x, router = residuals
    dx = jnp.dot(g, router.T, precision=_HIGHEST).astype(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return dx, jnp.dot(rows.T, g.reshape(-1, g.shape[-1]), precision=_HIGHEST)


_router_logits.defvjp(_router_logits_fwd, _router_logits_bwd)


class Routing(NamedTuple):
    weights: jax.Array  # (T, k) FP32 combine weights
    experts: jax.Array  # (T, k) int32 chosen experts
    scores: jax.Array  # (T, E) FP32 sigmoid affinities (unbiased)


def route(logits: jax.Array, bias: jax.Array, config: ModelConfig) -> Routing:
    """Top-k routing of FP32 router ``logits`` (T, E) with selection ``bias`` (E,)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    tokens, experts = choice.shape
    if config.n_group > 1:
        grouped = choice.reshape(tokens, config.n_group, experts // config.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_scores, config.topk_group)
        keep_group = jax.nn.one_hot(best_groups, config.n_group, dtype=jnp.bool_).any(axis=1)
        keep = jnp.repeat(keep_group, experts // config.n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, chosen = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, chosen, axis=1)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(weights * config.routed_scaling_factor, chosen.astype(jnp.int32), scores)


def sequence_balance_loss(scores: jax.Array, experts: jax.Array, batch: int,
                          config: ModelConfig) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss, sum_i f_i P_i averaged over sequences.

    f_i = E / (k S) * (tokens of the sequence sent to expert i) and P_i is the mean over
    the sequence of the normalised affinity s_i / sum_j s_j. Returned unweighted.
    """
    num_experts, k = scores.shape[-1], config.num_experts_per_tok
    scores = scores.reshape(batch, -1, num_experts)
    seq = scores.shape[1]
    chosen = jax.nn.one_hot(experts.reshape(batch, seq * k), num_experts, dtype=jnp.float32)
    f = chosen.sum(1) * num_experts / (k * seq)
    p = (scores / scores.sum(-1, keepdims=True)).mean(1)
    return jnp.mean(jnp.sum(f * p, axis=-1))


def balance_loss(routing: Routing, batch: int, config: ModelConfig) -> jax.Array:
    """The layer's unweighted balance loss, or a zero (not computed) when
    ``aux_loss_alpha`` is 0."""
    if not config.aux_loss_alpha:
        return jnp.zeros((), jnp.float32)
    return sequence_balance_loss(routing.scores, routing.experts, batch, config)


def update_router_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free update: raise the bias of under-loaded experts, lower over-loaded ones.

    ``bias`` and ``counts`` are (..., E); each row is balanced against its own mean load.
    """
    counts = counts.astype(jnp.float32)
    error = jnp.mean(counts, axis=-1, keepdims=True) - counts
    return bias + rate * jnp.sign(error).astype(bias.dtype)

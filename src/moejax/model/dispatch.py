"""Single-device dropless token dispatch: sort token copies by expert, and undo it.

Every (token, slot) copy is kept: the sorted buffer has exactly T*k rows, so no capacity
limit exists and no token is dropped. The expert-parallel path and the fused movement
kernels replace these two functions with the same contract.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Dispatched(NamedTuple):
    tokens: jax.Array  # (T*k, H) token copies sorted by expert
    group_sizes: jax.Array  # (E,) int32 rows per expert
    order: jax.Array  # (T*k,) sorted row j holds flat copy order[j] (= token*k + slot)


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int) -> Dispatched:
    """Sorts the k copies of each row of x (T, H) by their expert in ``experts`` (T, k)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Dispatched(x[order // k], group_sizes, order)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Un-sorts expert outputs and returns sum_k weight * y per token, summed in FP32."""
    tokens, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse].reshape(tokens, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, weights.astype(jnp.float32)).astype(y_sorted.dtype)

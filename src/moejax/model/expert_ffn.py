"""The routed experts' SwiGLU FFN over expert-sorted rows (grouped matmuls)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.model.layers import swiglu


class ExpertWeights(NamedTuple):
    gate: jax.Array  # (E, H, I)
    up: jax.Array  # (E, H, I)
    down: jax.Array  # (E, I, H)


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights) -> jax.Array:
    """down_g(silu(x gate_g) * (x up_g)) for the rows of each group g; rows past the groups' sum
    are padding and come back as zeros."""

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes,
                                 preferred_element_type=jnp.float32)
        return out.astype(lhs.dtype)

    return grouped(swiglu(grouped(x, weights.gate), grouped(x, weights.up)), weights.down)

"""The routed experts' SwiGLU FFN over expert-sorted rows (grouped matmuls).

The grouped matmuls are ``pallas_kernels.grouped_gemm`` (FP32 accumulation; Pallas kernels
for forward, dgrad and wgrad on GPU, where XLA's ragged_dot backward materialises a dense
(experts x rows x hidden) buffer; a pure-JAX reference on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from pallas_kernels import grouped_gemm

from moejax.model.layers import swiglu


class ExpertWeights(NamedTuple):
    gate: jax.Array  # (E, H, I)
    up: jax.Array  # (E, H, I)
    down: jax.Array  # (E, I, H)


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights) -> jax.Array:
    """down_g(silu(x gate_g) * (x up_g)) for the rows of each group g; rows past the groups' sum
    are padding and come back as zeros."""

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return grouped_gemm(lhs, rhs.astype(lhs.dtype), group_sizes)

    return grouped(swiglu(grouped(x, weights.gate), grouped(x, weights.up)), weights.down)

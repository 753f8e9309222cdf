"""Single-device dropless token dispatch: sort token copies by expert, and undo it.

Every (token, slot) copy is kept: the sorted buffer has exactly T*k rows, so no capacity
limit exists and no token is dropped. Both passes are `pallas_kernels`' fused movement ops
(one read and one write of the data each, custom VJPs; Triton kernels on GPU, the pure-JAX
reference on CPU); this module keeps the model's names for them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import pallas_kernels

# combine(y_sorted, order, weights) -> (T, H): un-sort, weight, sum over k in FP32.
combine = pallas_kernels.combine


class Dispatched(NamedTuple):
    tokens: jax.Array  # (T*k, H) token copies sorted by expert
    group_sizes: jax.Array  # (E,) int32 rows per expert
    order: jax.Array  # (T*k,) sorted row j holds flat copy order[j] (= token*k + slot)


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int) -> Dispatched:
    """Sorts the k copies of each row of x (T, H) by their expert in ``experts`` (T, k)."""
    sent = pallas_kernels.dispatch(x, experts, num_experts, quantize=False)
    return Dispatched(sent.tokens, sent.group_sizes, sent.permutation)

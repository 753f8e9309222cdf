"""Single-device dropless token dispatch: sort token copies by expert, and undo it.

Every (token, slot) copy is kept: the sorted buffer has exactly T*k rows, so no capacity
limit exists and no token is dropped. Both passes are `pallas_kernels`' fused movement ops
(one read and one write of the data each, custom VJPs; Triton kernels on GPU, the pure-JAX
reference on CPU); this module keeps the model's names for them.

The sorted copies (and their FP8 quantization, where asked) are one recomputable op: they
are x's rows gathered k times, so ``selective`` keeps x (itself a recomputed norm output)
and the order, and re-gathers the copies in backward instead of keeping k copies of every
token for the expert GEMMs' weight gradients.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import pallas_kernels
from pallas_kernels.quantize import as_residual

from moejax.memory.remat import DISPATCHED_TOKENS, recomputable

# sum_copies(y_sorted, order, k) -> (T, H): un-sort and sum each token's k rows in FP32 (the
# rows arrive weighted by the router: ``sorted_weights`` goes into the experts).
sum_copies = pallas_kernels.sum_copies


class Dispatched(NamedTuple):
    tokens: jax.Array  # (T*k, H) token copies sorted by expert
    group_sizes: jax.Array  # (E,) int32 rows per expert
    order: jax.Array  # (T*k,) sorted row j holds flat copy order[j] (= token*k + slot)
    tokens_fp8: Any = None  # quantize_1x128(tokens) in as_residual form where asked, else None


def _copies(x: jax.Array, order: jax.Array, k: int, quantize: bool) -> tuple[jax.Array, Any]:
    rows = x.reshape(-1, x.shape[-1])
    # The FP8 copy (one fused pass over x, not a second pass over the copies) is what the
    # FP8 expert GEMMs read and keep, in the form they keep it (so that the op's output,
    # not a bitcast of it, is what backward holds); gradients reach x through the 16-bit
    # copies.
    return (pallas_kernels.permute_rows(rows, order, k),
            as_residual(pallas_kernels.permute_quantized(jax.lax.stop_gradient(rows), order, k))
            if quantize else None)


def sorted_weights(weights: jax.Array, order: jax.Array) -> jax.Array:
    """The router weights (T, k) of the sorted copies, (T*k,): row j's is copy order[j]'s.
    The experts weight their rows with them, so un-sorting only sums (``sum_copies``)."""
    return pallas_kernels.permute_values(weights.reshape(-1), order)


def dispatch(x: jax.Array, experts: jax.Array, num_experts: int,
             quantize: bool = False) -> Dispatched:
    """Sorts the k copies of each token of x (..., H) (T tokens, flattened in order) by
    their expert in ``experts`` (T, k); ``quantize`` also returns the copies' 1x128 FP8
    quantization (for FP8 expert GEMMs). x is taken unflattened so that the op's kept input
    is x itself, not a reshape of it."""
    if x.ndim < 2 or experts.ndim != 2 or experts.shape[0] != x.size // x.shape[-1]:
        raise ValueError(f"dispatch wants x (..., H) with T tokens and experts (T, k); got "
                         f"{x.shape}, {experts.shape}")
    k = experts.shape[1]
    order, group_sizes = pallas_kernels.sort_by_expert(experts, num_experts)
    copies = recomputable(functools.partial(_copies, k=k, quantize=quantize), DISPATCHED_TOKENS)
    tokens, tokens_fp8 = copies(x, order)
    return Dispatched(tokens, group_sizes, order, tokens_fp8)

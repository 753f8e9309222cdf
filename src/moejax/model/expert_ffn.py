"""The routed experts' SwiGLU FFN over expert-sorted rows (grouped matmuls).

In BF16 the grouped matmuls are ``pallas_kernels.grouped_gemm`` (FP32 accumulation; Pallas
kernels for forward, dgrad and wgrad on GPU, where XLA's ragged_dot backward materialises a
dense (experts x rows x hidden) buffer; a pure-JAX reference on CPU); in FP8 they are the
kernels' FP8 grouped linears (``moejax.precision``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from pallas_kernels import quantize_rows
from pallas_kernels.quantize import as_residual

from moejax.precision import Precision, grouped_linear, grouped_swiglu_linear


class ExpertWeights(NamedTuple):
    gate: jax.Array  # (E, H, I)
    up: jax.Array  # (E, H, I)
    down: jax.Array  # (E, I, H)


def grouped_swiglu(x: jax.Array, group_sizes: jax.Array, weights: ExpertWeights,
                   x_fp8: Any = None, row_weights: jax.Array | None = None,
                   precision: Precision = Precision.BF16) -> jax.Array:
    """down_g(silu(x gate_g) * (x up_g) * row_weights) for the rows of each group g; rows
    past the groups' sum are padding and come back as zeros. ``x_fp8``: x's 1x128 FP8
    quantization, in ``pallas_kernels.quantize.as_residual`` form, where the rows arrived
    in FP8 (the FP8 gate/up GEMMs take it instead of re-quantizing x). ``row_weights``
    (rows,): each row's router weight (None: 1), applied before the down projection
    (the same product, by linearity, as weighting the expert's output)."""
    if precision is Precision.FP8 and x_fp8 is None:
        # Once for both GEMMs, in the form a residual is kept in: backward keeps one FP8
        # copy, not two. Gradients reach x through the GEMMs (straight through), never
        # through the rounding.
        x_fp8 = as_residual(quantize_rows(jax.lax.stop_gradient(x)))
    gate = grouped_linear(x, weights.gate, group_sizes, precision, x_fp8)
    up = grouped_linear(x, weights.up, group_sizes, precision, x_fp8)
    return grouped_swiglu_linear(gate, up, weights.down, group_sizes, precision, row_weights)

"""Gradient accumulation: one optimizer update from several micro-batches run in turn.

``train.microbatches=k`` on a mesh without a pipe axis runs a step's forward/backward as k
micro-batches of B/k sequences, one after another in a ``lax.scan``, and sums their
gradients in FP32 before the single optimizer update. Two things follow:

- activations are those of one micro-batch, so a global batch that does not fit in one
  pass still trains;
- the update's fixed cost, paid once per k micro-batches: on the `small` preset AdamW and
  the gradient norm over the routed experts' stacks alone take about 16 ms of a 128 ms
  step on an H100 (docs/performance.md, FP8 training, session 46).

It costs a params-sized FP32 accumulator, and the per-micro-batch work that only depends
on the parameters (the weights cast to the compute dtype) is done k times.

Every micro-batch has the same number of sequences and tokens, and each loss is a mean
over them, so the mean of the micro-batches' losses and gradients is the whole batch's.
Expert counts are summed, so the router bias moves exactly as it would for the whole
batch. Only the summation order differs from the one-pass step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from moejax.parallel.pipeline.executor import split_microbatches


def _mean_or_total(x: jax.Array, parts: int) -> jax.Array:
    """Floating values (losses, gradients) are means over the micro-batches; integer ones
    (expert counts, dropped and cross-node copies) are totals."""
    return x / parts if jnp.issubdtype(x.dtype, jnp.floating) else x


def accumulated(loss_and_grads: Callable[..., Any], num_microbatches: int
                ) -> Callable[..., Any]:
    """``loss_and_grads`` (a ``step.LossAndGrads``) over ``num_microbatches`` micro-batches
    of the batch, scanned in turn; the same function back when there is one. Micro-batch i
    takes rows i, i+k, ... (``split_microbatches``), so on a data-sharded batch each device
    feeds every micro-batch from its own rows and the split moves no tokens."""
    if num_microbatches == 1:
        return loss_and_grads

    def run(params: Any, biases: Any, tokens: jax.Array) -> tuple[tuple[jax.Array, tuple], Any]:
        chunks = split_microbatches(tokens, num_microbatches)

        def add_one(total: Any, chunk: jax.Array) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, total, loss_and_grads(params, biases, chunk)), None

        shapes = jax.eval_shape(loss_and_grads, params, biases, chunks[0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        summed, _ = jax.lax.scan(add_one, zeros, chunks)
        return jax.tree.map(lambda x: _mean_or_total(x, num_microbatches), summed)

    return run

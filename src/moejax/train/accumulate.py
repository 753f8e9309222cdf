"""Gradient accumulation: one optimizer update from several micro-batches run in turn.

``train.microbatches=k`` on a mesh without a pipe axis runs a step's forward/backward as k
micro-batches of B/k sequences, one after another in a ``lax.scan``, and sums their
gradients in FP32 before the single optimizer update. Two things follow:

- activations are those of one micro-batch, so a global batch that does not fit in one
  pass still trains;
- the update's fixed cost is paid once per k micro-batches: on the `small` preset AdamW and
  the gradient norm over the routed experts' stacks alone take about 16 ms of a 128 ms
  step on an H100 (docs/performance.md, FP8 training, session 46).

It costs a params-sized FP32 accumulator, and each micro-batch repeats what depends only
on the parameters: the weights' casts to the compute dtype and, under ZeRO-3, their
gathers over ``data``. The parameters pass an optimization barrier with each micro-batch,
so XLA cannot hoist those out of the loop: hoisted, every layer's gathered weights would
stay live for the whole step, which is what ZeRO-3 exists to avoid (on XLA:CPU the budget
then read 11% under the step's peak).

With dropless routing every micro-batch has the same number of sequences and tokens, and
each loss is a mean over them, so the mean of the micro-batches' losses and gradients is
the whole batch's, and the summed expert counts move the router bias exactly as the whole
batch's would: only the summation order differs from the one-pass step. An expert capacity
limit (``expert_parallel.capacity_factor``) applies per micro-batch, so with one the
dropped tokens can differ.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from moejax.parallel.sharding import split_microbatches


def _mean_or_total(stacked: jax.Array) -> jax.Array:
    """One value per micro-batch (leading axis) -> the step's: floating values (losses)
    are means, integer ones (expert counts, dropped and cross-node copies) totals."""
    if jnp.issubdtype(stacked.dtype, jnp.floating):
        return stacked.mean(0)
    return stacked.sum(0)


def accumulated(loss_and_grads: Callable[..., Any], num_microbatches: int
                ) -> Callable[..., Any]:
    """``loss_and_grads`` (a ``step.LossAndGrads``) over ``num_microbatches`` micro-batches
    of the batch, scanned in turn; the same function back when there is one. Micro-batch i
    takes rows i, i+k, ... (``split_microbatches``), so on a data-sharded batch each device
    feeds every micro-batch from its own rows and the split moves no tokens."""
    if num_microbatches == 1:
        return loss_and_grads

    def run(params: Any, biases: Any, tokens: jax.Array) -> tuple[tuple[jax.Array, tuple], Any]:
        def add_one(total: Any, chunk: jax.Array) -> tuple[Any, Any]:
            held, chunk = jax.lax.optimization_barrier((params, chunk))
            losses, grads = loss_and_grads(held, biases, chunk)
            return jax.tree.map(jnp.add, total, grads), losses

        # gradients have the parameters' structure and dtypes (FP32 master weights)
        zeros = jax.tree.map(jnp.zeros_like, params)
        summed, losses = jax.lax.scan(add_one, zeros,
                                      split_microbatches(tokens, num_microbatches))
        grads = jax.tree.map(lambda g: g / num_microbatches, summed)
        return jax.tree.map(_mean_or_total, losses), grads

    return run

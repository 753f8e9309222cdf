"""An executor F&B tick with both chunks' MoE blocks cut into pieces and interleaved.

The pipeline executor keeps only each in-flight micro-batch's stage input, so the B chunk
of a tick first recomputes its stage's forward. Here that recompute and the two chunks
run as (all in one traced tick, per device inside the executor's ``shard_map``):

1. B: ``jax.vjp`` of its stage front (embedding, dense blocks) at the stage input;
   its MoE blocks' forward keeping each piece's pullback (``fb_pair`` ``keep="pullbacks"``:
   residuals, so no piece runs its forward a second time); ``jax.vjp`` of its stage back
   (head, MTP, losses) seeded with the gradient that arrived and the loss weight.
2. F's front, then ``fb_pair.run_pair``: F's MoE blocks forward interleaved piece by piece
   with B's MoE blocks backward, each one's all_to_all next to the other's compute
   (``fb_pair``'s module docstring says how XLA is led to overlap them), then F's back.
3. B's front pullback, and the parameter gradients of all three parts summed.

The result equals ``jax.vjp`` of the whole stage function (the executor's other ticks),
which the executor tests check on every schedule with an expert axis.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from pallas_kernels.varying import mark_varying, varying_axes

from moejax.model import DeepseekV3
from moejax.parallel.pipeline.fb_pair import Stack, run_pair
from moejax.parallel.pipeline.stages import (StageRows, StageShape, StageStats, add_stats,
                                             moe_stats, stage_back, stage_front,
                                             stage_moe_blocks)


class Chunk(NamedTuple):
    """One chunk of a tick: which stage, where its rows are, its input and micro-batch."""

    shape: StageShape
    rows: StageRows
    h: jax.Array  # (b, S, H) stage input
    tokens: jax.Array  # (b, S+1)


def pairs_pieces(f: StageShape | None, b: StageShape | None) -> bool:
    """Whether a tick of these stage shapes has two MoE stacks to interleave."""
    return f is not None and b is not None and f.moe > 0 and b.moe > 0


def _moe_stack(chunk: Chunk, model: DeepseekV3) -> Stack:
    """The chunk's MoE blocks and router-bias rows as ``fb_pair`` takes them."""
    blocks, biases = stage_moe_blocks(chunk.shape, chunk.rows, model)
    return Stack(nnx.split(blocks)[1], biases)


def fb_tick(model_of: Callable[[nnx.State], DeepseekV3], params: nnx.State, f: Chunk,
            b: Chunk, d_out: jax.Array, loss_weight: float, mtp_lambda: float
            ) -> tuple[jax.Array, StageStats, jax.Array, nnx.State]:
    """F's stage output and stats, and B's input gradient and parameter gradients.

    ``model_of(params)`` is the model with this rank's held parameters; ``d_out`` is the
    gradient w.r.t. B's stage output and ``loss_weight`` that of each micro-batch loss
    (1/M for a mean), as the executor's stage-level ``jax.vjp`` is seeded."""
    model = model_of(params)
    config = model.config
    graphdef = nnx.split(model.moe_blocks)[0]  # one MoE block's, whatever the stack's depth

    # B: recompute up to the MoE blocks, keeping their pullbacks, then seed through the back.
    h_b, front_b = jax.vjp(lambda p, h: stage_front(b.shape, b.rows, model_of(p), h,
                                                    b.tokens), params, b.h)
    stack_b, rows_b = jax.vjp(lambda p: _moe_stack(b, model_of(p)), params)
    redo, _ = run_pair(graphdef, config, forward=(stack_b, h_b), keep="pullbacks")

    def back(p: nnx.State, h: jax.Array) -> tuple[tuple[jax.Array, jax.Array], StageStats]:
        out, stats = stage_back(b.shape, model_of(p), h, b.tokens, mtp_lambda)
        return (out, stats.loss), stats

    (_, loss), back_b, _ = jax.vjp(back, params, redo.h, has_aux=True)
    seed = mark_varying(jnp.float32(loss_weight), tuple(varying_axes(loss)))
    d_params_back, d_h_moe = back_b((d_out, seed))
    d_balance = jnp.full((b.shape.moe,), config.aux_loss_alpha * loss_weight, jnp.float32)

    # F's MoE forward paired with B's MoE backward.
    h_f = stage_front(f.shape, f.rows, model, f.h, f.tokens)
    stack_f = _moe_stack(f, model)
    moe_f, moe_b = run_pair(graphdef, config, forward=(stack_f, h_f),
                            backward=(stack_b, redo.saved, d_h_moe, d_balance))
    out_f, back_stats = stage_back(f.shape, model, moe_f.h, f.tokens, mtp_lambda)
    stats_f = add_stats(moe_stats(model, f.rows, moe_f.counts, moe_f.balance, moe_f.dropped,
                                  moe_f.cross_node), back_stats)

    (d_params_stack,) = rows_b(Stack(moe_b.d_params, jnp.zeros_like(stack_b.biases)))
    d_params_front, d_h = front_b(moe_b.d_h)
    d_params = jax.tree.map(lambda *g: sum(g), d_params_back, d_params_stack, d_params_front)
    return out_f, stats_f, d_h, d_params

"""The real model cut into pipeline stages: contiguous layer ranges, one function per stage.

Layers 0..L-1 (the ``first_k_dense_replace`` dense blocks, then the MoE blocks) are split
into S contiguous stages as evenly as possible (the first ``L % S`` stages take one more
layer). Stage 0 also embeds the tokens; stage S-1 also runs the final norm, the output
head, the MTP modules and the losses. Every stage reads the *same* parameter tree (the
normal unpipelined layout) and touches only its own rows of the stacked layers, so the
embedding and head shared by stage 0 and stage S-1 (DualPipe and DualPipeV put both on
rank 0) exist once, and checkpoints do not depend on the schedule.

``stage_forward`` has one output structure for every stage, so an executor can
``lax.switch`` on a traced stage index; stages of one :class:`StageShape` (e.g. all middle
stages of an all-MoE split) share one branch that reads its stack rows at traced offsets,
which keeps the compiled program small when a pipe has many stages. It is three parts,
``stage_front`` (embedding, dense blocks), the MoE blocks and ``stage_back`` (head, MTP,
losses), so the executor can run a stage's MoE blocks piece by piece (``fb_pair``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig, fail
from moejax.model import DeepseekV3
from moejax.model.decoder import DecoderBlock
from moejax.model.rope import rope_tables
from moejax.model.transformer import run_stack


class StageStats(NamedTuple):
    """What one stage reports for one micro-batch; summed over stages and micro-batches."""

    loss: jax.Array  # the part of the total loss this stage owns (aux, + main/MTP at the end)
    main: jax.Array  # main next-token loss (last stage only, else 0)
    mtp: jax.Array  # MTP loss averaged over depths (last stage only, else 0)
    aux: jax.Array  # aux balance loss of this stage's MoE blocks (already times alpha)
    counts: jax.Array  # (R, E) int32: this stage's router rows filled, the others 0
    dropped: jax.Array  # int32
    cross_node: jax.Array  # int32


class StageShape(NamedTuple):
    """What a stage's code depends on; stages of one shape share one compiled function
    and differ only in which rows of the stacked layers they read."""

    first: bool  # embeds the tokens
    last: bool  # runs head, MTP and losses
    dense: int  # dense blocks it runs
    moe: int  # MoE blocks it runs


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which global layers each stage runs: ``layers[s] = (first, end)``."""

    config: ModelConfig
    num_stages: int
    layers: tuple[tuple[int, int], ...]

    @classmethod
    def split(cls, config: ModelConfig, num_stages: int) -> "StagePlan":
        """Contiguous, as even as possible; every stage gets at least one layer."""
        total = config.num_hidden_layers
        if num_stages > total:
            fail("model.num_hidden_layers", total,
                 f"must be >= the {num_stages} pipeline stages (one layer per stage at least)")
        base, extra = divmod(total, num_stages)
        bounds, start = [], 0
        for s in range(num_stages):
            end = start + base + (s < extra)
            bounds.append((start, end))
            start = end
        return cls(config, num_stages, tuple(bounds))

    def shape(self, stage: int) -> StageShape:
        first, end = self.layers[stage]
        dense = self.config.first_k_dense_replace
        return StageShape(stage == 0, stage == self.num_stages - 1,
                          max(0, min(end, dense) - first), max(0, end - max(first, dense)))

    def offsets(self, stage: int) -> tuple[int, int]:
        """Index of the stage's first dense block and first MoE block in their stacks."""
        first, _ = self.layers[stage]
        dense = self.config.first_k_dense_replace
        return min(first, dense), max(first, dense) - dense


class StageRows(NamedTuple):
    """Where a stage's layers sit (each may be traced): its first dense and first MoE
    block's rows in the stacks as held (all of a stack, or only some ranks' rows, see
    ``placement``), and its first MoE block's index in the whole model (its router-bias
    and count row)."""

    dense: jax.Array
    moe: jax.Array
    moe_layer: jax.Array


def _rows(stack: DecoderBlock, start: jax.Array, size: int) -> DecoderBlock:
    """Blocks ``start..start+size-1`` of a stack (``start`` may be traced)."""
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), state))


def _rope(model: DeepseekV3, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    return rope_tables(model.config, jnp.arange(tokens.shape[1] - 1)[None, :])


def stage_front(shape: StageShape, rows: StageRows, model: DeepseekV3, h: jax.Array,
                tokens: jax.Array) -> jax.Array:
    """What runs before the stage's MoE blocks: the embedding (a first stage ignores ``h``
    and embeds ``tokens[:, :-1]``) and the dense blocks."""
    if shape.first:
        h = model.embed(tokens[:, :-1])
    if shape.dense:
        no_bias = jnp.zeros((shape.dense, model.config.n_routed_experts), jnp.float32)
        h = run_stack(_rows(model.dense_blocks, rows.dense, shape.dense), h, *_rope(model, tokens),
                      no_bias, model.remat, model.unroll_layers).h
    return h


def stage_moe_blocks(shape: StageShape, rows: StageRows, model: DeepseekV3
                     ) -> tuple[DecoderBlock, jax.Array]:
    """The stage's MoE blocks (stacked) and their router-bias rows."""
    return (_rows(model.moe_blocks, rows.moe, shape.moe),
            jax.lax.dynamic_slice_in_dim(model.router_bias[...], rows.moe_layer, shape.moe))


def moe_stats(model: DeepseekV3, rows: StageRows, counts: jax.Array, balance: jax.Array,
              dropped: jax.Array, cross_node: jax.Array) -> StageStats:
    """A stage's stats from its MoE blocks' per-block ``counts`` (L, E) and ``balance``
    (L,), and their summed ``dropped`` and ``cross_node`` copies; the loss is the aux term."""
    c = model.config
    every = jnp.zeros(model.router_bias.shape, jnp.int32)
    aux = c.aux_loss_alpha * balance.sum()
    zero = jnp.zeros((), jnp.float32)
    return StageStats(aux, zero, zero, aux,
                      jax.lax.dynamic_update_slice_in_dim(every, counts, rows.moe_layer, 0),
                      dropped.astype(jnp.int32), cross_node.astype(jnp.int32))


def stage_back(shape: StageShape, model: DeepseekV3, h: jax.Array, tokens: jax.Array,
               mtp_lambda: float) -> tuple[jax.Array, StageStats]:
    """What runs after the stage's MoE blocks: nothing but the hand-off, or on a last stage
    the final norm, head, MTP modules and losses (its ``h`` out is then zeros)."""
    c = model.config
    zero = jnp.zeros((), jnp.float32)
    none = jnp.zeros((), jnp.int32)
    counts = jnp.zeros(model.router_bias.shape, jnp.int32)
    if not shape.last:
        return h.astype(model.dtype), StageStats(zero, zero, zero, zero, counts, none, none)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    aux, dropped, cross_node = zero, none, none
    normed = model.norm(h)
    main = model.head_loss(normed, labels)
    mtp_losses = []
    for depth, depth_normed, stats in model.mtp_depths(normed, inputs, *_rope(model, tokens)):
        mtp_losses.append(model.head_loss(depth_normed, labels[:, depth:]))
        if stats is not None:
            counts = counts.at[c.num_moe_layers + depth - 1].set(stats.counts)
            aux = aux + c.aux_loss_alpha * stats.balance_loss
            dropped, cross_node = dropped + stats.dropped, cross_node + stats.cross_node
    mtp = jnp.mean(jnp.stack(mtp_losses)) if mtp_losses else zero
    out = jnp.zeros_like(h, model.dtype)  # typed like h inside the executor's shard_map
    return out, StageStats(aux + main + mtp_lambda * mtp, main, mtp, aux, counts, dropped,
                           cross_node)


def add_stats(a: StageStats, b: StageStats) -> StageStats:
    return jax.tree.map(jnp.add, a, b)


def stage_forward(shape: StageShape, rows: StageRows, model: DeepseekV3, h: jax.Array,
                  tokens: jax.Array, mtp_lambda: float) -> tuple[jax.Array, StageStats]:
    """A stage of ``shape`` at ``rows`` of ``model``'s stacks on one micro-batch
    ``tokens`` (b, S+1): ``h`` (b, S, H) in, the next stage's ``h`` out (zeros from a last
    stage, which puts the losses in the stats)."""
    h = stage_front(shape, rows, model, h, tokens)
    stats = None
    if shape.moe:
        blocks, biases = stage_moe_blocks(shape, rows, model)
        h, per_block = run_stack(blocks, h, *_rope(model, tokens), biases, model.remat,
                                 model.unroll_layers)
        stats = moe_stats(model, rows, per_block.counts, per_block.balance_loss,
                          per_block.dropped.sum(), per_block.cross_node.sum())
    h, back = stage_back(shape, model, h, tokens, mtp_lambda)
    return h, back if stats is None else add_stats(stats, back)

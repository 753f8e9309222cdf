"""The DeepSeek-V3 decoder: embedding, stacked blocks, output head, and MTP modules.

Blocks of one kind (dense, then MoE) are stacked along a leading layer axis and run with
``layer_scan`` (``lax.scan``'s meaning, without zero-filled residual stacks): one compiled
block per kind whatever the depth, or (``unroll_layers``) one per layer, which compiles
longer and runs faster on a GPU; either way a layer axis that a pipeline mesh axis can shard.
The aux-loss-free router biases of every MoE block (main blocks first, then the MTP
blocks) live in one non-trainable (R, E) array.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, ModelConfig
from moejax.memory.remat import POLICIES, recomputes, with_policy
from moejax.model.decoder import BlockOutput, DecoderBlock
from moejax.model.head_loss import head_cross_entropy
from moejax.model.layer_scan import layer_scan
from moejax.model.layers import Linear, RMSNorm
from moejax.model.rope import rope_tables
from moejax.model.routing import RoutingStats
from moejax.parallel.sharding import constrain_batch
from moejax.precision import Precision, dense_matmul


class RouterBias(nnx.Variable):
    """Aux-loss-free expert-selection bias: updated from expert loads, never by gradients."""


class ModelOutput(NamedTuple):
    logits: jax.Array  # (B, S, V) FP32; position i predicts token i+1
    mtp_logits: tuple[jax.Array, ...]  # depth d: (B, S-d, V); position i predicts token i+d+1
    expert_counts: jax.Array  # (R, E) int32 token copies per expert, one row per MoE block
    aux_loss: jax.Array  # sequence-wise balance loss times config.aux_loss_alpha
    dropped_tokens: jax.Array  # int32 token copies dropped by an expert capacity limit
    cross_node_tokens: jax.Array  # int32 token copies sent to an expert on another node


class ModelLosses(NamedTuple):
    """What training needs from a forward pass: the losses and the routing totals of
    ``ModelOutput`` (same meaning), without any logits."""
    main: jax.Array  # mean next-token cross-entropy, nats
    mtp: jax.Array  # MTP cross-entropy averaged over depths (0 without MTP)
    expert_counts: jax.Array
    aux_loss: jax.Array
    dropped_tokens: jax.Array
    cross_node_tokens: jax.Array


class _RoutingTotals(NamedTuple):
    """The routing fields ``ModelOutput`` and ``ModelLosses`` end with, in their order."""
    expert_counts: jax.Array
    aux_loss: jax.Array
    dropped_tokens: jax.Array
    cross_node_tokens: jax.Array


def _stacked_blocks(count: int, make: Callable[[nnx.Rngs], DecoderBlock],
                    rngs: nnx.Rngs) -> DecoderBlock | None:
    if count == 0:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(block_rngs: nnx.Rngs) -> DecoderBlock:
        return make(block_rngs)

    return create(rngs)


def run_stack(stack: DecoderBlock, h: jax.Array, cos: jax.Array, sin: jax.Array,
              biases: jax.Array, remat: str, unroll: bool) -> BlockOutput:
    """Runs h through the stacked blocks (each under the ``remat`` policy; ``unroll``: see
    ``layer_scan``); returns the per-block routing stats stacked."""
    graphdef, state = nnx.split(stack)

    def step(carry: jax.Array, xs: tuple, rope: tuple) -> tuple[jax.Array, RoutingStats]:
        block_state, bias = xs
        out = nnx.merge(graphdef, block_state)(carry, *rope, bias)
        return out.h, out.stats

    # Unrolled under none, XLA may keep what the recomputable ops would replay: that is
    # what none asks for, and faster; the other policies fence their recomputes.
    h, per_block = layer_scan(with_policy(step, remat), h, (state, biases), (cos, sin),
                              unroll=unroll, fence_recompute=recomputes(remat))
    return BlockOutput(h, per_block)


class MTPModule(nnx.Module):
    """Multi-token prediction depth d: combine h^{d-1}_i with Emb(t_{i+d}), one block, norm.

    The embedding and the output head are the main model's (passed in at call time).
    """

    def __init__(self, config: ModelConfig, *, moe: bool, rngs: nnx.Rngs, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, precision: Precision = Precision.BF16,
                 attention: str = "xla") -> None:
        c = config
        self.enorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.hnorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, rngs=rngs, dtype=dtype,
                              param_dtype=param_dtype, std=c.initializer_range)
        self.block = DecoderBlock(c, moe=moe, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                  precision=precision, attention=attention)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)

    def __call__(self, h_prev: jax.Array, next_embeddings: jax.Array, cos: jax.Array,
                 sin: jax.Array, bias: jax.Array | None) -> BlockOutput:
        mixed = self.eh_proj(jnp.concatenate([self.enorm(next_embeddings), self.hnorm(h_prev)],
                                             axis=-1))
        return self.block(mixed, cos, sin, bias)


class DeepseekV3(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.bfloat16,
                 param_dtype: jnp.dtype = jnp.float32, remat: str = "none",
                 precision: Precision = Precision.BF16, attention: str = "xla",
                 unroll_layers: bool = False) -> None:
        """``remat``: the recompute policy of every block (``moejax.memory.remat``);
        ``unroll_layers``: differentiate the block stacks one layer after another
        (``layer_scan``'s ``unroll``), not in a loop;
        ``precision``: the GEMM precision of the blocks' attention and MLP linears
        (``moejax.precision``). The embedding, head and MTP input projection stay BF16.
        ``attention``: the softmax core's implementation (``attention.MLAttention``)."""
        c = config
        if remat not in POLICIES:
            raise ConfigError(f"remat={remat!r}: must be one of {POLICIES}")
        self.remat, self.unroll_layers = remat, unroll_layers
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = config
        self.dtype = dtype
        init = jax.nn.initializers.normal(c.initializer_range)
        self.embed_tokens = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size),
                                           param_dtype))
        blocks = dict(kw, precision=precision, attention=attention)
        self.dense_blocks = _stacked_blocks(
            c.first_k_dense_replace, lambda r: DecoderBlock(c, moe=False, rngs=r, **blocks), rngs)
        self.moe_blocks = _stacked_blocks(
            c.num_moe_layers, lambda r: DecoderBlock(c, moe=True, rngs=r, **blocks), rngs)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (None if c.tie_word_embeddings else
                        Linear(c.hidden_size, c.vocab_size, rngs=rngs,
                               std=c.initializer_range, **kw))
        mtp_moe = c.num_moe_layers > 0
        self.mtp = nnx.List([MTPModule(c, moe=mtp_moe, rngs=rngs, **blocks)
                             for _ in range(c.num_nextn_predict_layers)])
        router_rows = c.num_moe_layers + (c.num_nextn_predict_layers if mtp_moe else 0)
        self.router_bias = RouterBias(jnp.zeros((router_rows, c.n_routed_experts), jnp.float32))

    def embed(self, input_ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        return constrain_batch(rows.astype(self.dtype))

    def head_kernel(self) -> jax.Array:
        """The shared output head's (H, V) weights (the embedding's transpose when tied)."""
        return self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]

    def head(self, h: jax.Array) -> jax.Array:
        """The shared output head on already-normalised h: FP32 logits."""
        return dense_matmul(h, self.head_kernel(), jnp.float32)

    def head_loss(self, h: jax.Array, labels: jax.Array) -> jax.Array:
        """Mean cross-entropy of the head on already-normalised h (B, S, H) against labels
        (B, S), with the logits never whole (``head_loss.head_cross_entropy``)."""
        return head_cross_entropy(h, self.head_kernel(), labels)

    def mtp_depths(self, normed: jax.Array, input_ids: jax.Array, cos: jax.Array,
                   sin: jax.Array) -> Iterator[tuple[int, jax.Array, RoutingStats | None]]:
        """Per MTP depth d (1, 2, ...): its normed hidden states (b, S-d, H), which the
        shared head turns into predictions of token i+d+1, and its MoE block's routing
        stats (None for a dense MTP block).

        ``normed`` is the main model's hidden state after its final norm, and each depth
        hands the next its own normed output: the states the output head reads. That is
        where Megatron-Core's MTP (which DeepSeek-V3's training recipe follows) and the
        engines serving DeepSeek-V3's released MTP weights (vLLM, SGLang) take them, so
        those weights load into the computation they were trained in."""
        c = self.config
        seq = input_ids.shape[1]
        biases = self.router_bias[...]
        for depth, module in enumerate(self.mtp, start=1):
            row = c.num_moe_layers + depth - 1
            bias = biases[row] if row < biases.shape[0] else None
            h, stats = module(normed[:, :seq - depth], self.embed(input_ids[:, depth:]),
                              cos[:, :seq - depth], sin[:, :seq - depth], bias)
            normed = module.norm(h)
            yield depth, normed, None if bias is None else stats

    def _trunk(self, input_ids: jax.Array
               ) -> tuple[jax.Array, tuple[jax.Array, ...], _RoutingTotals]:
        """The forward pass up to the output head: the final-normed hidden states (B, S, H),
        each MTP depth's (B, S-d, H), and the routing totals."""
        c = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        seq = input_ids.shape[1]
        cos, sin = rope_tables(c, jnp.arange(seq)[None, :])
        h = self.embed(input_ids)
        biases = self.router_bias[...]
        rows: list[RoutingStats] = []  # per MoE block, each with a leading block axis
        if self.dense_blocks is not None:
            no_bias = jnp.zeros((c.first_k_dense_replace, c.n_routed_experts), jnp.float32)
            h = run_stack(self.dense_blocks, h, cos, sin, no_bias, self.remat,
                          self.unroll_layers).h
        if self.moe_blocks is not None:
            h, stats = run_stack(self.moe_blocks, h, cos, sin, biases[:c.num_moe_layers],
                                 self.remat, self.unroll_layers)
            rows.append(stats)

        normed = self.norm(h)
        mtp_normed = []
        for _, depth_normed, stats in self.mtp_depths(normed, input_ids, cos, sin):
            mtp_normed.append(depth_normed)
            if stats is not None:
                rows.append(jax.tree.map(lambda x: x[None], stats))
        if not rows:
            rows.append(jax.tree.map(lambda x: x[None][:0],
                                     RoutingStats.zeros(c.n_routed_experts)))
        stats = jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)
        return normed, tuple(mtp_normed), _RoutingTotals(
            stats.counts, c.aux_loss_alpha * stats.balance_loss.sum(), stats.dropped.sum(),
            stats.cross_node.sum())

    def forward(self, input_ids: jax.Array) -> ModelOutput:
        """Logits of the main head and of every MTP depth, and the routing totals."""
        normed, mtp_normed, totals = self._trunk(input_ids)
        return ModelOutput(self.head(normed), tuple(map(self.head, mtp_normed)), *totals)

    def losses(self, input_ids: jax.Array, labels: jax.Array) -> ModelLosses:
        """The main and MTP cross-entropies against ``labels`` (B, S) (depth d targets
        ``labels[:, d:]``), through the fused head: what the train step differentiates."""
        normed, mtp_normed, totals = self._trunk(input_ids)
        mtp = [self.head_loss(n, labels[:, d:]) for d, n in enumerate(mtp_normed, start=1)]
        return ModelLosses(self.head_loss(normed, labels),
                           jnp.mean(jnp.stack(mtp)) if mtp else jnp.zeros((), jnp.float32),
                           *totals)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return self.forward(input_ids).logits

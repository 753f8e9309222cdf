"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3.

Queries go through a low-rank bottleneck (or one plain projection when q_lora_rank is
None); keys and values are rebuilt from one compressed latent of kv_lora_rank dims plus a
single decoupled RoPE key shared by all heads. Only the latent and the RoPE key would need
caching at inference; in training, the up-projections are cheap to recompute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.memory.remat import MLA_UP_PROJECTION, recomputable
from moejax.model.layers import Linear, RMSNorm, rms_norm
from moejax.model.rope import apply_rope, softmax_scale
from moejax.parallel.sharding import constrain_batch
from moejax.precision import Precision, linear

# The softmax core: XLA's composition (logits and probabilities materialised; any backend)
# or cuDNN's fused flash attention (CUDA GPUs; q, k and v are padded to one head dim, up to
# 256 on Hopper and 128 before).
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
# The q and kv latents' RMSNorm epsilon: Hugging Face's DeepseekV3 and DeepSeek's reference
# code fix it at 1e-6 whatever ``rms_norm_eps`` says (which the other norms take).
LATENT_NORM_EPS = 1e-6


class MLAttention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, precision: Precision = Precision.BF16,
                 attention: str = "xla") -> None:
        """``precision`` applies to the projections; the softmax core stays BF16/FP32 and
        runs as ``attention`` says (one of ``ATTENTION_IMPLEMENTATIONS``)."""
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention={attention!r}: must be one of "
                             f"{list(ATTENTION_IMPLEMENTATIONS)}")
        c = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=c.initializer_range,
                  precision=precision)
        heads = c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, heads * c.qk_head_dim, **kw)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=LATENT_NORM_EPS,
                                         param_dtype=param_dtype)
            self.q_b_proj = Linear(c.q_lora_rank, heads * c.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=LATENT_NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), **kw)
        self.o_proj = Linear(heads * c.v_head_dim, c.hidden_size, **kw)
        self.config = config
        self.attention = attention

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        c = self.config
        batch, seq, _ = x.shape
        if c.q_lora_rank is None:
            q_source, q_weights = self.q_proj(x), ()
        else:
            q_source = self.q_a_proj(x)
            q_weights = (self.q_a_layernorm.weight[...], self.q_b_proj.kernel[...])
        up = self.kv_b_proj
        project = recomputable(functools.partial(_queries_keys_values, c, up.precision, up.dtype,
                                                 self.attention), MLA_UP_PROJECTION)
        q, k, v = map(constrain_batch, project(
            q_source, self.kv_a_proj_with_mqa(x), q_weights,
            (self.kv_a_layernorm.weight[...], up.kernel[...]), cos, sin))
        out = jax.nn.dot_product_attention(q, k, v, scale=softmax_scale(c),
                                           is_causal=True, implementation=self.attention)
        out = out[:, :seq, :, :c.v_head_dim].reshape(batch, seq, -1)
        return self.o_proj(out)


def _queries_keys_values(c: ModelConfig, precision: Precision, dtype: jnp.dtype, attention: str,
                         q_source: jax.Array, latent_and_rope: jax.Array,
                         q_weights: tuple[jax.Array, ...], kv_weights: tuple[jax.Array, ...],
                         cos: jax.Array, sin: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v for the softmax core, from the down-projections' outputs: the latents'
    norms, the up-projections, RoPE, and the padding the core wants. One recomputable op:
    ``selective`` keeps its inputs (the small latents) and rebuilds q, k and v in backward.
    ``q_weights``: (norm weight, q_b kernel), or () where q_source is q already."""
    batch, seq, _ = q_source.shape
    heads = c.num_attention_heads
    if q_weights:
        q_norm, q_up = q_weights
        q_source = linear(rms_norm(q_source, q_norm, LATENT_NORM_EPS), q_up, precision, dtype)
    q = q_source.reshape(batch, seq, heads, c.qk_head_dim)
    q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]

    kv_norm, kv_up = kv_weights
    latent = rms_norm(latent_and_rope[..., :c.kv_lora_rank], kv_norm, LATENT_NORM_EPS)
    k_rope = latent_and_rope[..., c.kv_lora_rank:][:, :, None, :]
    kv = linear(latent, kv_up, precision, dtype).reshape(
        batch, seq, heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]

    q_rope = apply_rope(q_rope, cos, sin, c.rope_interleave)
    k_rope = apply_rope(k_rope, cos, sin, c.rope_interleave)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1]
                                                  + (c.qk_rope_head_dim,))], axis=-1)
    # jax.nn.dot_product_attention wants one head dim for q, k and v: zero-pad the
    # narrower side (zeros change neither q.k nor p.v) and drop the padding after.
    # cuDNN's training kernels also want an even sequence (MTP depths shorten it by
    # one): keys appended at the end are masked for every real query by causality.
    width = max(c.qk_head_dim, c.v_head_dim)
    length = seq + seq % 2 if attention == "cudnn" else seq
    q, k, v = (_pad(t, (length, width)) for t in (q, k, v.astype(q.dtype)))
    return q, k, v


def _pad(x: jax.Array, sizes: tuple[int, int]) -> jax.Array:
    """Zero-pads the sequence (1) and head-dim (last) axes of (batch, seq, heads, dim)."""
    (length, width), (_, seq, _, dim) = sizes, x.shape
    if (length, width) == (seq, dim):
        return x
    return jnp.pad(x, [(0, 0), (0, length - seq), (0, 0), (0, width - dim)])

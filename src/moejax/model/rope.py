"""Rotary position embedding with DeepSeek's YaRN scaling.

YaRN stretches low frequencies by ``factor`` and keeps high ones, blending across a ramp
set by ``beta_fast``/``beta_slow``; it also rescales cos/sin (``attention_factor``) and the
softmax temperature (``mscale_all_dim``). Frequencies are computed in float64 NumPy once
per config, so they are exact constants in the compiled graph.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ModelConfig


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def inverse_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies (rope_dim/2,) and the cos/sin scale."""
    dim = config.qk_rope_head_dim
    base = config.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    scaling = config.rope_scaling
    if scaling is None:
        return extrapolation.astype(np.float32), 1.0
    interpolation = 1.0 / (scaling.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1 where the frequency is kept (extrapolated), 0 where stretched
    inv_freq = interpolation * (1.0 - keep) + extrapolation * keep
    if scaling.mscale and scaling.mscale_all_dim:
        attention_factor = (_yarn_mscale(scaling.factor, scaling.mscale)
                            / _yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    else:
        attention_factor = _yarn_mscale(scaling.factor)
    return inv_freq.astype(np.float32), attention_factor


def softmax_scale(config: ModelConfig) -> float:
    """``1/sqrt(qk_head_dim)``, times YaRN's squared mscale when ``mscale_all_dim`` is set."""
    scale = config.qk_head_dim ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.mscale_all_dim:
        scale *= _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape positions.shape + (rope_dim/2,), in FP32."""
    inv_freq, attention_factor = inverse_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Rotates x (B, S, heads, rope_dim) by position; cos/sin are (B or 1, S, rope_dim/2).

    With ``interleave`` the stored dims are pairs (x0, x1), (x2, x3), ...; the result is
    written de-interleaved (all first halves, then all second halves). Queries and keys get
    the same layout, so their dot products are unchanged.
    """
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    c = cos[:, :, None, :].astype(jnp.float32)
    s = sin[:, :, None, :].astype(jnp.float32)
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

"""Online fine-grained FP8 (E4M3) quantization, DeepSeek-V3 style.

Activations and gradients get one FP32 scale per 1x128 tile along the contraction
axis, weights one per 128x128 block. Scales are computed from the current values
(no delayed scaling), so the quantizer is a pure function of its input.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to_tiles(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    for ax in axes:
        pad[ax] = (0, cdiv(x.shape[ax], TILE) * TILE - x.shape[ax])
    return jnp.pad(x, pad)


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """The FP32 scale of a tile with this amax. An all-zero tile gets scale 1 (any value
    dequantizes zeros exactly); NaN/inf stay non-finite so they propagate into the
    product instead of vanishing."""
    return jnp.where(amax == 0, 1.0, amax / FP8_MAX).astype(jnp.float32)


def amax_from_bits(v: jax.Array, axis: int | tuple[int, ...]) -> jax.Array:
    """max |v| along `axis` of FP32 v: an integer max over the bits with the sign cleared,
    two instructions an element. NaN patterns sort above inf, so a NaN always gives NaN
    (Triton's float max drops it, and so does XLA:CPU's reduction of larger or multi-axis
    blocks: a tile holding a NaN got a finite scale there)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.int32) & 0x7FFFFFFF
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis), jnp.float32)


def _to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def _matrix(x: jax.Array, name: str) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, cols), got shape {x.shape}")
    return x.shape


@jax.jit
def quantize_1x128(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (M, K) -> (x_fp8 (M, K), scale (M, ceil(K/128))); x ~= x_fp8 * scale per tile."""
    m, k = _matrix(x, "x")
    xp = _pad_to_tiles(x.astype(jnp.float32), (1,)).reshape(m, cdiv(k, TILE), TILE)
    scale = scale_from_amax(amax_from_bits(xp, -1))
    q = _to_fp8(xp, scale[..., None]).reshape(m, xp.shape[1] * TILE)[:, :k]
    return q, scale


@jax.jit
def quantize_128x128(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w (R, C) -> (w_fp8 (R, C), scale (ceil(R/128), ceil(C/128))) per 128x128 block; the
    blocks of w^T are those of w transposed, so either layout may be quantized."""
    n, k = _matrix(w, "w")
    wp = _pad_to_tiles(w.astype(jnp.float32), (0, 1))
    nb, kb = wp.shape[0] // TILE, wp.shape[1] // TILE
    blocks = wp.reshape(nb, TILE, kb, TILE)
    scale = scale_from_amax(amax_from_bits(blocks, (1, 3)))
    q = _to_fp8(blocks, scale[:, None, :, None]).reshape(nb * TILE, kb * TILE)[:n, :k]
    return q, scale


def expand_scale(scale: jax.Array, shape: tuple[int, int], row_tile: int) -> jax.Array:
    """Per-element FP32 scale of a (rows, cols) operand from its tile scales.

    row_tile is 1 for 1x128 scales and 128 for 128x128 blocks; columns are always
    tiled by 128 (the contraction axis).
    """
    rows, cols = shape
    full = jnp.repeat(jnp.repeat(scale, row_tile, axis=-2), TILE, axis=-1)
    return full[..., :rows, :cols]


def dequantize(q: jax.Array, scale: jax.Array, row_tile: int) -> jax.Array:
    """FP32 value of a quantized (..., rows, cols) operand (row_tile as in expand_scale).
    The scale's shape is checked: a 1x128 scale read as 128x128 blocks (or the reverse)
    would broadcast into wrong values, not an error."""
    if row_tile not in (1, TILE):
        raise ValueError(f"row_tile={row_tile}: must be 1 (1x128 tiles) or {TILE} (blocks)")
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], cdiv(rows, row_tile), cdiv(cols, TILE))
    if scale.shape != want:
        raise ValueError(f"scale has shape {scale.shape}; q {q.shape} with row_tile={row_tile} "
                         f"needs {want}")
    return q.astype(jnp.float32) * expand_scale(scale, q.shape[-2:], row_tile)


def as_residual(quantized: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """An FP8 (values, scales) pair as a custom VJP keeps it: the values as their uint8 bits.

    Why: ``jax.checkpoint`` rounds every floating-point residual it saves with
    ``reduce_precision`` to its dtype's ``finfo`` bits. For float8_e4m3fn (no infinities)
    XLA reads 4 exponent bits IEEE-style, so the top binade (256-448, where every tile's
    largest value lands) turned into NaN on XLA:CPU. Integers are saved untouched; the
    bitcast is free."""
    values, scales = quantized
    return jax.lax.bitcast_convert_type(values, jnp.uint8), scales


def from_residual(kept: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The FP8 (values, scales) pair that ``as_residual`` kept. FP8 values in are refused:
    a caller passing them would bring back the NaN that ``as_residual`` avoids."""
    bits, scales = kept
    if bits.dtype != jnp.uint8:
        raise TypeError(f"from_residual wants the uint8 bits that as_residual keeps, got "
                        f"{bits.dtype} values")
    return jax.lax.bitcast_convert_type(bits, FP8), scales

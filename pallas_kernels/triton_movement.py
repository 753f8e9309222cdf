"""Pallas (Triton lowering) token-movement kernels: one read of the input, one write of
the output, the index math and quantization in registers between them.

- `permute`: sorted copies x[permutation // k], optionally quantized to FP8 with 1x128
  scales on the way out (`quantize_1x128` and the scatter to the k sorted rows in one
  pass; each token is read and quantized once).
- `combine`: out[t] = sum over the k copies of weight * row, gathered through the inverse
  permutation and summed in FP32 registers (un-permute, weight and sum in one pass).
- `combine_backward`: the weighted dispatch of the gradient (each gradient row read once,
  scattered to its k copies) and the per-copy dots.
- `quantize_along_tokens`: quantize_1x128(x.T) read straight from row-major x (the tile is
  transposed in registers, not by a separate pass over memory); from FP8 x with its 1x128
  scales, dequantized in the same pass (an FP8 linear's saved input, for its wgrad).
- `inverse_permutation`: the sorted row of each token copy, which the scatter-form kernels
  index by (one store per element, where XLA's scatter ran three kernels).
- `quantize_weights`: an FP8 linear's 128x128 weight blocks, quantized once from the stored
  (G, K, N) weights and written in both layouts the GEMMs read.
- `quantize_both_ways`: an FP8 linear's output gradient read once and quantized for dgrad
  (1x128 along its columns) and for wgrad (along the tokens, into the aligned layout).
- `quantize_rows`: quantize_1x128 in one pass (XLA's compile reads the rows twice: an amax
  pass, then a quantizing pass).
- `swiglu_quantize`: SwiGLU of the 16-bit gate and up rows, quantized 1x128 in the same
  pass (the FP8 down projection's input; XLA wrote it in FP32 and read it twice more), and
  on request gate and up quantized too (the FP8 copies backward keeps), from the same read.

Quantization is bit-identical to `quantize.quantize_1x128` on the same platform: the same
FP32 operations in the same order (`swiglu_quantize`'s SiLU is not: Triton's exp is not
XLA's, so its BF16 rounding can land one ulp apart). On an H100 the kernels' FP8 values and
scales matched XLA's bit for bit over 117M elements with Triton's own `/`; correctly rounded
division (`div.rn`) did not (XLA's GPU amax / 448 is not the IEEE quotient either). Compiled
for a GPU, the kernels leave out quantize_1x128's clamp to +-448: the GPU's FP32 to E4M3
conversion saturates (PTX allows it only as `cvt.rn.satfinite`), which gives the clamp's
result on every input, NaN included; interpret mode keeps the clamp, as a plain cast
overflows to NaN there.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.group_schedule import AlignedLayout
from pallas_kernels.quantize import FP8, FP8_MAX, TILE, amax_from_bits, cdiv, scale_from_amax
from pallas_kernels.triton_gemm import _compiler_params, _out_shape


@dataclasses.dataclass(frozen=True)
class MoveConfig:
    """Tile of one program: block_rows rows (tokens) x block_cols columns (hidden)."""

    block_rows: int
    block_cols: int
    num_warps: int = 4
    num_stages: int = 1


# The best of a sweep on an H100 at T = 16384, H = 7168 and 2048, timed on the device
# (bench_movement --tune; docs/performance.md, session 17).
PERMUTE_CONFIG = MoveConfig(block_rows=32, block_cols=512, num_warps=8)
# The FP8 permute: one token a program writing bytes (T = 4096: 86% of copy where 8 tokens
# ran 81%, equal at T = 65536, session 18's sweep over 8 input sets), eight writing uint32
# words (the 2-4 GiB buffers: 86% where one token ran 81%).
QUANTIZED_PERMUTE_CONFIG = MoveConfig(block_rows=1, block_cols=2048)
PACKED_PERMUTE_CONFIG = MoveConfig(block_rows=8, block_cols=2048)
COMBINE_CONFIG = MoveConfig(block_rows=8, block_cols=1024)
COMBINE_BWD_CONFIG = MoveConfig(block_rows=8, block_cols=1024)
TRANSPOSE_CONFIG = MoveConfig(block_rows=TILE, block_cols=64)
# From FP8 x, 128 columns: whole 128-byte rows (8-15% faster than 64 on an H100, session 18).
REQUANTIZE_CONFIG = MoveConfig(block_rows=TILE, block_cols=TILE)
# One 128x128 weight block a program; 8 warps hold its 16K FP32 values in 64 registers each.
WEIGHT_CONFIG = MoveConfig(block_rows=TILE, block_cols=TILE, num_warps=8)
# An H100 sweep of 8 tiles at (M, I) = (98304, 704) and (32768, 2048): 8 x 256 within 2% of
# the best at both (86% and 90% of a same-size copy; 2.2x and 1.7x XLA).
SWIGLU_CONFIG = MoveConfig(block_rows=8, block_cols=256)
# quantize_1x128 in one pass: the SwiGLU tile, not yet swept on its own.
QUANTIZE_CONFIG = SWIGLU_CONFIG
# Both ways: one 128x128 tile a program, quantized as it stands and transposed. 4 warps:
# on an H100 1.31x 8 warps and 1.38x 16 at (98304, 1024); stages made no difference
# (docs/performance.md, session 36).
BOTH_WAYS_CONFIG = MoveConfig(block_rows=TILE, block_cols=TILE, num_warps=4)


def offsets_fit(shape: tuple[int, ...], dtype) -> bool:
    """Whether Pallas Triton addresses an array of this type correctly: it uses signed
    32-bit element offsets unless the array exceeds 4 GiB, so 1-byte arrays of 2-4 GiB
    (FP8 token buffers of >= 2**31 elements) would wrap."""
    elements = math.prod(shape)
    return elements < 2**31 or elements * jnp.dtype(dtype).itemsize > 2**32


def _iota(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _gathered(rows: jax.Array, c0, width: int) -> tuple[jax.Array, jax.Array]:
    """Index of the (len(rows), width) tile of rows `rows`, columns c0.. (both as arrays:
    Pallas interpret mode cannot mix an array index with a slice)."""
    return rows[:, None], (c0 + _iota(width))[None, :]


def _quantize_rows(v: jax.Array, saturating: bool) -> tuple[jax.Array, jax.Array]:
    """FP8 values and FP32 scales of a (rows, 128) tile, one scale per row (masked-out
    elements must be 0), bit-identical to quantize_1x128.

    amax comes from the bits (`amax_from_bits`), so a NaN in a row makes its scale NaN.
    `saturating`: the FP8 cast clamps to +-448
    itself (compiled Triton on a GPU; the module docstring says why), so the clamp, four
    instructions per element, is left out.
    """
    v = v.astype(jnp.float32)
    scale = scale_from_amax(amax_from_bits(v, 1)[:, None])
    y = v / scale
    if not saturating:
        y = jnp.where(y > FP8_MAX, FP8_MAX, jnp.where(y < -FP8_MAX, -FP8_MAX, y))  # keeps NaN
    return y.astype(FP8), scale[:, 0]


def _call(name: str, kernel, operands, out_shapes, grid, cfg: MoveConfig, interpret: bool,
          out_init):
    """pallas_call with optional initial outputs aliased in (tests poison them to catch
    unwritten elements); the kernel never sees those extra input refs. The name is what
    profiler traces show (moejax.profiling files it under data movement)."""
    n_in = len(operands)
    inits = list(out_init or ())
    body = kernel if not inits else (
        lambda *refs: kernel(*refs[:n_in], *refs[n_in + len(inits):]))
    return pl.pallas_call(
        body, out_shape=out_shapes, grid=grid, compiler_params=_compiler_params(cfg), name=name,
        interpret=interpret,
        input_output_aliases={n_in + i: i for i in range(len(inits))},
    )(*operands, *inits)


def _narrowed(cfg: MoveConfig, h: int) -> MoveConfig:
    """cfg with its columns cut to H rounded up to a power of two (at least 128): a block
    wider than the rows leaves its extra lanes masked (H = 1024 under 2048-wide tiles)."""
    return dataclasses.replace(cfg, block_cols=min(cfg.block_cols,
                                                   max(TILE, pl.next_power_of_2(h))))


def _quantizing(cfg: MoveConfig, op: str) -> MoveConfig:
    """cfg, if its columns hold whole 1x128 scale tiles (a kernel that quantizes rows)."""
    if cfg.block_cols % TILE:
        raise ValueError(f"{op} quantizes 1x128 tiles: it needs block_cols a multiple of "
                         f"{TILE}, got {cfg.block_cols}")
    return cfg


def _pack_words(q: jax.Array) -> jax.Array:
    """(rows, cols) FP8 -> (rows, cols / 4) uint32, four bytes per word, first byte lowest
    (what a little-endian bitcast of the words back to bytes reads)."""
    rows, cols = q.shape
    byte = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
    shift = (8 * _iota(4)).astype(jnp.uint32)
    return jnp.sum(byte.reshape(rows, cols // 4, 4) << shift[None, None, :], axis=2)


def _token_block(i, bt: int, tokens: int) -> jax.Array:
    """Rows (tokens) i*bt.. of program i, those past the last repeating it: their duplicate
    stores write the same values to the same places, so rows need no store mask (a masked
    scatter would race its real writer in interpret mode, which emulates masks by
    read-modify-write)."""
    return jnp.minimum(i * bt + _iota(bt), tokens - 1)


def _inverse_kernel(p_ref, inv_ref, *, n, block):
    rows = _token_block(pl.program_id(0), block, n)
    pltriton.store(inv_ref.at[pltriton.load(p_ref.at[rows])], rows)


# Permutation entries per program (an H100 sweep of 512-4096 entries: 512 best).
INVERSE_CONFIG = MoveConfig(block_rows=512, block_cols=1)


def inverse_permutation(permutation: jax.Array, *, interpret: bool = False) -> jax.Array:
    """See movement_reference.inverse_permutation: inverse[permutation[j]] = j, one store per
    entry. XLA's scatter for it ran three kernels (a bounds compare, a copy, the scatter):
    4.1 us at 32K entries on an H100, this kernel 1.8 (docs/performance.md, session 18)."""
    n, rows = permutation.shape[0], INVERSE_CONFIG.block_rows
    kernel = functools.partial(_inverse_kernel, n=n, block=rows)
    return _call("inverse_permutation", kernel, [permutation],
                 _out_shape((n,), permutation.dtype, permutation), (cdiv(n, rows),),
                 INVERSE_CONFIG, interpret, None)


def _permute_kernel(inv_ref, x_ref, *out_refs, k, tokens, h, cfg, quantize, packed,
                    saturating):
    """Program (i, j): tokens i*bt.. read once (columns j*bh..), quantized once, and each
    written to its k sorted rows (a scatter): the gather form read every token k times,
    from HBM once x outgrows L2. The whole (bt, bh) tile is stored at once: FP8 rows in
    128-byte pieces ran at half the bandwidth of the BF16 permute's."""
    bt, bh = cfg.block_rows, cfg.block_cols
    i, j = pl.program_id(0), pl.program_id(1)
    toks = _token_block(i, bt, tokens)
    col_in = (j * bh + _iota(bh) < h)[None, :]
    v = pltriton.load(x_ref.at[_gathered(toks, j * bh, bh)], mask=col_in, other=0)
    dests = [pltriton.load(inv_ref.at[toks * k + s]) for s in range(k)]
    if not quantize:
        for d in dests:
            pltriton.store(out_refs[0].at[_gathered(d, j * bh, bh)], v, mask=col_in)
        return
    q_ref, s_ref = out_refs
    nb = bh // TILE
    q, scale = _quantize_rows(v.reshape(bt * nb, TILE), saturating)
    q, scale = q.reshape(bt, bh), scale.reshape(bt, nb)
    tiles = j * nb + _iota(nb)
    tile_in = (tiles < cdiv(h, TILE))[None, :]
    if packed:
        q, col_in = _pack_words(q), (j * bh // 4 + _iota(bh // 4) < h // 4)[None, :]
    for d in dests:
        pltriton.store(q_ref.at[_gathered(d, j * q.shape[1], q.shape[1])], q, mask=col_in)
        pltriton.store(s_ref.at[d[:, None], tiles[None, :]], scale, mask=tile_in)


def packs_fp8(n_rows: int, h: int) -> bool:
    """Whether permute writes its FP8 rows as uint32 words: where a byte buffer would be
    past Pallas Triton's 32-bit offsets, and the words fit them (H a multiple of 4)."""
    return not offsets_fit((n_rows, h), FP8) and h % 4 == 0


@functools.partial(jax.jit, static_argnames=("k", "quantize", "cfg", "interpret", "packed"))
def permute(x, permutation, k, *, quantize, cfg=None, interpret=False, out_init=None,
            packed=None):
    """See movement_reference.permute. packed (default: packs_fp8) writes the FP8 rows as
    uint32 words, bitcast back to bytes for free outside the kernel."""
    n_rows, h = permutation.shape[0], x.shape[1]
    packed = quantize and (packs_fp8(n_rows, h) if packed is None else packed)
    default = (PACKED_PERMUTE_CONFIG if packed else QUANTIZED_PERMUTE_CONFIG) if quantize \
        else PERMUTE_CONFIG
    cfg = _narrowed(cfg or default, h)
    if quantize:
        _quantizing(cfg, "the FP8 permute")
    if quantize:
        values = (_out_shape((n_rows, h // 4), jnp.uint32, x, permutation) if packed
                  else _out_shape((n_rows, h), FP8, x, permutation))
        outs = (values, _out_shape((n_rows, cdiv(h, TILE)), jnp.float32, x, permutation))
    else:
        outs = (_out_shape((n_rows, h), x.dtype, x, permutation),)
    tokens = x.shape[0]
    kernel = functools.partial(_permute_kernel, k=k, tokens=tokens, h=h, cfg=cfg,
                               quantize=quantize, packed=packed, saturating=not interpret)
    grid = (cdiv(tokens, cfg.block_rows), cdiv(h, cfg.block_cols))
    inverse = inverse_permutation(permutation, interpret=interpret)
    result = _call("dispatch_permute", kernel, [inverse, x], outs, grid, cfg, interpret,
                   out_init)
    if not quantize:
        return result[0], None
    values = result[0]
    if packed:
        values = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(n_rows, h)
        values = jax.lax.bitcast_convert_type(values, FP8)
    return values, result[1]


def _combine_kernel(inv_ref, w_ref, y_ref, o_ref, *, k, tokens, h, cfg):
    bt, bh = cfg.block_rows, cfg.block_cols
    i, j = pl.program_id(0), pl.program_id(1)
    toks = i * bt + _iota(bt)
    tok_in = toks < tokens
    cols = pl.ds(j * bh, bh)
    mask = tok_in[:, None] & (j * bh + _iota(bh) < h)[None, :]
    acc = jnp.zeros((bt, bh), jnp.float32)
    for s in range(k):
        copy = toks * k + s
        row = pltriton.load(inv_ref.at[copy], mask=tok_in, other=0)
        w = pltriton.load(w_ref.at[copy], mask=tok_in, other=0.0)
        v = pltriton.load(y_ref.at[_gathered(row, j * bh, bh)], mask=mask, other=0)
        acc = acc + w[:, None] * v.astype(jnp.float32)
    pltriton.store(o_ref.at[pl.ds(i * bt, bt), cols], acc.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def combine(y, permutation, weights, *, cfg=None, interpret=False, out_init=None):
    """See movement_reference.combine."""
    cfg = cfg or COMBINE_CONFIG
    (tokens, k), h = weights.shape, y.shape[1]
    operands = [inverse_permutation(permutation, interpret=interpret),
                weights.reshape(-1).astype(jnp.float32), y]
    kernel = functools.partial(_combine_kernel, k=k, tokens=tokens, h=h, cfg=cfg)
    grid = (cdiv(tokens, cfg.block_rows), cdiv(h, cfg.block_cols))
    out = _out_shape((tokens, h), y.dtype, y, permutation, weights)
    return _call("combine", kernel, operands, out, grid, cfg, interpret, out_init)


def _combine_bwd_kernel(inv_ref, w_ref, g_ref, y_ref, dy_ref, dots_ref, *, k, tokens, h,
                        cfg):
    """Program (i, j): the gradient rows of tokens i*bt.. (columns j*bh..) read once and
    written, weighted, to each token's k sorted rows; the per-copy dots over these columns
    go to column j of dots_ref (summed over j outside)."""
    bt, bh = cfg.block_rows, cfg.block_cols
    i, j = pl.program_id(0), pl.program_id(1)
    toks = _token_block(i, bt, tokens)
    col_in = (j * bh + _iota(bh) < h)[None, :]
    g = pltriton.load(g_ref.at[_gathered(toks, j * bh, bh)], mask=col_in, other=0)
    g = g.astype(jnp.float32)
    for s in range(k):
        copy = toks * k + s
        dest = pltriton.load(inv_ref.at[copy])
        w = pltriton.load(w_ref.at[copy])
        v = pltriton.load(y_ref.at[_gathered(dest, j * bh, bh)], mask=col_in, other=0)
        pltriton.store(dy_ref.at[_gathered(dest, j * bh, bh)],
                       (w[:, None] * g).astype(dy_ref.dtype), mask=col_in)
        pltriton.store(dots_ref.at[copy, j], jnp.sum(g * v.astype(jnp.float32), axis=1))


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def combine_backward(g, y, permutation, weights, *, cfg=None, interpret=False, out_init=None):
    """See movement_reference.combine_backward."""
    cfg = cfg or COMBINE_BWD_CONFIG
    (tokens, k), (n_rows, h) = weights.shape, y.shape
    operands = [inverse_permutation(permutation, interpret=interpret),
                weights.reshape(-1).astype(jnp.float32), g, y]
    col_blocks = cdiv(h, cfg.block_cols)
    outs = (_out_shape((n_rows, h), y.dtype, g, y, permutation, weights),
            _out_shape((n_rows, col_blocks), jnp.float32, g, y, permutation, weights))
    kernel = functools.partial(_combine_bwd_kernel, k=k, tokens=tokens, h=h, cfg=cfg)
    grid = (cdiv(tokens, cfg.block_rows), col_blocks)
    dy, dots = _call("combine_backward", kernel, operands, outs, grid, cfg, interpret,
                     out_init)
    return dy, jnp.sum(dots, axis=1).reshape(tokens, k).astype(weights.dtype)


def _quantize_tokens_kernel(*refs, width, kdim, cfg, saturating, aligned, dequantize):
    """Program (i, j): token tile i, columns j*bk.., transposed and quantized in registers.
    Tile i starts at row i*128 of x unless the tokens go to an aligned layout (`aligned`),
    whose tile sources and row counts are loaded first: a dependent load at each program's
    start, which the plain layout does without (about 1 us of a 13-39 us kernel on an H100
    at T = 4096, session 18). `dequantize`: x is FP8 bits with 1x128 scales along its
    columns, dequantized in registers (the tile's bk columns share one scale per token)."""
    bk = cfg.block_cols
    i, j = pl.program_id(0), pl.program_id(1)
    refs = list(refs)
    source_ref, rows_ref = (refs.pop(0), refs.pop(0)) if aligned else (None, None)
    x_ref = refs.pop(0)
    xs_ref = refs.pop(0) if dequantize else None
    q_ref, s_ref = refs
    source, rows = (source_ref[i], rows_ref[i]) if aligned else (i * TILE, width - i * TILE)
    cols = pl.ds(j * bk, bk)
    row_in = _iota(TILE) < rows
    col_in = j * bk + _iota(bk) < kdim
    v = pltriton.load(x_ref.at[pl.ds(source, TILE), cols],
                      mask=row_in[:, None] & col_in[None, :], other=0)
    if dequantize:  # as quantize.dequantize: the FP32 product of value and scale
        x_scale = pltriton.load(xs_ref.at[pl.ds(source, TILE), j * bk // TILE], mask=row_in,
                                other=0)
        v = jax.lax.bitcast_convert_type(v, FP8).astype(jnp.float32) * x_scale[:, None]
    q, scale = _quantize_rows(v.T, saturating)  # (bk, 128): one scale per column of x
    out_in = i * TILE + _iota(TILE) < width
    pltriton.store(q_ref.at[cols, pl.ds(i * TILE, TILE)], q,
                   mask=col_in[:, None] & out_in[None, :])
    pltriton.store(s_ref.at[cols, i], scale, mask=col_in)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def quantize_along_tokens(x, layout: AlignedLayout | None = None, scale=None, *, cfg=None,
                          interpret=False, out_init=None):
    """See movement_reference.quantize_along_tokens. Each program quantizes one 128-token
    tile, read from its source rows (contiguous in x in both layouts)."""
    cfg = cfg or (TRANSPOSE_CONFIG if scale is None else REQUANTIZE_CONFIG)
    if cfg.block_rows != TILE:
        raise ValueError(f"quantize_along_tokens needs block_rows == {TILE}, got {cfg.block_rows}")
    if scale is not None and TILE % cfg.block_cols:
        raise ValueError(f"dequantizing needs block_cols dividing {TILE} (one scale per token "
                         f"in a tile), got {cfg.block_cols}")
    m, kdim = x.shape
    operands = [] if layout is None else [layout.tile_source, layout.tile_rows]
    if scale is None:
        operands.append(x)
    else:  # FP8 as its bits: Pallas Triton has no FP8 fill value for the masked load
        operands += [jax.lax.bitcast_convert_type(x, jnp.uint8), scale]
    width = m if layout is None else layout.length
    outs = (_out_shape((kdim, width), FP8, x),
            _out_shape((kdim, cdiv(width, TILE)), jnp.float32, x))
    kernel = functools.partial(_quantize_tokens_kernel, width=width, kdim=kdim, cfg=cfg,
                               saturating=not interpret, aligned=layout is not None,
                               dequantize=scale is not None)
    grid = (cdiv(width, TILE), cdiv(kdim, cfg.block_cols))
    return tuple(_call("transpose_quantize", kernel, operands, outs, grid, cfg, interpret,
                       out_init))


def _quantize_both_ways_kernel(source_ref, rows_ref, x_ref, q_ref, s_ref, qt_ref, st_ref, *,
                               kdim, saturating):
    """Program (i, j): aligned tile i's 128 source rows, columns j*128.., read once and
    quantized twice in registers: 1x128 along the columns (one tile a row: dgrad's operand,
    stored at the rows' own places) and 1x128 along the tokens (transposed into the
    aligned layout: wgrad's operand)."""
    i, j = pl.program_id(0), pl.program_id(1)
    source, rows = source_ref[i], rows_ref[i]
    cols = pl.ds(j * TILE, TILE)
    row_in = _iota(TILE) < rows
    col_in = j * TILE + _iota(TILE) < kdim
    mask = row_in[:, None] & col_in[None, :]
    v = pltriton.load(x_ref.at[pl.ds(source, TILE), cols], mask=mask, other=0
                      ).astype(jnp.float32)
    q, scale = _quantize_rows(v, saturating)
    pltriton.store(q_ref.at[pl.ds(source, TILE), cols], q, mask=mask)
    pltriton.store(s_ref.at[pl.ds(source, TILE), j], scale, mask=row_in)
    qt, scale_t = _quantize_rows(v.T, saturating)
    pltriton.store(qt_ref.at[cols, pl.ds(i * TILE, TILE)], qt, mask=col_in[:, None])
    pltriton.store(st_ref.at[cols, i], scale_t, mask=col_in)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def quantize_both_ways(x, layout: AlignedLayout, *, cfg=None, interpret=False, out_init=None):
    """See movement_reference.quantize_both_ways: one read of x (M, K) for an FP8 linear's
    output gradient, which dgrad wants quantized along K and wgrad along the tokens. A
    program holds one 128 x 128 tile, so `cfg` sets only its warps and stages."""
    cfg = cfg or BOTH_WAYS_CONFIG
    if (cfg.block_rows, cfg.block_cols) != (TILE, TILE):
        raise ValueError(f"quantize_both_ways runs {TILE} x {TILE} tiles, got block_rows="
                         f"{cfg.block_rows}, block_cols={cfg.block_cols}")
    m, kdim = x.shape
    width = layout.length
    outs = (_out_shape((m, kdim), FP8, x), _out_shape((m, cdiv(kdim, TILE)), jnp.float32, x),
            _out_shape((kdim, width), FP8, x),
            _out_shape((kdim, cdiv(width, TILE)), jnp.float32, x))
    kernel = functools.partial(_quantize_both_ways_kernel, kdim=kdim, saturating=not interpret)
    grid = (width // TILE, cdiv(kdim, TILE))
    return tuple(_call("quantize_both_ways", kernel,
                       [layout.tile_source, layout.tile_rows, x], outs, grid,
                       cfg, interpret, out_init))


def _quantize_weights_kernel(w_ref, q_ref, qt_ref, s_ref, *, rows, cols, saturating):
    """Program (g, i, j): block (i, j) of w[g], read once, quantized on its one scale, and
    stored as is and transposed (the transpose goes through shared memory, not HBM)."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row_in, col_in = i * TILE + _iota(TILE) < rows, j * TILE + _iota(TILE) < cols
    mask = row_in[:, None] & col_in[None, :]
    r, c = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
    v = pltriton.load(w_ref.at[g, r, c], mask=mask, other=0).astype(jnp.float32)
    q, scale = _quantize_rows(v.reshape(1, TILE * TILE), saturating)
    q = q.reshape(TILE, TILE)
    pltriton.store(q_ref.at[g, r, c], q, mask=mask)
    pltriton.store(qt_ref.at[g, c, r], q.T, mask=mask.T)
    pltriton.store(s_ref.at[g, i, pl.ds(j, 1)], scale)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_weights(w, *, interpret=False, out_init=None):
    """See movement_reference.quantize_weights: one read of w, one write of each layout.
    XLA's compile of the reference transposed the FP32 stack (8 bytes an element) and read
    it twice more (amax, then quantize) before writing the two FP8 copies
    (docs/performance.md, session 19)."""
    groups, rows, cols = w.shape
    nr, nc = cdiv(rows, TILE), cdiv(cols, TILE)
    outs = (_out_shape((groups, rows, cols), FP8, w), _out_shape((groups, cols, rows), FP8, w),
            _out_shape((groups, nr, nc), jnp.float32, w))
    kernel = functools.partial(_quantize_weights_kernel, rows=rows, cols=cols,
                               saturating=not interpret)
    return tuple(_call("weights_transpose_quantize", kernel, [w], outs, (groups, nr, nc),
                       WEIGHT_CONFIG, interpret, out_init))


class _RowTile(NamedTuple):
    """Program (i, j)'s (block_rows, block_cols) tile of an (M, I) array quantized 1x128
    along I: its index, element mask, and where its scales go."""
    index: tuple
    mask: jax.Array
    scale_index: tuple
    scale_mask: jax.Array
    tiles: int  # 1x128 scale tiles a row of the block holds


def _row_tile(rows: int, cols: int, cfg: MoveConfig) -> _RowTile:
    bt, bh = cfg.block_rows, cfg.block_cols
    i, j = pl.program_id(0), pl.program_id(1)
    row_ids = i * bt + _iota(bt)
    row_in = row_ids < rows
    nb = bh // TILE
    tiles = j * nb + _iota(nb)
    return _RowTile((pl.ds(i * bt, bt), pl.ds(j * bh, bh)),
                    row_in[:, None] & (j * bh + _iota(bh) < cols)[None, :],
                    (row_ids[:, None], tiles[None, :]),
                    row_in[:, None] & (tiles < cdiv(cols, TILE))[None, :], nb)


def _load_tile(ref, tile: _RowTile) -> jax.Array:
    """The tile in FP32; masked lanes load 0, which leaves each 1x128 tile's amax alone."""
    return pltriton.load(ref.at[tile.index], mask=tile.mask, other=0).astype(jnp.float32)


def _store_quantized(v: jax.Array, values_ref, scales_ref, tile: _RowTile,
                     saturating: bool) -> None:
    """quantize_1x128 of the FP32 tile v into values_ref and scales_ref."""
    bt, bh = v.shape
    q, scale = _quantize_rows(v.reshape(bt * tile.tiles, TILE), saturating)
    pltriton.store(values_ref.at[tile.index], q.reshape(bt, bh), mask=tile.mask)
    pltriton.store(scales_ref.at[tile.scale_index], scale.reshape(bt, tile.tiles),
                   mask=tile.scale_mask)


def _quantize_rows_kernel(x_ref, q_ref, s_ref, *, rows, cols, cfg, saturating):
    tile = _row_tile(rows, cols, cfg)
    _store_quantized(_load_tile(x_ref, tile), q_ref, s_ref, tile, saturating)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def quantize_rows(x, *, cfg=None, interpret=False, out_init=None):
    """quantize_1x128(x) of x (M, K) in one pass: one read of x, one write of the FP8 rows
    and scales (XLA's compile of the reference read x twice: an amax pass, then a
    quantizing pass)."""
    cfg = _quantizing(_narrowed(cfg or QUANTIZE_CONFIG, x.shape[1]), "quantize_rows")
    rows, cols = x.shape
    outs = (_out_shape((rows, cols), FP8, x), _out_shape((rows, cdiv(cols, TILE)), jnp.float32, x))
    kernel = functools.partial(_quantize_rows_kernel, rows=rows, cols=cols, cfg=cfg,
                               saturating=not interpret)
    grid = (cdiv(rows, cfg.block_rows), cdiv(cols, cfg.block_cols))
    return tuple(_call("quantize_rows", kernel, [x], outs, grid, cfg, interpret, out_init))


def _swiglu_quantize_kernel(g_ref, u_ref, q_ref, s_ref, *inputs_refs, rows, cols, cfg,
                            saturating):
    """Program (i, j): rows i*bt.., columns j*bh.. of gate and up, read once; SwiGLU in FP32,
    rounded to the inputs' dtype, quantized per 1x128 tile. ``inputs_refs``: where given,
    gate and up themselves are quantized from the same registers into them (values and
    scales of each)."""
    tile = _row_tile(rows, cols, cfg)
    gate, up = _load_tile(g_ref, tile), _load_tile(u_ref, tile)
    hidden = (jax.nn.silu(gate) * up).astype(g_ref.dtype).astype(jnp.float32)
    _store_quantized(hidden, q_ref, s_ref, tile, saturating)
    if inputs_refs:
        gq_ref, gs_ref, uq_ref, us_ref = inputs_refs
        _store_quantized(gate, gq_ref, gs_ref, tile, saturating)
        _store_quantized(up, uq_ref, us_ref, tile, saturating)


@functools.partial(jax.jit, static_argnames=("with_inputs", "cfg", "interpret"))
def swiglu_quantize(gate, up, *, with_inputs=False, cfg=None, interpret=False, out_init=None):
    """See movement_reference.swiglu_quantize: one read of gate and up, one write of the FP8
    rows and scales (and with_inputs, of gate's and up's own)."""
    cfg = _quantizing(_narrowed(cfg or SWIGLU_CONFIG, gate.shape[1]), "swiglu_quantize")
    rows, cols = gate.shape
    quantized = (_out_shape((rows, cols), FP8, gate, up),
                 _out_shape((rows, cdiv(cols, TILE)), jnp.float32, gate, up))
    outs = quantized * (3 if with_inputs else 1)
    kernel = functools.partial(_swiglu_quantize_kernel, rows=rows, cols=cols, cfg=cfg,
                               saturating=not interpret)
    grid = (cdiv(rows, cfg.block_rows), cdiv(cols, cfg.block_cols))
    return tuple(_call("swiglu_quantize", kernel, [gate, up], outs, grid, cfg, interpret,
                       out_init))

"""Mosaic GPU (Hopper TMA) streamed quantizations of 16-bit token rows x (T, H):
``quantize_along_tokens`` (quantize_1x128(x.T), wgrad's operand) and, for a dense FP8
linear's output gradient, ``quantize_both_ways`` (quantize_1x128(x) for dgrad and
quantize_1x128(x.T) for wgrad, from one read).

Why these kernels exist: the Triton kernels' programs all load their tile at once and then
compute together, so their transposes, scales and stores cannot hide under the reads: at
T = 4096, H = 2048 quantize_along_tokens stayed at 67% of copy bandwidth whatever the tiling
(ncu, session 19 in docs/performance.md), and quantize_both_ways at 65-75% (sessions 46,
56). Here each CTA owns `block_cols` columns of x and `steps` consecutive 128-token tiles,
and streams them through a ring of `depth` shared-memory slots with TMA: one tile is
quantized while the next ones load, and the FP8 tiles leave by TMA stores.

A step reads its (128 tokens, block_cols) 16-bit tile transposed into registers (the
WGMMA_TRANSPOSED layout, then a register shuffle to the WGMMA layout), takes each
column's amax over its 128 tokens from the FP32 bits (a NaN sorts above inf, so it
propagates as in jnp.max), divides, and casts to FP8: the GPU's saturating cast gives the
reference's clamp. The both-ways kernel also reads the tile as it lies (128 columns: one
1x128 tile a row) and quantizes each row the same way. Each CTA's scales leave in one TMA
store at its end, which is why `steps` is a multiple of 4 (a TMA row is at least 16 bytes).

Needs jax >= 0.11 with a Hopper GPU (`mosaic_common.available()`); `applies` and
`both_ways_applies` say which inputs each takes (the plain token layout, 16-bit x, whole CTA
tiles), the Triton kernels run the rest.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_common import jax_version, named, sm_count
from pallas_kernels.quantize import FP8, TILE, amax_from_bits, scale_from_amax
from pallas_kernels.varying import mark_varying, varying_union

SWIZZLE = 128  # bytes: one BF16 tile row of 64 columns, one FP8 row of 128 tokens
SCALE_STEPS = 4  # 128-token tiles per 16-byte row of FP32 scales (the TMA minimum)


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """block_cols: columns of x per CTA (64: one 128-byte swizzle row of 16-bit values;
    128: two). steps: 128-token tiles per CTA, a multiple of `SCALE_STEPS`. depth: ring
    slots (loads in flight per CTA). On an H100 the default was the fastest config tried at
    T = 4096 and within 2.5% of the fastest at the larger shapes (docs/performance.md,
    session 24)."""

    block_cols: int = 64
    steps: int = 8
    depth: int = 3

    def __post_init__(self):
        if self.block_cols not in (64, 128):
            raise ValueError(f"StreamConfig.block_cols={self.block_cols}: must be 64 or 128")
        if self.steps < SCALE_STEPS or self.steps % SCALE_STEPS:
            raise ValueError(f"StreamConfig.steps={self.steps}: must be a positive multiple "
                             f"of {SCALE_STEPS} (each CTA's scale row is one TMA store)")
        if not 2 <= self.depth <= self.steps:
            raise ValueError(f"StreamConfig.depth={self.depth}: must be in [2, steps="
                             f"{self.steps}]")

    def for_tokens(self, tokens: int) -> StreamConfig | None:
        """This config with the most steps up to `steps` that tile `tokens` exactly (a
        multiple of SCALE_STEPS), or None where no such step count exists."""
        tiles, rest = divmod(tokens, TILE)
        if rest:
            return None
        fitting = [s for s in range(self.steps, 0, -SCALE_STEPS) if tiles % s == 0]
        if not fitting:
            return None
        return dataclasses.replace(self, steps=fitting[0], depth=min(self.depth, fitting[0]))


DEFAULT_CONFIG = StreamConfig()
# A row's 1x128 scale spans the CTA's columns. On an H100, 8 steps and 3 slots were the
# fastest config or within 5% of it at 65536 x 1024-4096 and 16384 x 2048
# (docs/performance.md, session 56).
BOTH_WAYS_CONFIG = StreamConfig(block_cols=TILE)


def applies(shape: tuple[int, ...], dtype, cfg: StreamConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel takes x of this shape and dtype: 16-bit (the register transpose
    is a 16-bit shuffle), T a multiple of 512 tokens, H of `block_cols`."""
    return (len(shape) == 2 and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                                     jnp.dtype(jnp.float16))
            and cfg.for_tokens(shape[0]) is not None and shape[1] % cfg.block_cols == 0)


def both_ways_applies(shape: tuple[int, ...], dtype, cfg: StreamConfig = BOTH_WAYS_CONFIG
                      ) -> bool:
    """Whether the both-ways kernel takes x of this shape and dtype, and fills the GPU: as
    `applies` with 128 columns a CTA, and at least one CTA per SM. With fewer it loses to
    the Triton kernel (T = 4096, H = 256: 8 CTAs, 23.7 against 5.3 us on an H100; session
    56); between 8 and 256 CTAs it was not measured."""
    if not (cfg.block_cols == TILE and applies(shape, dtype, cfg)):
        return False
    tiled = cfg.for_tokens(shape[0])
    return shape[0] // (TILE * tiled.steps) * (shape[1] // TILE) >= sm_count()


def _swizzled(block: tuple[int, int], index, itemsize: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.BlockSpec(block, index, transforms=(
        plgpu.TilingTransform((8, SWIZZLE // itemsize)), plgpu.SwizzleTransform(SWIZZLE)))


def _load(ref, layout):
    """plgpu.load without an index: jax 0.11 deprecates passing one, 0.10 requires it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.load(ref, layout=layout) if jax_version() >= (0, 11) else \
        plgpu.load(ref, (), layout=layout)


def _per_row(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """FP8 values and FP32 scales of registers v (rows, 128), one scale a row."""
    v = v.astype(jnp.float32)
    scale = scale_from_amax(amax_from_bits(v, 1))
    return (v / lax.broadcast_in_dim(scale, v.shape, [0])).astype(FP8), scale


def _quantize_columns(x_smem) -> tuple[jax.Array, jax.Array]:
    """(block_cols, 128) FP8 values and (block_cols,) FP32 scales of a (128 tokens,
    block_cols) tile, one scale per column: bit-identical to quantize_1x128 of its
    transpose."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    xt = _load(x_smem.T, plgpu.Layout.WGMMA_TRANSPOSED)
    return _per_row(plgpu.layout_cast(xt, plgpu.Layout.WGMMA))


def _quantize_rows(x_smem) -> tuple[jax.Array, jax.Array]:
    """(128, 128) FP8 values and (128,) FP32 scales of a (128 tokens, 128 columns) tile, one
    scale per row: bit-identical to quantize_1x128 of it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return _per_row(_load(x_smem, plgpu.Layout.WGMMA))


def _kernel(x_gmem, q_gmem, s_gmem, *, cfg: StreamConfig):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t = lax.axis_index("tokens")
    cols = pl.ds(lax.axis_index("cols") * cfg.block_cols, cfg.block_cols)
    tokens = pl.ds(t * cfg.steps * TILE, cfg.steps * TILE)

    def scoped(s_smem):
        def step(idx, x_smem, q_smem):
            q, scale = _quantize_columns(x_smem)
            q_smem[...] = q
            s_smem[:, idx[0]] = scale

        plgpu.emit_pipeline(
            step, grid=(cfg.steps,),
            in_specs=[_swizzled((TILE, cfg.block_cols), lambda s: (s, 0), 2)],
            out_specs=[_swizzled((cfg.block_cols, TILE), lambda s: (0, s), 1)],
            max_concurrent_steps=cfg.depth,
        )(x_gmem.at[tokens, cols], q_gmem.at[cols, tokens])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[cols, pl.ds(t * cfg.steps, cfg.steps)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scoped, plgpu.SMEM((cfg.block_cols, cfg.steps), jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg",))
def quantize_along_tokens(x: jax.Array, *, cfg: StreamConfig | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """quantize_1x128(x.T) of x (T, H): (H, T) FP8 and (H, T/128) FP32 scales. x must
    satisfy `applies`."""
    cfg = cfg or DEFAULT_CONFIG
    if not applies(x.shape, x.dtype, cfg):
        raise ValueError(f"mosaic quantize_along_tokens takes 16-bit x (T, H) with T a "
                         f"multiple of {SCALE_STEPS * TILE} and H of {cfg.block_cols}; got "
                         f"{x.shape} {x.dtype}")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = cfg.for_tokens(x.shape[0])
    tokens, cols = x.shape
    # Token groups vary fastest: on an H100 that ran 1-3% faster than columns fastest
    # on 3 of 4 shapes (docs/performance.md, session 24).
    call = plgpu.kernel(
        named(functools.partial(_kernel, cfg=cfg), "transpose_quantize"),
        out_type=(jax.ShapeDtypeStruct((cols, tokens), FP8),
                  jax.ShapeDtypeStruct((cols, tokens // TILE), jnp.float32)),
        grid=(tokens // (TILE * cfg.steps), cols // cfg.block_cols),
        grid_names=("tokens", "cols"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    return mark_varying(call(x), varying_union((x,)))  # as `mosaic_common.persistent_call`


def _both_ways_kernel(x_gmem, q_gmem, s_gmem, qt_gmem, st_gmem, *, cfg: StreamConfig):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t, c = lax.axis_index("tokens"), lax.axis_index("cols")
    cols = pl.ds(c * TILE, TILE)
    tokens = pl.ds(t * cfg.steps * TILE, cfg.steps * TILE)

    def scoped(row_scales_smem, column_scales_smem):
        def step(idx, x_smem, q_smem, qt_smem):
            q_smem[...], row_scales_smem[idx[0]] = _quantize_rows(x_smem)
            qt, column_scale = _quantize_columns(x_smem)
            qt_smem[...] = qt
            column_scales_smem[:, idx[0]] = column_scale

        plgpu.emit_pipeline(
            step, grid=(cfg.steps,),
            in_specs=[_swizzled((TILE, TILE), lambda s: (s, 0), 2)],
            out_specs=[_swizzled((TILE, TILE), lambda s: (s, 0), 1),
                       _swizzled((TILE, TILE), lambda s: (0, s), 1)],
            max_concurrent_steps=cfg.depth,
        )(x_gmem.at[tokens, cols], q_gmem.at[tokens, cols], qt_gmem.at[cols, tokens])
        plgpu.commit_smem()
        steps = pl.ds(t * cfg.steps, cfg.steps)
        plgpu.copy_smem_to_gmem(row_scales_smem, s_gmem.at[c, steps])
        plgpu.copy_smem_to_gmem(column_scales_smem, st_gmem.at[cols, steps])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scoped, plgpu.SMEM((cfg.steps, TILE), jnp.float32),
                  plgpu.SMEM((TILE, cfg.steps), jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg",))
def quantize_both_ways(x: jax.Array, *, cfg: StreamConfig | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """quantize_1x128(x) and quantize_1x128(x.T) of x (T, H) from one read: (T, H) FP8,
    (T, H/128) scales, (H, T) FP8, (H, T/128) scales. x must satisfy `both_ways_applies`
    (but for the CTA count, which only decides the speed)."""
    cfg = cfg or BOTH_WAYS_CONFIG
    if cfg.block_cols != TILE or not applies(x.shape, x.dtype, cfg):
        raise ValueError(f"mosaic quantize_both_ways takes 16-bit x (T, H) with T a multiple "
                         f"of {SCALE_STEPS * TILE} and H of {TILE}, with block_cols={TILE}; got "
                         f"{x.shape} {x.dtype}, block_cols={cfg.block_cols}")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = cfg.for_tokens(x.shape[0])
    tokens, cols = x.shape
    token_tiles, col_tiles = tokens // TILE, cols // TILE
    call = plgpu.kernel(
        named(functools.partial(_both_ways_kernel, cfg=cfg), "quantize_both_ways_streamed"),
        # the row scales as (H/128, T/128, 128): a CTA's leave as one (steps, 128) TMA box
        out_type=(jax.ShapeDtypeStruct((tokens, cols), FP8),
                  jax.ShapeDtypeStruct((col_tiles, token_tiles, TILE), jnp.float32),
                  jax.ShapeDtypeStruct((cols, tokens), FP8),
                  jax.ShapeDtypeStruct((cols, token_tiles), jnp.float32)),
        grid=(token_tiles // cfg.steps, col_tiles), grid_names=("tokens", "cols"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    q, row_scales, qt, column_scales = mark_varying(call(x), varying_union((x,)))
    return q, row_scales.reshape(col_tiles, tokens).T, qt, column_scales

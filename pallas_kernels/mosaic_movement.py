"""Mosaic GPU (Hopper TMA) quantize_along_tokens: x (T, H) -> quantize_1x128(x.T), streamed.

Why this kernel exists: the Triton kernel's programs all load their tile at once and then
compute together, so its transposes, scales and stores cannot hide under the reads: at
T = 4096, H = 2048 it stayed at 67% of copy bandwidth whatever the tiling (ncu, session
19 in docs/performance.md). Here each CTA owns `block_cols` columns of x and `steps`
consecutive 128-token tiles, and streams them through a ring of `depth` shared-memory
slots with TMA: one tile is transposed and quantized while the next ones load, and the
FP8 tiles leave by TMA stores.

A step reads its (128 tokens, 64 columns) 16-bit tile transposed into registers (the
WGMMA_TRANSPOSED layout, then a register shuffle to the WGMMA layout), takes each
column's amax over its 128 tokens from the FP32 bits (a NaN sorts above inf, so it
propagates as in jnp.max), divides, and casts to FP8: the GPU's saturating cast gives the
reference's clamp. Each CTA's (64, steps) scales leave in one TMA store at its end, which
is why `steps` is a multiple of 4 (a TMA row is at least 16 bytes).

Needs jax >= 0.11 with a Hopper GPU (`mosaic_common.available()`); `applies` says which
inputs it takes (the plain token layout, 16-bit x, whole CTA tiles), the Triton kernel
runs the rest.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_common import jax_version, named
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


def applies(shape: tuple[int, ...], dtype, cfg: StreamConfig = DEFAULT_CONFIG) -> bool:
    """Whether the kernel takes x of this shape and dtype: 16-bit (the register transpose
    is a 16-bit shuffle), T a multiple of 512 tokens, H of `block_cols`."""
    return (len(shape) == 2 and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16),
                                                     jnp.dtype(jnp.float16))
            and cfg.for_tokens(shape[0]) is not None and shape[1] % cfg.block_cols == 0)


def _swizzled(block: tuple[int, int], index, itemsize: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.BlockSpec(block, index, transforms=(
        plgpu.TilingTransform((8, SWIZZLE // itemsize)), plgpu.SwizzleTransform(SWIZZLE)))


def _load(ref, layout):
    """plgpu.load without an index: jax 0.11 deprecates passing one, 0.10 requires it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.load(ref, layout=layout) if jax_version() >= (0, 11) else \
        plgpu.load(ref, (), layout=layout)


def _quantize_columns(x_smem) -> tuple[jax.Array, jax.Array]:
    """(block_cols, 128) FP8 values and (block_cols,) FP32 scales of a (128 tokens,
    block_cols) tile, one scale per column: bit-identical to quantize_1x128 of its
    transpose."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    xt = _load(x_smem.T, plgpu.Layout.WGMMA_TRANSPOSED)
    v = plgpu.layout_cast(xt, plgpu.Layout.WGMMA).astype(jnp.float32)
    scale = scale_from_amax(amax_from_bits(v, 1))
    return (v / lax.broadcast_in_dim(scale, v.shape, [0])).astype(FP8), scale


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

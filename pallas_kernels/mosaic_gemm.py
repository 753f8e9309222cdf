"""Mosaic GPU (Hopper WGMMA) block-scaled FP8 grouped GEMM; dense is the one-group case.

Why this kernel exists: Triton promotes every 128-deep FP8 product into the FP32
accumulator inside the one instruction stream that also feeds the tensor cores, so
the promotion and the next WGMMA serialize (docs/performance.md: 160-300 TFLOP/s).
Here, as in DeepSeek-V3's recipe (section 3.3.2) and DeepGEMM's design, each CTA runs
two consumer warpgroups and one TMA producer warpgroup (warp specialization):

- the producer streams (row tile of a, 128 of K), (column tile of b, 128 of K) and the
  two scale vectors for that K step through a ring of shared-memory slots;
- each consumer issues a 64 x 128 x 128 FP8 WGMMA into a fresh FP32 accumulator,
  then scales it by a_scale[row] * b_scale[block] and adds it to a running FP32 sum
  held in registers. While one consumer promotes, the other one's WGMMA keeps the
  tensor cores busy.

Layouts follow DeepGEMM: a (M, K) and b (G, N, K), both K-major, which FP8 WGMMA
requires. Scales are fed as a_scale^T (K/128, M) so one TMA copy brings a tile's row
scales, and b's 128x128 block scales repeated 64 times per block so a consumer loads
them straight into the accumulator's row layout (a few MB at most).

Rows are grouped by expert; a row tile that straddles groups is visited once per
group it touches and each visit stores only its group's rows (TMA stores of 2^i rows).
Rows past sum(group_sizes) are written as zeros without running the pipeline. The
persistent grid walks (row tile, column tile) pairs with `nd_loop` across the SMs.

Needs jax >= 0.11 with a Hopper GPU; `mosaic_common.available()` says whether it can run here.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_common import (CTA_M, WG_ROWS, chained_state, persistent_call,
                                           store_rows, tile_visit, visit_ends)
from pallas_kernels.quantize import TILE, cdiv
from pallas_kernels.triton_gemm import _out_shape, _pad_axis

TILE_N = TILE  # columns per CTA: one 128x128 weight block scale per K step
FP8_SWIZZLE = 128  # bytes: one 128-wide FP8 K step is one 128-byte swizzle row


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """stages: shared-memory ring depth. grid_tile_width: width of the snake over output
    tiles (L2 reuse). chain: the producer runs on into the next tile's K steps while the
    consumers store this one (only when the ring depth divides the K steps); None picks
    it for short K loops (<= 32 steps), where it measured faster on the H100, and not for
    long ones, where it measured ~5% slower.

    The CTA tile is fixed at 128 x 128: each consumer's 64 x 128 tile needs one b block
    scale per K step, and its fresh plus running FP32 accumulators already take 128
    registers a thread. Splitting N between the consumers instead (CTA 64 x 256) and
    sharing a tiles across a 2-CTA cluster by TMA multicast both measured no faster."""

    stages: int = 4
    grid_tile_width: int = 8
    chain: bool | None = None


DEFAULT_CONFIG = MosaicConfig()


def _load_row_vector(ref) -> jax.Array:
    """A (64,) vector in the layout of the WGMMA accumulator's rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA.reduce(1))


def _kernel(ends_gmem, a_gmem, a_scale_gmem, b_gmem, b_scale_gmem, out_gmem, *,
            groups: int, cfg: MosaicConfig):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = a_gmem.shape
    n = b_gmem.shape[1]
    k_steps = k // TILE
    tiles_m = cdiv(m, CTA_M) + groups
    tiles_n = n // TILE_N
    fp8_transforms = (plgpu.TilingTransform((8, FP8_SWIZZLE)),
                      plgpu.SwizzleTransform(FP8_SWIZZLE))

    chain = k_steps <= 32 if cfg.chain is None else cfg.chain
    chained = chain and k_steps % cfg.stages == 0

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((CTA_M, TILE), lambda s: (0, s),
                                transforms=fp8_transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((1, CTA_M), lambda s: (s, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((TILE_N, TILE), lambda s: (0, s),
                                transforms=fp8_transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((1, WG_ROWS), lambda s: (s, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
            pipeline_state=state,
        )

    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore).get_allocations(
        a_gmem, a_scale_gmem, b_gmem.at[0], b_scale_gmem.at[0])

    @functools.partial(
        pl.run_scoped,
        allocs=allocs,
        out_smem=plgpu.SMEM((2, WG_ROWS, TILE_N), out_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((tiles_m * tiles_n,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            ni, group, row0, wg_row0, first, count = tile_visit(
                info, tiles_m, tiles_n, cfg.grid_tile_width, wg, ends_gmem, groups)
            out_cols = out_gmem.at[:, pl.ds(ni * TILE_N, TILE_N)]
            wg_rows = pl.ds(wg * WG_ROWS, WG_ROWS)

            def store(values):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[wg] = values.astype(out_smem.dtype)
                plgpu.commit_smem()
                store_rows(out_smem.at[wg], out_cols, wg_row0, first, count)

            def compute_context(run):
                zeros = plgpu.layout_cast(jnp.zeros((WG_ROWS, TILE_N), jnp.float32),
                                          plgpu.Layout.WGMMA)
                store(run(zeros))

            def step(_, a_smem, a_scale_smem, b_smem, b_scale_smem, total):
                def product(acc):
                    plgpu.wgmma(acc, a_smem.at[wg_rows],
                                plgpu.transpose_ref(b_smem, (1, 0)))
                    sa = _load_row_vector(a_scale_smem.at[0, wg_rows])
                    sb = _load_row_vector(b_scale_smem.at[0])
                    return acc[...], sa * sb

                part, scale = pl.run_scoped(product,
                                            plgpu.ACC((WG_ROWS, TILE_N), jnp.float32))
                return total + part * lax.broadcast_in_dim(scale, part.shape, [0])

            runs = group < groups
            state = chained_state(chained, carry)

            @pl.when(runs)
            def _real():
                b_group = b_gmem.at[group]
                pipeline(step, compute_context, state)(
                    a_gmem.at[pl.ds(row0, CTA_M)],
                    a_scale_gmem.at[:, pl.ds(row0, CTA_M)],
                    b_group.at[pl.ds(ni * TILE_N, TILE_N)],
                    b_scale_gmem.at[group, :, pl.ds(ni * WG_ROWS, WG_ROWS)],
                    allocations=allocs,
                )

            @pl.when((group == groups) & (wg < 2))
            def _zeros():
                store(plgpu.layout_cast(jnp.zeros((WG_ROWS, TILE_N), jnp.float32),
                                        plgpu.Layout.WGMMA))

            return carry | runs.astype(jnp.int32)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def scaled_grouped_matmul(a, b, group_sizes, *, a_scale, b_scale, out_dtype=jnp.bfloat16,
                          cfg: MosaicConfig | None = None) -> jax.Array:
    """dequant(a) rows of group g @ dequant(b[g])^T; a (M, K) FP8 with 1x128 scales
    (M, K/128), b (G, N, K) FP8 with 128x128 scales (G, N/128, K/128).

    Shapes off the tile grid are zero-padded here (a copy; rare in training shapes).
    """
    cfg = cfg or DEFAULT_CONFIG
    (m, k), (groups, n, _) = a.shape, b.shape
    a = _pad_axis(_pad_axis(a, 1, TILE), 0, CTA_M)
    a_scale = _pad_axis(a_scale, 0, CTA_M)
    b = _pad_axis(_pad_axis(b, 2, TILE), 1, TILE_N)
    mp, np_ = a.shape[0], b.shape[1]
    # End row of each group, then of the zero rows past the last group.
    ends = visit_ends(group_sizes, m)
    # (G, K/128, N/128 * 64): each block scale repeated for the 64 rows of a warpgroup.
    b_scale_rows = jnp.repeat(jnp.swapaxes(b_scale, 1, 2), WG_ROWS, axis=2)
    out = persistent_call(functools.partial(_kernel, groups=groups, cfg=cfg),
                          _out_shape((mp, np_), out_dtype, a, b),
                          ends, a, a_scale.T, b, b_scale_rows, name="fp8_grouped_gemm")
    return out[:m, :n] if (mp, np_) != (m, n) else out

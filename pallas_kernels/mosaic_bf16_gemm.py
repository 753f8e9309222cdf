"""Mosaic GPU (Hopper WGMMA) BF16 grouped GEMMs: the three GEMMs of `grouped_gemm`.

Why: the Triton lowering of the same tiles reaches 0.42-0.69x `torch._grouped_mm`
(docs/performance.md), because one instruction stream both loads and multiplies.
Here, as in the FP8 kernel (`mosaic_gemm`), a TMA producer warpgroup streams the
operands through a shared-memory ring while two consumer warpgroups each own 64 rows
of a 128 x tile_n output tile. BF16 needs no promotion, so the FP32 accumulator stays in
the tensor core's registers for the whole K loop, and a consumer keeps one WGMMA in
flight (the ring slot of step s is released once the WGMMA of step s + 1 is issued),
except in chained pipelines (`Bf16Config.chain`), which cannot delay a release.
A last column tile past N is zero-filled by the TMA loads and clipped by its stores.

- `grouped_matmul`: rows grouped, contraction over K: fprop (b (G, K, N), read N-major)
  and dgrad (b (G, N, K), read K-major and transposed in shared memory). Row tiles
  straddling groups are visited once per group, as in `mosaic_common`.
- `grouped_matmul_tn`: wgrad, contraction over each group's rows. The pipeline's trip
  count is the group's number of 64-row blocks rounded up to whole turns of the ring (a
  dynamic grid), whose padding steps skip their WGMMA; rows of other groups in the edge
  blocks are zeroed in shared memory before the WGMMA.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.group_schedule import group_bounds
from pallas_kernels.mosaic_common import (CTA_M, WG_ROWS, column_tile_widths,
                                           for_each_row_visit, persistent_call,
                                           stage_chunk, store_rows,
                                           tma_ready, visit_table, wgrad_tile)
from pallas_kernels.quantize import TILE, cdiv
from pallas_kernels.triton_gemm import _out_shape, _pad_axis

SWIZZLE = 128  # bytes: one 64-wide BF16 K step is one 128-byte swizzle row
STEP = SWIZZLE // 2  # contraction step in elements (rows for the wgrad)


@dataclasses.dataclass(frozen=True)
class Bf16Config:
    """tile_n: output columns per CTA (None: 256 for 2-byte outputs, else 128); each
    consumer holds a 64 x tile_n FP32 accumulator. stages: ring depth (None: 4 at
    tile_n = 256, where one stage is 48 KB; 5 at 128). epilogue_n: columns a consumer
    stages in shared memory per TMA store, in a ring of epilogue_slots slots (with two,
    one chunk is cast while the other is stored): 64 or 128 (a whole 256-wide tile in
    one slot failed the fprop's narrow edge tile). None: 64 in two slots for an fprop
    with 2-byte outputs, else 128 in one (the default rings fit beside either). On the
    H100 (session 50) two slots moved the fprop by -0.3% to +3.7% (64 routed groups,
    K 1024: +3.4%) and the dgrad by -2.5% to +2.7%, so only the fprop takes them; a
    3-deep ring (room for two 128-wide slots) lost 3-8% on 64 routed groups and on
    K 1024, and gained 2% only on one group of K 704. chain
    (fprop and dgrad): the producer runs on into the next tile's K steps while the
    consumers store this one, when the ring depth divides the K steps. grid_tile_width:
    width of the snake over output tiles (L2 reuse). Defaults: the best, or within noise
    (~5%) of it, in a sweep on the H100 bench shapes (docs/performance.md, 2026-11-23)."""

    tile_n: int | None = None
    stages: int | None = None
    epilogue_n: int | None = None
    epilogue_slots: int | None = None
    grid_tile_width: int = 8
    chain: bool = True

    def __post_init__(self):
        if self.epilogue_n not in (None, STEP, 2 * STEP):
            raise ValueError(f"Bf16Config.epilogue_n={self.epilogue_n}: must be None, "
                             f"{STEP} or {2 * STEP}")
        if self.epilogue_slots not in (None, 1, 2):
            raise ValueError(f"Bf16Config.epilogue_slots={self.epilogue_slots}: must be "
                             "None, 1 or 2")


DEFAULT_CONFIG = Bf16Config()


def _tile_n(cfg: Bf16Config, out_dtype) -> int:
    if cfg.tile_n is not None:
        return cfg.tile_n
    return 256 if jnp.dtype(out_dtype).itemsize == 2 else TILE


def _stages(cfg: Bf16Config, tile_n: int) -> int:
    return cfg.stages or (4 if tile_n == 256 else 5)


# Shared memory left beside the default rings and epilogue slots (224 KB of the H100's
# 227) for the row walk's table (`mosaic_common.visit_table`): up to 254 groups.
TABLE_SPARE_BYTES = 2048


def _epilogue_smem(cfg: Bf16Config, tile_n: int, out_dtype, fprop: bool):
    """Each consumer's ring of epilogue slots, (2, slots, 64, columns), per `Bf16Config`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    two_slots = fprop and jnp.dtype(out_dtype).itemsize == 2
    width = min(cfg.epilogue_n or (STEP if two_slots else 2 * STEP), tile_n)
    slots = cfg.epilogue_slots or (2 if two_slots else 1)
    return plgpu.SMEM((2, slots, WG_ROWS, width), out_dtype)


def _store_chunks(values, out_smem, wg, store_chunk) -> None:
    """Casts a consumer's (64, tile_n) FP32 tile and stores it in epilogue-wide chunks
    through its ring of shared-memory slots: store_chunk(slot, first column) issues the
    TMA."""
    width = out_smem.shape[-1]
    for chunk, col in enumerate(range(0, values.shape[1], width)):
        store_chunk(stage_chunk(out_smem, wg, chunk, values[:, col:col + width]), col)


def _accumulating(width: int, store):
    """A pipeline's compute context: each consumer's (64, width) FP32 accumulator held in
    the tensor core's registers through the K loop, then ``store(values)``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def context(run):
        @functools.partial(pl.run_scoped, acc=plgpu.ACC((WG_ROWS, width), jnp.float32))
        def _acc(acc):
            run(acc)
            store(acc[...])
    return context


def _transforms():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, STEP)), plgpu.SwizzleTransform(SWIZZLE))


def _rows_kernel(table_gmem, a_gmem, b_gmem, out_gmem, *, groups: int, b_kn: bool,
                 tile_n: int, cfg: Bf16Config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = a_gmem.shape
    n = out_gmem.shape[1]
    tiles_m = cdiv(m, CTA_M) + groups
    tiles_n = cdiv(n, tile_n)  # a last partial tile: TMA zero-fills loads, clips stores
    # fprop: the last column tile multiplies only its edge_n real columns (N is a
    # multiple of 64): 704 = 2 x 256 + 192. Column tiles then turn over the SMs where
    # needed (`tile_visit`), or the CTAs that always drew it would idle at the end.
    # H100, K 1024 -> N 704 (session 49): one group 642 -> 677 TFLOP/s, 64 routed
    # groups 519 -> 515; in the dgrad (b transposed in shared memory) 611 -> 604 and
    # 516 -> 493, so the dgrad multiplies its edge tile in full.
    edge_n = n - (tiles_n - 1) * tile_n if b_kn else tile_n
    b_block, b_index = (((STEP, tile_n), lambda s: (s, 0)) if b_kn
                        else ((tile_n, STEP), lambda s: (0, s)))

    k_steps, stages = k // STEP, _stages(cfg, tile_n)
    table_bytes = math.prod(table_gmem.shape) * jnp.dtype(table_gmem.dtype).itemsize
    if table_bytes > TABLE_SPARE_BYTES and stages > 1:
        stages -= 1  # the walk's table of over 254 groups does not fit beside a full ring
    chained = cfg.chain and k_steps % stages == 0
    # Chained pipelines cannot delay a slot's release, so each WGMMA is awaited in its
    # own step there; the other consumer's WGMMA keeps the tensor cores busy meanwhile.
    in_flight = 0 if chained else 1

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((CTA_M, STEP), lambda s: (0, s), transforms=_transforms(),
                                memory_space=plgpu.SMEM, delay_release=in_flight),
                plgpu.BlockSpec(b_block, b_index, transforms=_transforms(),
                                memory_space=plgpu.SMEM, delay_release=in_flight),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
            pipeline_state=state,
        )

    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem.at[0])

    @functools.partial(
        pl.run_scoped,
        allocs=allocs,
        out_smem=_epilogue_smem(cfg, tile_n, out_gmem.dtype, fprop=b_kn),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @for_each_row_visit(table_gmem, wg, tiles_m=tiles_m, tiles_n=tiles_n,
                            grid_tile_width=cfg.grid_tile_width, groups=groups,
                            narrow_last=edge_n < tile_n,
                            drain=(allocs, stages) if chained else None)
        def _visit(state, ni, group, row0, wg_row0, first, count):
            def store(values):
                width = out_smem.shape[-1]
                _store_chunks(values, out_smem, wg, lambda slot, col: store_rows(
                    slot, out_gmem.at[:, pl.ds(ni * tile_n + col, width)], wg_row0, first,
                    count))

            def step(width):
                def multiply(_, a_smem, b_smem, acc):
                    if width < tile_n:  # fprop only: b_smem is (K step, tile_n)
                        b_smem = b_smem.at[:, :width]
                    b = b_smem if b_kn else plgpu.transpose_ref(b_smem, (1, 0))
                    plgpu.wgmma(acc, a_smem.at[pl.ds(wg * WG_ROWS, WG_ROWS)], b)
                    plgpu.wgmma_wait(in_flight)
                    return acc
                return multiply

            runs = group < groups
            for width, here in column_tile_widths(ni, tiles_n, tile_n, edge_n):
                @pl.when(runs & here)
                def _real(width=width):
                    b_group = b_gmem.at[group]
                    b_cols = (b_group.at[:, pl.ds(ni * tile_n, tile_n)] if b_kn
                              else b_group.at[pl.ds(ni * tile_n, tile_n)])
                    pipeline(step(width), _accumulating(width, store), state)(
                        a_gmem.at[pl.ds(row0, CTA_M)], b_cols, allocations=allocs)

            @pl.when((group == groups) & (wg < 2))
            def _zeros():
                store(jnp.zeros((WG_ROWS, tile_n), jnp.float32))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _tn_kernel(starts_gmem, ends_gmem, x_gmem, y_gmem, out_gmem, *, tile_q: int, cfg: Bf16Config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    groups, p, q = out_gmem.shape
    stages = _stages(cfg, tile_q)
    tiles_p, tiles_q = cdiv(p, CTA_M), cdiv(q, tile_q)  # partial last tiles as in _rows_kernel

    def pipeline(body, compute_context, steps, first_block, blocks):
        # Steps past the group's blocks (ring padding) reload its last block: in bounds.
        block = lambda s: first_block + jnp.minimum(s, blocks - 1)
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((STEP, CTA_M), lambda s: (block(s), 0),
                                transforms=_transforms(), memory_space=plgpu.SMEM,
                                delay_release=1),
                plgpu.BlockSpec((STEP, tile_q), lambda s: (block(s), 0),
                                transforms=_transforms(), memory_space=plgpu.SMEM,
                                delay_release=1),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore, stages, 0, stages).get_allocations(x_gmem, y_gmem)

    @functools.partial(
        pl.run_scoped,
        allocs=allocs,
        out_smem=_epilogue_smem(cfg, tile_q, out_gmem.dtype, fprop=False),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((groups * tiles_p * tiles_q,), collective_axes="sm")
        def _tiles(info):
            g, pi, qi = wgrad_tile(info, tiles_p, tiles_q, cfg.grid_tile_width)
            start, end = starts_gmem[g], ends_gmem[g]
            first_block = lax.div(start, jnp.int32(STEP))
            blocks = jnp.where(end > start, lax.div(end - 1, jnp.int32(STEP)) - first_block + 1, 0)
            # Rounded up to whole turns of the ring: pipelines of other lengths in a row
            # desynchronized the ring's barrier phases (launch failures on the H100).
            # The extra steps reload the group's last block and skip mask and WGMMA
            # (to session 48 they masked and multiplied it: 64 routed groups 6% slower).
            steps = lax.div(blocks + (stages - 1), jnp.int32(stages)) * stages
            out_rows = out_gmem.at[g, pl.ds(pi * CTA_M + wg * WG_ROWS, WG_ROWS)]

            def store(values):
                width = out_smem.shape[-1]
                _store_chunks(values, out_smem, wg, lambda slot, col: plgpu.copy_smem_to_gmem(
                    slot, out_rows.at[:, pl.ds(qi * tile_q + col, width)]))

            def step(idx, x_smem, y_smem, acc):
                (s,) = idx
                row0 = (first_block + s) * STEP
                x_half = x_smem.at[:, pl.ds(wg * WG_ROWS, WG_ROWS)]  # (rows, this WG's P)

                live = s < blocks

                @pl.when(live & ((row0 < start) | (row0 + STEP > end)))
                def _mask_other_groups():
                    # Both operands, so an inf/NaN in another group's rows cannot leak
                    # in. Each consumer masks all of y (the tile both read): the two
                    # write identical values, so neither needs to wait for the other.
                    for ref in (x_half, y_smem):
                        rows = row0 + lax.broadcasted_iota(jnp.int32, ref.shape, 0)
                        keep = (rows >= start) & (rows < end)
                        values = ref[...]
                        ref[...] = jnp.where(keep, values, jnp.zeros_like(values))
                    plgpu.commit_smem()

                @pl.when(live)
                def _multiply():
                    plgpu.wgmma(acc, plgpu.transpose_ref(x_half, (1, 0)), y_smem)
                    plgpu.wgmma_wait(1)

                @pl.when(~live)
                def _idle():  # delay_release frees the last slot: its WGMMA must be done
                    plgpu.wgmma_wait(0)
                return acc

            @pl.when(steps > 0)
            def _real():
                pipeline(step, _accumulating(tile_q, store), steps, first_block, blocks)(
                    x_gmem.at[:, pl.ds(pi * CTA_M, CTA_M)],
                    y_gmem.at[:, pl.ds(qi * tile_q, tile_q)],
                    allocations=allocs)

            @pl.when((steps == 0) & (wg < 2))
            def _empty_group():
                store(jnp.zeros((WG_ROWS, tile_q), jnp.float32))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("b_kn", "out_dtype", "cfg", "interpret"))
def grouped_matmul(a, b, group_sizes, *, b_kn: bool, out_dtype=jnp.bfloat16,
                   cfg: Bf16Config | None = None, interpret: bool = False) -> jax.Array:
    """Rows of group g of a (M, K) @ b[g]: b (G, K, N) when b_kn, else b (G, N, K) used
    transposed. Rows past sum(group_sizes) are zeros. M and K are zero-padded to the tile
    grid when needed; a partial last column tile needs no padding (N only to a multiple of
    64, `mosaic_common.tma_ready`). ``interpret``: on the CPU (``mosaic_common.persistent_call``;
    b_kn only)."""
    cfg = cfg or DEFAULT_CONFIG
    if a.dtype != b.dtype or a.dtype.itemsize != 2:
        raise ValueError(f"grouped_matmul (mosaic) wants equal 16-bit a and b; got "
                         f"{a.dtype} and {b.dtype}")
    (m, _), groups = a.shape, b.shape[0]
    n = b.shape[2] if b_kn else b.shape[1]
    tile_n = _tile_n(cfg, out_dtype)
    a = _pad_axis(_pad_axis(a, 1, STEP), 0, CTA_M)
    b = tma_ready(_pad_axis(b, 1, STEP), 2) if b_kn else tma_ready(_pad_axis(b, 2, STEP), 1)
    mp, np_ = a.shape[0], (b.shape[2] if b_kn else b.shape[1])
    table = visit_table(group_sizes, m)
    body = functools.partial(_rows_kernel, groups=groups, b_kn=b_kn, tile_n=tile_n, cfg=cfg)
    out = persistent_call(body, _out_shape((mp, np_), out_dtype, a, b), table, a, b,
                          name="bf16_grouped_gemm" if b_kn else "bf16_grouped_dgrad_gemm",
                          interpret=interpret)
    return out[:m, :n] if (mp, np_) != (m, n) else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "cfg"))
def grouped_matmul_tn(x, y, group_sizes, *, out_dtype=jnp.bfloat16,
                      cfg: Bf16Config | None = None) -> jax.Array:
    """(G, P, Q): x_g^T @ y_g over each group's rows of x (M, P) and y (M, Q); groups
    with no rows give zeros. Partial last tiles of P and Q need no padding (only to a
    multiple of 64, `mosaic_common.tma_ready`)."""
    cfg = cfg or DEFAULT_CONFIG
    if x.dtype != y.dtype or x.dtype.itemsize != 2:
        raise ValueError(f"grouped_matmul_tn (mosaic) wants equal 16-bit x and y; got "
                         f"{x.dtype} and {y.dtype}")
    (m, p), q, groups = x.shape, y.shape[1], group_sizes.shape[0]
    tile_q = _tile_n(cfg, out_dtype)
    x = tma_ready(_pad_axis(x, 0, STEP), 1)
    y = tma_ready(_pad_axis(y, 0, STEP), 1)
    starts, ends = group_bounds(group_sizes.astype(jnp.int32), m)
    body = functools.partial(_tn_kernel, tile_q=tile_q, cfg=cfg)
    out_type = _out_shape((groups, x.shape[1], y.shape[1]), out_dtype, x, y)
    out = persistent_call(body, out_type, starts, ends, x, y, name="bf16_grouped_wgrad_gemm")
    return out[:, :p, :q] if out.shape[1:] != (p, q) else out

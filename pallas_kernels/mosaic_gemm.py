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
  tensor cores busy. On a split tile (`MosaicConfig.split`) each consumer also takes its
  product as 64-column WGMMAs and promotes one while the next one runs.

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

from pallas_kernels import mosaic_common
from pallas_kernels.mosaic_common import (CTA_M, WG_ROWS, column_tile_widths,
                                           for_each_row_visit, jax_version, persistent_call,
                                           stage_chunk, store_rows,
                                           tma_ready, visit_table, wgrad_tile)
from pallas_kernels.quantize import TILE, cdiv
from pallas_kernels.triton_gemm import _out_shape, _pad_axis

TILE_N = TILE  # columns per WGMMA: one 128x128 weight block scale per K step
FP8_SWIZZLE = 128  # bytes: one 128-wide FP8 K step is one 128-byte swizzle row
# A K off the 128 grid (the small preset's 704-wide experts) takes 64-byte swizzle rows,
# two per K step: TMA then needs K only in multiples of 64 and zero-fills the last step's
# missing half, where a 128-byte row needed an XLA pad of every such operand to 768
# (6 ms of the small FP8 step in session 16's H100 trace).
FP8_HALF_SWIZZLE = FP8_SWIZZLE // 2


SPLIT_MIN_JAX = (0, 11)  # the first whose Mosaic GPU lowers jnp.concatenate (`_join_parts`)


def parts_join() -> bool:
    """Whether this jax lowers `_join_parts`, which a split tile's store needs."""
    return jax_version() >= SPLIT_MIN_JAX


def split_widths(groups: int, k: int) -> tuple[int, ...]:
    """The column tile widths that split (`MosaicConfig.split`) for `groups` groups of a
    K-deep product. No width with K off the 128 grid (64-byte swizzle rows: the split 128 tile
    ran 0.83x, H100, session 53); the wide tile always else; the 128-column tile for one
    group only: grouped, it ran 0.91-1.04x split (8 and 64 groups, H100, session 54)."""
    if k % TILE:
        return ()
    return (WIDE_TILE_N, TILE_N) if groups == 1 else (WIDE_TILE_N,)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """stages: shared-memory ring depth. grid_tile_width: width of the snake over output
    tiles (L2 reuse). chain: the producer runs on into the next tile's K steps while the
    consumers store this one (only when the ring depth divides the K steps: `for_steps`
    makes the ring shallower where that helps); None picks it for short K loops (<= 32
    steps), where it measured faster on the H100, and not for long ones, where it
    measured ~5% slower. The wgrad kernel does not chain (its groups' step counts vary).

    tile_n: columns per CTA. 128, or 256 read as two 128-column halves that each consumer
    multiplies and promotes in turn (one b block scale per half and K step): the a tile
    then feeds twice the FLOPs per shared-memory load, and the running FP32 sums take 128
    registers a thread plus 64 for the fresh half (32 for each of two 64-column parts
    when split). Only 3 ring stages fit beside it.
    None picks per shape (`for_tiles`). Splitting N between the consumers instead (CTA
    64 x 256) and sharing a tiles across a 2-CTA cluster by TMA multicast both measured
    no faster. The wgrad kernel reads a wide tile the same way, each half with its own
    column scales.

    split: each K step runs as 64-column WGMMAs, each into a fresh accumulator and issued
    before the previous one is promoted, so each consumer's promotion overlaps its own
    next product instead of relying on the other consumer's. Without promotion the wide
    tile ran 1535 TFLOP/s at 8192^3 against 1160 with it (H100, session 53), so promotion
    is where the time goes. The parts are joined in registers for the epilogue's store
    (`_join_parts`), which needs jax >= 0.11 (`parts_join`). On the H100 (session 54),
    against session 53's default (split 128-column tiles for one group only), the dense
    `bench_gemm` shapes with K on the 128 grid ran 1.02-1.06x where the wave rule picks
    the wide tile (13 of 15) and 1.00-1.02x on the other two; four grouped shapes ran
    1.01-1.08x the unsplit wide tile. With K off the 128 grid (64-byte swizzle rows) the
    split 128 tile ran 0.83x (session 53). None: split where `for_tiles` picks it. Row
    kernel only: the wgrad's 128-column tile ran 0.98-0.99x split (session 54)."""

    stages: int = 4
    grid_tile_width: int = 8
    chain: bool | None = None
    tile_n: int | None = None
    split: bool | None = None

    def __post_init__(self):
        if self.tile_n not in (None, TILE_N, WIDE_TILE_N):
            raise ValueError(f"MosaicConfig.tile_n={self.tile_n}: must be None (per shape), "
                             f"{TILE_N} or {WIDE_TILE_N}")
        if self.split and not parts_join():
            raise ValueError(f"MosaicConfig(split=True) needs jax >= 0.11, whose Mosaic GPU "
                             f"joins a split tile's parts in registers; this is jax "
                             f"{jax.__version__}")
        if self.tile_n == WIDE_TILE_N and self.stages > WIDE_MAX_STAGES:
            raise ValueError(f"MosaicConfig(tile_n={self.tile_n}, stages={self.stages}): "
                             f"at most {WIDE_MAX_STAGES} stages fit shared memory with the "
                             "wide column tile")

    def for_tiles(self, row_tiles: int, n: int, sms: int, k_steps: int | None = None,
                  splits: tuple[int, ...] = ()) -> MosaicConfig:
        """This config with `tile_n` and `split` chosen, for `row_tiles` row visits of N
        columns on `sms` persistent CTAs: an unset tile by `_wave_width`, then an unset
        split where the tile's width is one of those the call `splits` (`split_widths`)
        and `parts_join`."""
        splits = splits if parts_join() else ()
        cfg = self
        if cfg.tile_n is None:
            cfg = cfg.with_tile_n(self._wave_width(row_tiles, n, sms, k_steps, splits))
        if cfg.split is None:
            cfg = dataclasses.replace(cfg, split=cfg.tile_n in splits)
        return cfg

    def _wave_width(self, row_tiles: int, n: int, sms: int, k_steps: int | None,
                    splits: tuple[int, ...]) -> int:
        """256 unless its tiles take more waves of the SMs, counted in 128-column tile
        times, than 128's (within `WAVE_SLACK`); a width in `splits` (those that will
        split) counts its tile times `SPLIT_SPEEDUP` shorter. On an H100 (session 21
        in docs/performance.md) the wide tile ran 1-7% faster on most shapes where the
        waves matched (two within 2% either way), 20% on a dgrad of N = 7168 and K = 2112,
        and 20-34% on the small preset's expert GEMMs (64 groups, K or N 704). It lost
        9-16% where it added a wave (8192 x 2112 x 7168: 10 against 9; 7168 x 2048 x 8192:
        8 against 7); split, 0.92-0.96x on both (sessions 54, 55). Given the `k_steps` of a
        chaining kernel, not where its ring would be cut below `MIN_CHAINED_STAGES` to
        chain (`for_steps`): a 4-step K ran 732 TFLOP/s wide in a chained 2-deep ring and
        803 at 128 columns in a 4-deep one (session 51)."""
        def waves(width: int) -> float:
            tile_times = cdiv(row_tiles * cdiv(n, width), sms) * (width // TILE_N)
            return tile_times / (SPLIT_SPEEDUP if width in splits else 1.0)

        wide = waves(WIDE_TILE_N) <= WAVE_SLACK * waves(TILE_N)
        if wide and k_steps is not None:
            wide = self.with_tile_n(WIDE_TILE_N).for_steps(k_steps).stages >= MIN_CHAINED_STAGES
        return WIDE_TILE_N if wide else TILE_N

    def with_tile_n(self, tile_n: int | None) -> MosaicConfig:
        """This config with `tile_n` columns (None: per shape), its ring cut to what fits
        beside a wide tile."""
        stages = min(self.stages, WIDE_MAX_STAGES) if tile_n == WIDE_TILE_N else self.stages
        return dataclasses.replace(self, tile_n=tile_n, stages=stages)

    def chains(self, k_steps: int) -> bool:
        """Whether pipelines of `k_steps` chain: wanted (short loops when `chain` is None)
        and the ring depth divides the steps, so one tile's pipeline ends on the slot
        where the next one starts."""
        wanted = k_steps <= CHAIN_MAX_STEPS if self.chain is None else self.chain
        return wanted and k_steps % self.stages == 0

    def for_steps(self, k_steps: int) -> MosaicConfig:
        """This config with the deepest ring up to `stages` under which pipelines of
        `k_steps` chain, where a shallower ring makes them chain: a 768-deep K (6 steps)
        runs a chained 3-deep ring, not an unchained 4-deep one. Unchained, the `small`
        preset's 6-step expert GEMMs took 0.35 ms where its chained 8-step ones of equal
        work took 0.26 (session 16's H100 trace). Loops of `SHORT_LOOP_STEPS` or more
        are not cut below `MIN_CHAINED_STAGES` for it: on the H100 (session 51), 8 steps
        on the wide tile ran 799 TFLOP/s chained in 2 stages and 848 unchained in 3 (64
        groups, K 1024 -> N 704); 16 steps 1091 and 1115 (8 groups, K 2048 -> N 7168)."""
        if self.chains(k_steps):
            return self
        shallowest = 2 if k_steps < SHORT_LOOP_STEPS else MIN_CHAINED_STAGES
        deeper_first = (dataclasses.replace(self, stages=d)
                        for d in range(self.stages, shallowest - 1, -1))
        return next((cfg for cfg in deeper_first if cfg.chains(k_steps)), self)


SPLIT_N = TILE_N // 2  # columns of each WGMMA on a split tile (`MosaicConfig.split`)
CHAIN_MAX_STEPS = 32  # longer K loops measured ~5% slower chained
MIN_CHAINED_STAGES = 3  # a shallower ring starves the WGMMAs (`for_steps`)
SHORT_LOOP_STEPS = 8  # shorter K loops are mostly ring fill: chained at any depth
WIDE_TILE_N = 2 * TILE_N
WIDE_MAX_STAGES = 3  # 4 x 49 KB of ring and a 64 KB FP32 epilogue exceed 227 KB
WAVE_SLACK = 1.05  # 64 wide waves against 63 narrow ones still ran 5% faster (H100)
# A split tile's time against an unsplit one's, for the wave rule (`_wave_width`): 64 groups
# of 65536 rows, 2048 -> 1408, ran 54 split wide tile times in 377.6 us and 48 unsplit
# 128-column ones in 408.5. Of ten grouped shapes it moves to the split wide tile, eight ran
# 1.01-1.10x, two with 256 rows a group 0.97-0.98x (H100, session 55).
SPLIT_SPEEDUP = 1.08
DEFAULT_CONFIG = MosaicConfig()


def _load_vector(ref, axis: int) -> jax.Array:
    """A vector in the layout of the WGMMA accumulator's rows (axis 0: one value per row)
    or columns (axis 1: one value per column)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA.reduce(1 - axis))


def _fp8_spec(block: tuple[int, int], index, swizzle: int = FP8_SWIZZLE):
    """An FP8 operand tile, K-major: one 128-wide K step is one 128-byte swizzle row (or
    two 64-byte ones, `FP8_HALF_SWIZZLE`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.BlockSpec(block, index, memory_space=plgpu.SMEM, transforms=(
        plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)))


def _scale_spec(block: tuple[int, int], index):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.BlockSpec(block, index, memory_space=plgpu.SMEM)


def _pipeline(body, compute_context, steps, in_specs, cfg: MosaicConfig, state=None):
    """The warp-specialized K loop: a TMA producer feeding both consumers' steps."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
        pipeline_state=state,
    )


def _rows(wg):
    from jax.experimental import pallas as pl

    return pl.ds(wg * WG_ROWS, WG_ROWS)


def _block_product(a_smem, b_smem, wg) -> jax.Array:
    """This consumer's 64 x width FP32 product of one 128-deep K step (b_smem: width rows
    of N, 128 or an edge tile's 64) in a fresh accumulator."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def product(acc):
        plgpu.wgmma(acc, a_smem.at[_rows(wg)], plgpu.transpose_ref(b_smem, (1, 0)))
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC((WG_ROWS, b_smem.shape[0]), jnp.float32))


def _split_promote(a_smem, b_smem, wg, sums, scale) -> tuple[jax.Array, ...]:
    """sums[j] + scale(j)[row] * (this consumer's 64 rows of a) @ (b rows of part j)^T for
    each 64-column part j of a split tile's K step. Part j + 1's WGMMA is issued before
    part j is promoted, in its own fresh accumulator, so that the tensor cores run one
    part while this consumer's registers promote the other (`MosaicConfig.split`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    a_rows = a_smem.at[_rows(wg)]

    def promote(j, acc, in_flight: int):
        done = plgpu.wgmma_accumulator_load(acc, wait_n=in_flight)
        return sums[j] + done * _broadcast(scale(j), done.shape, 0)

    def from_part(j, previous) -> list:
        def scope(acc):
            plgpu.wgmma(acc, a_rows,
                        plgpu.transpose_ref(b_smem.at[pl.ds(j * SPLIT_N, SPLIT_N)], (1, 0)))
            promoted = [] if previous is None else [promote(j - 1, previous, 1)]
            rest = from_part(j + 1, acc) if j + 1 < len(sums) else [promote(j, acc, 0)]
            return tuple(promoted + rest)
        return list(pl.run_scoped(scope, plgpu.ACC((WG_ROWS, SPLIT_N), jnp.float32)))

    return tuple(from_part(0, None))


def _join_parts(parts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """A split tile's 64-column parts joined in pairs into the 128-column halves that the
    epilogue stages (a register renaming in the WGMMA layout). Staged apart, they went
    wrong or slow on the H100 (jax 0.11.2, session 53): a store of a 64-column value
    into columns 64-127 of the 128-wide slot came out wrong, and storing the parts apart
    (in any slot layout, session 54) made ptxas spill 348-368 bytes a thread on the wide
    tile (1.4-3.5x slower)."""
    return tuple(jnp.concatenate(parts[i:i + 2], axis=1) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2))


def _row_scales(a_scale_smem, wg) -> jax.Array:
    """The 64 row scales of a for this consumer's rows, in the accumulator's row layout."""
    return _load_vector(a_scale_smem.at[0, _rows(wg)], 0)


def _wgmma_zeros(width: int = TILE_N) -> jax.Array:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(jnp.zeros((WG_ROWS, width), jnp.float32), plgpu.Layout.WGMMA)


def _broadcast(vector: jax.Array, shape: tuple[int, int], axis: int) -> jax.Array:
    return lax.broadcast_in_dim(vector, shape, [axis])


def _with_staging(allocs, out_dtype, body) -> None:
    """body(allocs, out_smem, wg) with the ring's shared memory and each consumer's
    64 x 128 epilogue staging tile, then waits for the last stores to leave it."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((2, 1, WG_ROWS, TILE_N), out_dtype),
                       collective_axes="wg")
    def _scope(allocs, out_smem):
        body(allocs, out_smem, lax.axis_index("wg"))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_halves(out_smem, wg, sums, first_col, limit: int, write) -> None:
    """Stages each 128-column half of this consumer's tile and hands it to
    ``write(staged, columns)``, skipping a half that starts at or past `limit` (a wide
    tile's second half may lie wholly past the output's last column)."""
    from jax.experimental import pallas as pl

    for half, values in enumerate(sums):
        col0 = first_col + half * TILE_N

        @pl.when(col0 < limit)
        def _store():
            write(stage_chunk(out_smem, wg, half, values), pl.ds(col0, TILE_N))


def _kernel(table_gmem, a_gmem, a_scale_gmem, b_gmem, b_scale_gmem, out_gmem, *,
            groups: int, cfg: MosaicConfig):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = a_gmem.shape
    n = b_gmem.shape[1]
    k_steps = cdiv(k, TILE)
    swizzle = FP8_SWIZZLE if k % TILE == 0 else FP8_HALF_SWIZZLE
    tiles_m = cdiv(m, CTA_M) + groups
    tile_n = cfg.tile_n
    halves = tile_n // TILE_N
    tiles_n = cdiv(n, tile_n)  # a partial last column tile: its stores are clipped
    # The last column tile multiplies only its real columns (N is a multiple of 64), as
    # 128-wide parts and a 64-wide one (704 = 5 x 128 + 64; all 64-wide when split);
    # column tiles then turn over the SMs where needed (`mosaic_common.tile_visit`).
    # H100, K 1024 -> N 704 (s49): one group 845 -> 879 TFLOP/s, 64 routed groups 648 -> 660.
    edge_n = n - (tiles_n - 1) * tile_n
    part_n = SPLIT_N if cfg.split else TILE_N  # columns of each WGMMA
    part_widths = lambda width: tuple(min(part_n, width - c) for c in range(0, width, part_n))

    chained = cfg.chains(k_steps)

    def pipeline(body, compute_context, state=None):
        return _pipeline(body, compute_context, k_steps, [
            _fp8_spec((CTA_M, TILE), lambda s: (0, s), swizzle),
            _scale_spec((1, CTA_M), lambda s: (s, 0)),
            _fp8_spec((tile_n, TILE), lambda s: (0, s), swizzle),
            _scale_spec((1, halves * WG_ROWS), lambda s: (s, 0)),
        ], cfg, state)

    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore).get_allocations(
        a_gmem, a_scale_gmem, b_gmem.at[0], b_scale_gmem.at[0])

    @functools.partial(_with_staging, allocs, out_gmem.dtype)
    def _scope(allocs, out_smem, wg):
        @for_each_row_visit(table_gmem, wg, tiles_m=tiles_m, tiles_n=tiles_n,
                            grid_tile_width=cfg.grid_tile_width, groups=groups,
                            narrow_last=edge_n < tile_n,
                            drain=(allocs, cfg.stages) if chained else None)
        def _visit(state, ni, group, row0, wg_row0, first, count):
            def store(sums):
                if cfg.split:
                    sums = _join_parts(sums)
                _store_halves(out_smem, wg, sums, ni * tile_n, n, lambda staged, cols:
                              store_rows(staged, out_gmem.at[:, cols], wg_row0, first, count))

            def compute_context(width):
                def context(run):
                    store(run(tuple(_wgmma_zeros(w) for w in part_widths(width))))
                return context

            def step(_, a_smem, a_scale_smem, b_smem, b_scale_smem, sums):
                sa = _row_scales(a_scale_smem, wg)
                scale = lambda half: sa * _load_vector(  # noqa: E731
                    b_scale_smem.at[0, pl.ds(half * WG_ROWS, WG_ROWS)], 0)
                if cfg.split:  # the halves this tile has: an edge tile may have one
                    scales = [scale(half) for half in range(cdiv(len(sums) * SPLIT_N, TILE_N))]
                    return _split_promote(a_smem, b_smem, wg, sums,
                                          lambda j: scales[j * SPLIT_N // TILE_N])
                promoted = []
                for half, total in enumerate(sums):
                    b_part = b_smem.at[pl.ds(half * TILE_N, total.shape[1])]
                    part = _block_product(a_smem, b_part, wg)
                    promoted.append(total + part * _broadcast(scale(half), part.shape, 0))
                return tuple(promoted)

            runs = group < groups
            for width, here in column_tile_widths(ni, tiles_n, tile_n, edge_n):
                @pl.when(runs & here)
                def _real(width=width):
                    b_group = b_gmem.at[group]
                    pipeline(step, compute_context(width), state)(
                        a_gmem.at[pl.ds(row0, CTA_M)],
                        a_scale_gmem.at[:, pl.ds(row0, CTA_M)],
                        b_group.at[pl.ds(ni * tile_n, tile_n)],
                        b_scale_gmem.at[group, :, pl.ds(ni * halves * WG_ROWS,
                                                        halves * WG_ROWS)],
                        allocations=allocs,
                    )

            @pl.when((group == groups) & (wg < 2))
            def _zeros():
                store(tuple(_wgmma_zeros(w) for w in part_widths(tile_n)))


def _tn_kernel(pieces_gmem, x_gmem, x_scale_gmem, y_gmem, y_scale_gmem, out_gmem, *,
               cfg: MosaicConfig, chained: bool):
    """wgrad: out[g] (P, Q) = sum over group g's 128-token blocks of the x (P rows) and y
    (Q rows) tiles' product, scaled by x's row scales and y's column scales. A wide column
    tile is two 128-column halves, each promoted with its own 128 column scales.

    The grid walks pieces (`piece_table`: a run of one group's token blocks) times output
    tiles. ``chained``: a group cut into several pieces sums them in the output, in piece
    order: piece 0 stores its tile, piece r > 0 waits until r pieces have landed (a
    global-memory semaphore per tile and consumer), adds its own with a TMA reduce-add and
    signals the next. The order is fixed, so the result is deterministic; a piece only
    waits on pieces of lower grid index, which every persistent CTA reaches first, so
    nothing deadlocks; the last piece's wait takes the semaphore back to zero."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    groups, p, q = out_gmem.shape
    n_pieces = pieces_gmem.shape[1]
    tile_q = cfg.tile_n
    halves = tile_q // TILE_N
    tiles_p, tiles_q = cdiv(p, CTA_M), cdiv(q, tile_q)  # partial last tiles: stores clipped

    def pipeline(body, compute_context, steps, first_block):
        return _pipeline(body, compute_context, steps, [
            _fp8_spec((CTA_M, TILE), lambda s: (0, first_block + s)),
            _scale_spec((1, CTA_M), lambda s: (first_block + s, 0)),
            _fp8_spec((tile_q, TILE), lambda s: (0, first_block + s)),
            _scale_spec((1, tile_q), lambda s: (first_block + s, 0)),
        ], cfg)

    ignore = lambda *_, **__: None
    allocs = pipeline(ignore, ignore, cfg.stages, 0).get_allocations(
        x_gmem, x_scale_gmem, y_gmem, y_scale_gmem)
    landed = (pl.get_global(plgpu.SemaphoreType.REGULAR((groups * tiles_p * tiles_q * 2,)))
              if chained else None)

    @functools.partial(_with_staging, allocs, out_gmem.dtype)
    def _scope(allocs, out_smem, wg):
        @plgpu.nd_loop((n_pieces * tiles_p * tiles_q,), collective_axes="sm")
        def _tiles(info):
            piece, pi, qi = wgrad_tile(info, tiles_p, tiles_q, cfg.grid_tile_width)
            field = lambda f: pieces_gmem[f, piece]  # noqa: E731
            g, first_block, blocks = field(0), field(1), field(2)

            def store(sums):
                # Read where only the epilogue needs them, not held through the K loop.
                g, rank, last = field(0), field(3), field(4)
                out_rows = out_gmem.at[g, pl.ds(pi * CTA_M + wg * WG_ROWS, WG_ROWS)]

                def write(staged, cols, reduction_op=None):
                    plgpu.copy_smem_to_gmem(staged, out_rows.at[:, cols],
                                            reduction_op=reduction_op)

                if not chained:
                    _store_halves(out_smem, wg, sums, qi * tile_q, q, write)
                    return
                sem = landed.at[((g * tiles_p + pi) * tiles_q + qi) * 2 + wg]
                for decrement in (False, True):  # the last piece resets the count
                    @pl.when((rank > 0) & ((last != 0) == decrement))
                    def _wait_turn(decrement=decrement):
                        plgpu.semaphore_wait(sem, rank, decrement=decrement, memory_scope="gpu")

                def write_or_add(staged, cols):
                    pl.when(rank == 0)(lambda: write(staged, cols))
                    pl.when(rank > 0)(lambda: write(staged, cols, reduction_op="add"))

                _store_halves(out_smem, wg, sums, qi * tile_q, q, write_or_add)

                @pl.when(last == 0)
                def _signal():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

            def compute_context(run):
                store(run((_wgmma_zeros(),) * halves))

            def step(idx, x_smem, x_scale_smem, y_smem, y_scale_smem, sums):
                (s,) = idx
                sx = _row_scales(x_scale_smem, wg)
                # Never false with exact step counts, and compiled away (the K step's
                # SASS is one FMUL and one FFMA an element, no select), yet without it
                # ptxas spilled 316-408 bytes a thread, 42 local stores and loads a step
                # in the K loop, and ran 2-2.5x slower on the H100 (session 52: 98304
                # routed rows 285 -> 595 us; 8 groups of P 4096, Q 7168 over 32768
                # tokens 2105 -> 5225 us).
                keep = lax.broadcast_in_dim(s < blocks, (WG_ROWS, TILE_N), ())
                promoted = []
                for half, total in enumerate(sums):
                    cols = pl.ds(half * TILE_N, TILE_N)
                    part = _block_product(x_smem, y_smem.at[cols], wg)
                    sy = _load_vector(y_scale_smem.at[0, cols], 1)
                    scaled = (part * _broadcast(sx, part.shape, 0)
                              * _broadcast(sy, part.shape, 1))
                    promoted.append(lax.select(keep, total + scaled, total))
                return tuple(promoted)

            used = g < groups  # the table's slots past the last piece do nothing

            # A pipeline of the piece's exact block count (H100, session 52: 64 Dirichlet
            # groups over 65536 tokens 565 -> 533 us, the `small` step's 98304 / 393216
            # routed rows 297 -> 284 / 820 -> 794 us, against whole turns of the ring).
            # Each slot's barriers still complete and are waited once per step (no
            # delay_release), so pipelines of uneven lengths in a row keep their phases.
            @pl.when(used & (blocks > 0))
            def _real():
                pipeline(step, compute_context, blocks, first_block)(
                    x_gmem.at[pl.ds(pi * CTA_M, CTA_M)],
                    x_scale_gmem.at[:, pl.ds(pi * CTA_M, CTA_M)],
                    y_gmem.at[pl.ds(qi * tile_q, tile_q)],
                    y_scale_gmem.at[:, pl.ds(qi * tile_q, tile_q)],
                    allocations=allocs,
                )

            @pl.when(used & (blocks == 0) & (wg < 2))
            def _empty_group():
                store((_wgmma_zeros(),) * halves)


@functools.partial(jax.jit, static_argnames=("out_dtype", "cfg"))
def scaled_grouped_matmul(a, b, group_sizes, *, a_scale, b_scale, out_dtype=jnp.bfloat16,
                          cfg: MosaicConfig | None = None) -> jax.Array:
    """dequant(a) rows of group g @ dequant(b[g])^T; a (M, K) FP8 with 1x128 scales
    (M, K/128), b (G, N, K) FP8 with 128x128 scales (G, N/128, K/128).

    M is zero-padded to the row tile and K only to a multiple of 64 when needed (a K off
    the 128 grid is read as 64-byte swizzle rows; TMA zero-fills the last step's missing
    half); a partial last column tile needs no padding (N only to a multiple of 64,
    `mosaic_common.tma_ready`).
    """
    (m, k), (groups, n, _) = a.shape, b.shape
    k_steps = cdiv(k, TILE)
    cfg = (cfg or DEFAULT_CONFIG).for_tiles(
        cdiv(m, CTA_M) + groups, n, mosaic_common.sm_count(), k_steps,
        splits=split_widths(groups, k)).for_steps(k_steps)
    a = _pad_axis(_pad_axis(a, 1, FP8_HALF_SWIZZLE), 0, CTA_M)
    a_scale = _pad_axis(a_scale, 0, CTA_M)
    b = tma_ready(_pad_axis(b, 2, FP8_HALF_SWIZZLE), 1)
    mp, np_ = a.shape[0], b.shape[1]
    table = visit_table(group_sizes, m)
    # (G, K/128, N/128 * 64): each block scale repeated for the 64 rows of a warpgroup,
    # padded to whole CTA column tiles (a wide tile's half past N reads zeros).
    b_scale_rows = _pad_axis(jnp.repeat(jnp.swapaxes(b_scale, 1, 2), WG_ROWS, axis=2), 2,
                             cfg.tile_n // TILE_N * WG_ROWS)
    out = persistent_call(functools.partial(_kernel, groups=groups, cfg=cfg),
                          _out_shape((mp, np_), out_dtype, a, b),
                          table, a, a_scale.T, b, b_scale_rows, name="fp8_grouped_gemm")
    return out[:m, :n] if (mp, np_) != (m, n) else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "cfg", "piece"))
def scaled_grouped_matmul_tn(x, y, group_sizes, *, x_scale, y_scale, out_dtype=jnp.bfloat16,
                             cfg: MosaicConfig | None = None, piece: int | None = None
                             ) -> jax.Array:
    """(G, P, Q): dequant(x)_g @ dequant(y)_g^T over each group's tokens; x (P, M) and
    y (Q, M) FP8, token-minor, with 1x128 scales along tokens (P, M/128) and (Q, M/128).

    The tokens must be in a tile-aligned layout (`group_schedule.AlignedLayout`): every
    group starts on a multiple of 128 and group_sizes are multiples of 128, so each K
    step belongs to one group and nothing is masked. Partial last tiles of P and Q need
    no padding (only to multiples of 64, `mosaic_common.tma_ready`). ``piece``: the most
    128-token blocks one CTA runs for a tile; a longer group is cut into pieces summed in
    the kernel in FP32 (split-K; None: `wgrad_plan`, `UNSPLIT`: never cut).
    """
    (p, m), q = x.shape, y.shape[0]
    if m % TILE:
        raise ValueError(f"scaled_grouped_matmul_tn wants a tile-aligned token axis (a "
                         f"multiple of {TILE}); got x {x.shape}")
    x, x_scale = tma_ready(x, 0), tma_ready(x_scale, 0)
    y, y_scale = tma_ready(y, 0), tma_ready(y_scale, 0)
    groups, blocks = group_sizes.shape[0], m // TILE
    cfg, planned = wgrad_plan(cfg or DEFAULT_CONFIG, groups, p, q, blocks,
                              mosaic_common.sm_count(), jnp.dtype(out_dtype) == jnp.float32)
    piece = planned if piece is None else piece
    if piece < 1:
        raise ValueError(f"scaled_grouped_matmul_tn(piece={piece}): must be >= 1 token block")
    n_pieces = groups + blocks // piece  # at most this many pieces, whatever the sizes
    chained = n_pieces > groups
    table = piece_table(group_sizes.astype(jnp.int32) // TILE, piece, n_pieces)
    kernel_dtype = jnp.float32 if chained else out_dtype  # pieces are summed in FP32
    out_type = _out_shape((groups, x.shape[0], y.shape[0]), kernel_dtype, x, y)
    out = persistent_call(functools.partial(_tn_kernel, cfg=cfg, chained=chained), out_type,
                          table, x, x_scale.T, y, y_scale.T, name="fp8_grouped_wgrad_gemm")
    out = out[:, :p, :q] if out.shape[1:] != (p, q) else out
    return out.astype(out_dtype)


UNSPLIT = 2**31 - 1  # a `piece` no group reaches: every group runs as one piece
MIN_PIECE_STEPS = 8  # 128-token steps per piece of a cut group: a ring fill per piece
RARE_CUT = 8  # cut groups only where one with 1/8 of the tokens would be (`wgrad_plan`)


def wgrad_plan(cfg: MosaicConfig, groups: int, p: int, q: int, blocks: int, sms: int,
               fp32_out: bool = True) -> tuple[MosaicConfig, int]:
    """The wgrad's column tile and piece length (the most token blocks one CTA runs for
    one output tile) for `blocks` aligned token blocks.

    One group (a dense layer): cut into as many pieces as the SMs its tiles leave idle
    hold, at least `MIN_PIECE_STEPS` each. A dense 1024 x 320 wgrad over 16384 tokens has
    24 tiles of 128 steps: unsplit, 24 of 132 SMs worked, and each of the `small` preset's
    eight dense FP8 wgrads took ~73 us whatever its size (session 16's H100 trace).

    Several groups: the fprop's wave rule picks the column tile, and a group longer than
    half of an SM's share of the steps is cut into pieces of at most that half. A tile
    runs as many steps as its group has blocks and the persistent grid deals tiles out
    round robin, so under skewed routing one heavy expert's tiles outlasted the rest. On
    an H100 (session 23 in docs/performance.md), the `small` preset's expert wgrads ran,
    at even / 18% / 23% largest expert: 300 / 303 / 314 us on 128 columns unsplit in
    expert order (session 22's default), 240 / 297 / 315 wide unsplit, longest first,
    and 259 / 290 / 273 wide with these pieces. The cut's in-kernel sum costs about
    12 us a call even where nothing is cut, and 60 us on the 64 x 2048 x 1408 bench shape
    (not traced to a cause), where a group would need 36% of the tokens to be cut: so
    groups are only cut where one holding 1 / `RARE_CUT` of the tokens would be. Into a
    narrower output (``fp32_out`` False)
    groups are not cut: the pieces would sum in an FP32 copy of the whole (G, P, Q)
    output and a cast pass after it (the bench's 64-group wgrad into BF16: 649 -> 1022
    us)."""
    if groups == 1:
        tiles = cdiv(p, CTA_M) * cdiv(q, TILE_N)
        split = max(1, min(sms // tiles, blocks // MIN_PIECE_STEPS))
        cfg = cfg.for_tiles(split * cdiv(p, CTA_M), q, sms)
        return cfg, cdiv(blocks, split) if split > 1 else UNSPLIT
    cfg = cfg.for_tiles(groups * cdiv(p, CTA_M), q, sms)
    share = cdiv(blocks * cdiv(p, CTA_M) * cdiv(q, cfg.tile_n), sms)  # an SM's steps
    piece = max(MIN_PIECE_STEPS, cdiv(share, 2))
    return cfg, piece if fp32_out and piece * RARE_CUT <= blocks else UNSPLIT


def piece_table(blocks: jax.Array, piece: int, n_pieces: int) -> jax.Array:
    """(5, n_pieces) int32, per piece in grid order: group, first token block, blocks,
    rank within its group (its place in the group's sum) and whether it is the group's
    last. Group g's blocks are cut into ceil(blocks / piece) consecutive pieces whose sizes
    differ by at most one (an empty group keeps one empty piece, which stores zeros);
    slots past the last piece get group G and do nothing.

    Groups come longest first (ties by index): the longest tiles start in the first wave,
    the short ones fill in behind them, and a cut group's pieces start together, so each
    finds the one before it landed. Built from broadcast compares over the G groups
    (XLA fuses them; a sort or a searchsorted would each add kernels to every call)."""
    groups = blocks.shape[0]
    ids = jnp.arange(groups, dtype=jnp.int32)
    before = (blocks[None, :] > blocks[:, None]) | (
        (blocks[None, :] == blocks[:, None]) & (ids[None, :] < ids[:, None]))
    place = before.sum(1)  # group g's place in the order
    order = jnp.where(place[None, :] == ids[:, None], ids[None, :], 0).sum(1)
    length = blocks[order]
    cuts = jnp.maximum(1, -(-length // piece))
    ends = jnp.cumsum(cuts)
    slot = jnp.arange(n_pieces, dtype=jnp.int32)
    k = (slot[:, None] >= ends[None, :]).sum(1)  # the slot's place in the order; G: unused
    kk = jnp.minimum(k, groups - 1)
    rank = slot - (ends - cuts)[kk]
    base, extra = length[kk] // cuts[kk], length[kk] % cuts[kk]
    start = (jnp.cumsum(blocks) - blocks)[order[kk]] + rank * base + jnp.minimum(rank, extra)
    group = jnp.where(k < groups, order[kk], groups)
    return jnp.stack([group, start, base + (rank < extra), rank,
                      rank == cuts[kk] - 1]).astype(jnp.int32)

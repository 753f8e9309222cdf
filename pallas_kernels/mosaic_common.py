"""Pieces shared by the Mosaic GPU (Hopper WGMMA) grouped GEMM kernels.

Both the FP8 and the BF16 kernels walk the same persistent grid of (row tile, column
tile) visits, where a row tile that straddles groups is visited once per group (found in
a table held in shared memory), and store only the visit's rows with a ladder of
power-of-two TMA stores.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.group_schedule import row_visits
from pallas_kernels.quantize import cdiv
from pallas_kernels.triton_gemm import _pad_axis
from pallas_kernels.varying import mark_varying, varying_union

WG_ROWS = 64  # rows per consumer warpgroup (the WGMMA M)
CTA_M = 2 * WG_ROWS  # two consumer warpgroups stacked along M


def cuda_compute_capability() -> float | None:
    """The first device's CUDA compute capability (9.0 on Hopper); None off a CUDA GPU (a
    ROCm device reports a gfx name instead)."""
    try:
        device = jax.devices()[0]
        return (float(getattr(device, "compute_capability", ""))
                if device.platform == "gpu" else None)
    except (RuntimeError, ValueError):
        return None


def jax_version() -> tuple[int, int]:
    """(major, minor) of the running jax: Mosaic GPU's Pallas API moves between them."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def available() -> bool:
    """True on a Hopper GPU with a jax whose Mosaic GPU Pallas has what this kernel uses."""
    return cuda_compute_capability() == 9.0 and jax_version() >= (0, 11)


INTERPRETED_SMS = 3  # persistent CTAs when interpreted: fewer than the tiles of a test


def sm_count() -> int:
    """Streaming multiprocessors of the GPU: one persistent CTA each."""
    return jax.devices()[0].core_count


def _interpret_params():
    """Mosaic GPU's interpreter (CPU threads simulating warpgroups, shared memory, TMA and
    barriers, with race detection); private in jax, present from 0.10."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as err:
        raise NotImplementedError(f"jax {jax.__version__} has no Mosaic GPU interpreter") \
            from err
    return InterpretGPUParams()


def persistent_call(body, out_type, *operands, name: str, interpret: bool = False):
    """``body`` on a persistent grid (one CTA per SM) of one TMA producer and two consumer
    warpgroups, on ``operands``. ``name`` is what profiles call the kernel (`named`).

    Every public entry that calls this is a ``jax.jit`` with its settings static: calls
    with equal shapes and settings then share one traced jaxpr, so jax lowers the kernel
    once per program and XLA compiles it once, however many layers call it. Unjitted,
    each call site was lowered and compiled anew (the FP8 `tiny` step: 129 kernels and
    67 s of compile on the H100, against 43 and 34 s; docs/performance.md, session 35).

    ``interpret``: run on the CPU under Mosaic GPU's interpreter, on `INTERPRETED_SMS`
    CTAs, to test a kernel's logic without a GPU. jax 0.10's interpreter runs the
    row-grouped BF16 kernel with N-major weights (fprop); it does not yet interpret
    transposed WGMMA operands (dgrad, wgrad) or register layout casts (the FP8 kernel).

    ``plgpu.kernel`` traces with shard_map's varying-axes checks off and types its output
    as the same on every device; under a ``shard_map`` that checks them, the output gets
    back every manual axis an operand varies over. That is a change of type only: these
    calls sit inside ``custom_vjp`` rules, so autodiff never transposes it.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    call = plgpu.kernel(
        named(body, name),
        out_type=out_type,
        grid=(INTERPRETED_SMS if interpret else sm_count(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else None,
    )
    return mark_varying(call(*operands), varying_union(operands))


def named(body, name: str):
    """body under `name`, which profiles then call its kernel: Mosaic GPU takes the name
    from the body's ``__name__``, which a ``functools.partial`` lacks."""
    def call(*refs):
        return body(*refs)

    call.__name__ = call.__qualname__ = name
    return call


TMA_MULTIPLE = 64  # elements: a 128-byte swizzle row of 2-byte values (32 4-byte, 8 rows)


def tma_ready(x: jax.Array, axis: int, multiple: int = TMA_MULTIPLE) -> jax.Array:
    """x with `axis` zero-padded to a multiple of `multiple` elements (a copy, only where
    needed). Mosaic's TMA transfers want a tiled dimension to be a multiple of its tiling
    (the 128-byte swizzle row along the minor axis: 64 2-byte or 128 1-byte elements; 8
    rows before it), not of the CTA tile: TMA loads zero-fill a partial tile's part past
    the edge and stores clip it, so padding to the CTA tile would only add a copy."""
    return _pad_axis(x, axis, multiple)


def wgrad_tile(info, tiles_p: int, tiles_q: int, grid_tile_width: int):
    """(group, row tile, column tile) of an `nd_loop` step over a wgrad's output tiles:
    group-major, a snake over each group's (P, Q) tiles (L2 reuse)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (t,) = info.index
    per_group = jnp.int32(tiles_p * tiles_q)
    pi, qi = plgpu.planar_snake(lax.rem(t, per_group), (tiles_p, tiles_q), 1, grid_tile_width)
    return lax.div(t, per_group), pi, qi


TABLE_COLUMNS = 64  # int32 entries per row of the walk's table: 256-byte TMA rows
# At most 8 KB of table (1022 groups): what every row kernel's default ring and epilogue
# leave room for (the BF16 ones after giving up a ring stage past 254 groups).
TABLE_MAX_BYTES = 8192


def visit_table(group_sizes: jax.Array, m: int) -> jax.Array:
    """The row walk's table (`tile_owner`), (2 * width / 64, 64) int32: field 0 holds each
    entry's first visit, field 1 its first row, for the G groups (rows as `group_bounds`
    gives them to the wgrad, so the kernels agree on them; a negative size counts as
    none), then the zero rows past the last group, then a sentinel (the visit count, m);
    width is G + 2 rounded up to 64. A row tile that straddles groups is visited once per
    group (`group_schedule`). The kernels read it into shared memory once
    (`with_visit_table`)."""
    groups = group_sizes.shape[0]
    width = cdiv(groups + 2, TABLE_COLUMNS) * TABLE_COLUMNS
    if 2 * width * 4 > TABLE_MAX_BYTES:
        raise ValueError(f"{groups} groups: the grouped GEMM kernels take at most "
                         f"{TABLE_MAX_BYTES // 8 - 2} (their walk's table must fit in shared "
                         "memory beside the ring)")
    starts, _, visits = row_visits(group_sizes.astype(jnp.int32), m, CTA_M)
    offsets = jnp.cumsum(visits)  # the sentinel's: every visit
    offsets = jnp.concatenate([offsets - visits, offsets[-1:]])
    starts = jnp.concatenate([starts, jnp.full((1,), m, jnp.int32)])
    fields = [jnp.pad(f.astype(jnp.int32), (0, width - groups - 2)) for f in (offsets, starts)]
    return jnp.concatenate(fields).reshape(-1, TABLE_COLUMNS)


def tile_owner(t, table, groups: int):
    """(group, row block, first row, end row) of visit t, from `visit_table` (an array,
    or its shared-memory copy in a kernel): the last entry whose first visit is at most
    t, by a binary search of ceil(log2(G + 2)) dependent loads (the table's padding is
    never read). group == groups means the zero rows past the last group, groups + 1 a
    slot past the last visit, which runs nothing and whose block and rows mean nothing
    (to session 48 such slots multiplied a tile of no rows). To session 50 the kernels
    walked all G + 1 group ends in global memory at every visit: 98304 rows, K 704 ->
    N 1024 ran at 616 TFLOP/s in one group and 508 in 64 on the H100, a loss that grew
    with G (docs/performance.md)."""
    i32 = jnp.int32
    width = table.shape[0] * TABLE_COLUMNS // 2
    last = groups + 1

    def entry(field: int, g):
        flat = g + field * width
        return table[lax.div(flat, i32(TABLE_COLUMNS)), lax.rem(flat, i32(TABLE_COLUMNS))]

    group = offset = i32(0)  # entry 0's first visit is 0
    step = 1 << (last.bit_length() - 1)
    while step:
        candidate = group + step
        first_visit = entry(0, jnp.minimum(candidate, last))
        hit = (candidate <= last) & (first_visit <= t)
        group = lax.select(hit, candidate, group)
        offset = lax.select(hit, first_visit, offset)
        step //= 2
    start, end = entry(1, group), entry(1, jnp.minimum(group + 1, last))
    block = lax.div(start, i32(CTA_M)) + t - offset
    return group, block, start, end


def with_visit_table(table_gmem, body) -> None:
    """body(table) with the row walk's table (`visit_table`) read into shared memory once
    by one TMA: every warpgroup then walks it with shared-memory loads."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @functools.partial(pl.run_scoped, table=plgpu.SMEM(table_gmem.shape, jnp.int32),
                       barrier=plgpu.Barrier(num_arrivals=1), collective_axes="wg")
    def _scope(table, barrier):
        @pl.when(lax.axis_index("wg") == 0)
        def _load():
            plgpu.copy_gmem_to_smem(table_gmem, table, barrier)

        plgpu.barrier_wait(barrier)
        body(table)


def for_each_row_visit(table_gmem, wg, *, tiles_m: int, tiles_n: int,
                       grid_tile_width: int, groups: int, narrow_last: bool, drain=None):
    """Decorator: runs visit(pipeline state, column tile, group, first row of the CTA
    tile, first row of the warpgroup's slice, first and count of its rows) for each of
    this CTA's slots of a row kernel's persistent grid (`tile_visit`), with the walk's
    table in shared memory (`with_visit_table`). A slot of a real group (group < groups)
    runs a pipeline; the state is `chained_state`'s for it. ``drain``: (allocations,
    ring depth) of a chained ring, awaited after the last slot (`drain_chain`); None:
    pipelines are not chained."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def decorate(visit):
        @functools.partial(with_visit_table, table_gmem)
        def _walk(table):
            @plgpu.nd_loop((tiles_m * tiles_n,), collective_axes="sm",
                           init_carry=jnp.int32(0))
            def _tiles(info, carry):
                slot = tile_visit(info, tiles_m, tiles_n, grid_tile_width, wg, table, groups,
                                  narrow_last=narrow_last)
                visit(chained_state(drain is not None, carry), *slot)
                _, group, *_ = slot
                return carry | (group < groups).astype(jnp.int32)  # ran a pipeline

            if drain is not None:
                drain_chain(*drain, _tiles)
    return decorate


def tile_visit(info, tiles_m: int, tiles_n: int, grid_tile_width: int, wg, table,
               groups: int, narrow_last: bool = False):
    """The (row visit, column tile) of an `nd_loop` step over the persistent grid, as
    (column tile, group, first row of the CTA tile, first row of the warpgroup's 64-row
    slice, first and count of the visit's rows within that slice).

    ``narrow_last``: the kernel multiplies a narrower last column tile. Slot t goes to SM
    t mod sms; where the snake is one band (tiles_n <= grid_tile_width, row-major) and
    tiles_n divides the SM count, an SM would always draw the same column tile, so the
    narrow tile would only idle the SMs that drew it. There each row visit's column
    tiles are turned by the wave its first tile runs in: every SM draws the narrow tile
    in turn, each row still gets every column tile once, and a wave holds the same
    tiles (L2 reuse unchanged). Elsewhere the tiles already turn; turning them again
    made the dense 8192 x 2112 x 7168 FP8 GEMM 2-3% slower (H100, session 49)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (t,) = info.index
    mi, ni = plgpu.planar_snake(t, (tiles_m, tiles_n), 1, grid_tile_width)
    sms = lax.axis_size("sm")  # the grid's size: static
    if narrow_last and tiles_n <= grid_tile_width and sms % tiles_n == 0:
        ni = turned_column(mi, ni, tiles_n, sms)
    group, block, lo, hi = tile_owner(mi, table, groups)
    row0 = block * CTA_M
    wg_row0 = row0 + wg * WG_ROWS
    first = jnp.clip(lo - wg_row0, 0, WG_ROWS)
    count = jnp.clip(hi - wg_row0, 0, WG_ROWS) - first
    return ni, group, row0, wg_row0, first, count


def turned_column(mi, ni, tiles_n: int, sms: int):
    """Column tile ni of row visit mi turned by the wave (of `sms` slots) that the row's
    first tile runs in, on a row-major walk (`tile_visit`)."""
    wave = lax.div(mi * jnp.int32(tiles_n), jnp.int32(sms))
    return lax.rem(ni + wave, jnp.int32(tiles_n))


def column_tile_widths(ni, tiles_n: int, tile_n: int, edge_n: int):
    """(width multiplied, predicate on the column tile ni) pairs for a kernel's column
    tiles: one pair when every tile is full, else a second for the narrower last tile
    (`tile_visit` then turns the tiles over the SMs where needed)."""
    if edge_n == tile_n:
        return ((tile_n, True),)
    is_edge = ni == tiles_n - 1
    return ((tile_n, ~is_edge), (edge_n, is_edge))


def stage_chunk(out_smem, wg, chunk: int, values: jax.Array):
    """Consumer wg's slot for the chunk-th store of a tile, in its ring of epilogue slots
    out_smem (2, slots, 64, width), filled with values (cast) and ready for a TMA store.
    A tile's first chunk waits for every earlier store (the tile before may have ended on
    any slot); a later one only for the stores that read its slot, so with two slots one
    chunk is cast while the other leaves. That wait leaves one store group in flight,
    which is the last chunk's because every chunk of a tile issues as many stores as the
    visit's row ladder needs (the same for each). An edge tile's narrower part fills the
    slot's first columns: the TMA store of the whole slot clips the rest, which lies past
    the output's last column."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    slots = out_smem.shape[1]
    plgpu.wait_smem_to_gmem(0 if chunk == 0 else slots - 1, wait_read_only=True)
    slot = out_smem.at[wg, chunk % slots]
    values = values.astype(out_smem.dtype)
    if values.shape[1] == out_smem.shape[-1]:
        slot[...] = values
    else:
        slot[:, :values.shape[1]] = values
    plgpu.commit_smem()
    return slot


def chained_state(chained: bool, ran_before):
    """Pipeline state of a chained visit: START on a CTA's first pipeline, else STEADY
    (the producer is already running ahead); None when pipelines are not chained."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not chained:
        return None
    return jnp.where(ran_before > 0, plgpu.PipelinePipeline.STEADY,
                     plgpu.PipelinePipeline.START)


def drain_chain(allocs, stages: int, ran) -> None:
    """After a CTA's chained pipelines (``ran`` > 0 when it ran any), the producer
    warpgroup awaits the consumers' releases of the ring's last turn. A chain of START
    and STEADY pipelines never runs the STOP state's wait, so those phases would go
    unobserved: harmless on the GPU, where the kernel then ends, but Mosaic GPU's
    interpreter fails a barrier whose phases a thread did not all observe. ``allocs``:
    the pipeline's `get_allocations`, whose consumed barriers sit under the same key in
    jax 0.10 and 0.11."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @pl.when((ran > 0) & (lax.axis_index("wg") == 2))  # the producer: the last warpgroup
    def _drain():
        for slot in range(stages):
            for barrier in allocs["flat_consumed_barrier_refs"]:
                plgpu.barrier_wait(barrier.at[slot])


def store_rows(smem, gmem, first_row, lo, count) -> None:
    """Stores smem rows [lo, lo + count) to gmem rows first_row + lo ... as a ladder of
    power-of-two TMA stores (descriptors need static box sizes)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    size, offset = WG_ROWS, lo
    while size >= 1:
        @pl.when((count & size) != 0)
        def _store(offset=offset, size=size):
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(offset, size)],
                                    gmem.at[pl.ds(first_row + offset, size)])
        offset = offset + (count & size)
        size //= 2

"""Maps the tiles of a grouped GEMM's rows onto (group, row block) pairs.

Rows are sorted by group, so a block of `block_m` rows can straddle group
boundaries; such a block is visited once per group it touches, each visit writing
only its group's rows. Rows past sum(group_sizes) form one extra group that is
written as zeros. The schedule has a static length so the kernel grid is static.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.quantize import TILE, cdiv


class TileSchedule(NamedTuple):
    tile_group: jax.Array  # (T,) group of each tile; G = the zero rows, G+1 = no-op
    tile_block: jax.Array  # (T,) row block of each tile
    starts: jax.Array  # (G+2,) first row of each group (extended as above)
    ends: jax.Array  # (G+2,) one past the last row


def num_tiles(m: int, groups: int, block_m: int) -> int:
    """Upper bound on visits: each of the G+1 groups adds at most one split block."""
    return cdiv(m, block_m) + groups


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(starts, ends) of each group's rows, clipped to [0, m]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def row_visits(group_sizes: jax.Array, m: int, block_m: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(starts, ends, visits) of the G groups and then of the zero rows past the last
    (G + 1 entries each): first row, end row, and how many block_m-row tiles the rows
    touch (a tile that straddles groups is visited once per group)."""
    starts, ends = group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // block_m
    visits = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    return starts, ends, visits.astype(jnp.int32)


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> TileSchedule:
    g = group_sizes.shape[0]
    none = jnp.zeros((1,), jnp.int32)  # entry G + 1: slots past the last visit
    starts, ends, count = (jnp.concatenate([x, none])
                           for x in row_visits(group_sizes, m, block_m))
    first = starts // block_m
    cum = jnp.cumsum(count)
    t = jnp.arange(num_tiles(m, g, block_m), dtype=jnp.int32)
    gid = jnp.minimum(jnp.searchsorted(cum, t, side="right"), g + 1).astype(jnp.int32)
    block = first[gid] + t - (cum - count)[gid]
    block = jnp.where(gid == g + 1, 0, block).astype(jnp.int32)
    return TileSchedule(gid, block, starts.astype(jnp.int32), ends.astype(jnp.int32))


class AlignedLayout(NamedTuple):
    """Rows of M regrouped so each group starts on a multiple of TILE, zero rows between.

    Why: the FP8 wgrad contracts each group's rows in 128-row K steps whose scales are per
    (column, 128-row tile). Tiles that straddle two groups would share a scale (one
    group's outlier coarsens the other's) and need per-row masking inside the WGMMA
    kernel; aligned tiles need neither (DeepGEMM's contiguous grouped layout). The padding
    is at most TILE - 1 rows per group.
    """

    sizes: jax.Array  # (G,) each group's rows rounded up to a multiple of TILE
    tile_source: jax.Array  # (R/TILE,) source row of each aligned tile's first row
    tile_rows: jax.Array  # (R/TILE,) rows of the tile that hold data (the rest are zeros)

    @property
    def length(self) -> int:
        """R, the static row count of the layout."""
        return self.tile_source.shape[0] * TILE


def aligned_length(m: int, groups: int) -> int:
    """Static row count R of the aligned layout of m rows in `groups` groups: the sum of
    ceil(size / TILE) * TILE over groups is at most (m + (TILE - 1) * groups) / TILE tiles."""
    return TILE * ((m + (TILE - 1) * groups) // TILE)


def aligned_layout(group_sizes: jax.Array, m: int) -> AlignedLayout:
    """The `AlignedLayout` of m rows grouped by `group_sizes` (rows past their sum are
    left out)."""
    starts, ends = group_bounds(group_sizes, m)
    rows = ends - starts
    sizes = ((rows + TILE - 1) // TILE * TILE).astype(jnp.int32)
    aligned_ends = jnp.cumsum(sizes)
    first = jnp.arange(aligned_length(m, group_sizes.shape[0]) // TILE, dtype=jnp.int32) * TILE
    group = jnp.searchsorted(aligned_ends, first, side="right")
    inside = group < group_sizes.shape[0]
    group = jnp.minimum(group, group_sizes.shape[0] - 1)
    offset = first - (aligned_ends - sizes)[group]
    tile_rows = jnp.where(inside, jnp.clip(rows[group] - offset, 0, TILE), 0)
    tile_source = jnp.where(inside, starts[group] + offset, 0)
    return AlignedLayout(sizes, tile_source.astype(jnp.int32), tile_rows.astype(jnp.int32))


def gather_aligned(x: jax.Array, layout: AlignedLayout) -> jax.Array:
    """x (M, ...) rows placed in the aligned layout: (R, ...), zeros in the padding."""
    m = x.shape[0]
    within = jnp.arange(TILE, dtype=jnp.int32)
    source = layout.tile_source[:, None] + within
    source = jnp.where(within < layout.tile_rows[:, None], source, m).reshape(-1)
    padded = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])
    return padded[source]

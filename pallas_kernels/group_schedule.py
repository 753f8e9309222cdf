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

from pallas_kernels.quantize import cdiv


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


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> TileSchedule:
    g = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, m)
    total = ends[-1]
    starts = jnp.concatenate([starts, jnp.stack([total, jnp.int32(0)])])
    ends = jnp.concatenate([ends, jnp.stack([jnp.int32(m), jnp.int32(0)])])
    first = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    cum = jnp.cumsum(count)
    t = jnp.arange(num_tiles(m, g, block_m), dtype=jnp.int32)
    gid = jnp.minimum(jnp.searchsorted(cum, t, side="right"), g + 1).astype(jnp.int32)
    block = first[gid] + t - (cum - count)[gid]
    block = jnp.where(gid == g + 1, 0, block).astype(jnp.int32)
    return TileSchedule(gid, block, starts.astype(jnp.int32), ends.astype(jnp.int32))

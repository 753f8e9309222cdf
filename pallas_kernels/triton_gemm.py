"""Pallas (Triton lowering) grouped GEMM kernels, BF16 or block-scaled FP8.

Two kernels cover the three GEMMs of a (grouped) linear:
- `grouped_matmul`: contraction over K, rows grouped (fprop and dgrad). Each
  K step of 128 is one tensor-core product promoted to the FP32 accumulator with
  the row scale of `a` and the column scale of `b` applied (DeepSeek-V3's recipe).
- `grouped_matmul_tn`: contraction over each group's rows (wgrad). Token blocks
  are aligned to the global 128-row grid so the 1x128 scales along tokens apply
  per step; rows of other groups are masked to zero.
Dense GEMMs are the one-group case. Runs on any CUDA GPU Triton supports, and in
Pallas interpret mode on CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.group_schedule import group_bounds, tile_schedule
from pallas_kernels.quantize import TILE, cdiv


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes and Triton launch knobs. block_k is the contraction step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Fastest of a small sweep on an H100 (docs/performance.md, 2026-11-22).
FP8_CONFIG = TileConfig()
BF16_CONFIG = TileConfig(block_k=64, num_warps=4, num_stages=4)
BF16_TN_CONFIG = TileConfig(block_n=256, block_k=64)


def _pick(cfg: TileConfig | None, scaled: bool, itemsize: int, tn: bool = False) -> TileConfig:
    """The given config, else the tuned default; 4-byte operands get half the K step or the
    wide tile so the pipelined stages still fit in shared memory (228 KB on Hopper)."""
    if cfg is not None:
        return cfg
    chosen = FP8_CONFIG if scaled else BF16_TN_CONFIG if tn else BF16_CONFIG
    if itemsize == 4:
        chosen = dataclasses.replace(chosen, block_k=32, block_n=min(chosen.block_n, 128))
    return chosen


def _out_shape(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
    """The kernel's output type; under shard_map it varies over every mesh axis that any
    operand varies over (outside shard_map there is no manual axis type)."""
    types = [t for t in (jax.typeof(o).manual_axis_type for o in operands) if t is not None]
    manual = (types[0].update(varying=frozenset().union(*(t.varying for t in types)))
              if types else None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


def _dot(a, b, ca: int, cb: int):
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _zero(dtype):
    return jnp.zeros((), dtype)


def _swizzle(pid, tiles_m, tiles_n, group_m):
    """Row-major tile order in bands of group_m row blocks, for L2 reuse of b."""
    per_band = group_m * tiles_n
    band = pid // per_band
    first = band * group_m
    size = jnp.minimum(tiles_m - first, group_m)
    local = pid % per_band
    return first + local % size, local // size


def _grouped_kernel(tile_group_ref, tile_block_ref, starts_ref, ends_ref, a_ref, b_ref,
                    *rest, groups, m, n, k, cfg, b_kn, scaled, tiles_m, tiles_n):
    if scaled:
        as_ref, bs_ref, o_ref = rest
    else:
        (o_ref,) = rest
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    t, j = _swizzle(pl.program_id(0), tiles_m, tiles_n, cfg.group_m)
    g = tile_group_ref[t]
    blk = tile_block_ref[t]
    lo = jnp.maximum(starts_ref[g], blk * bm)
    hi = jnp.minimum(ends_ref[g], blk * bm + bm)
    rows = blk * bm + jax.lax.broadcasted_iota(jnp.int32, (bm,), 0)
    cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_in, col_in = rows < m, cols < n
    gb = jnp.minimum(g, groups - 1)
    steps = jnp.int32(k // bk) * (g < groups).astype(jnp.int32)  # zero rows: no K loop

    def step(kk, acc):
        ks = pl.ds(kk * bk, bk)
        a = pltriton.load(a_ref.at[pl.ds(blk * bm, bm), ks], mask=row_in[:, None],
                          other=_zero(a_ref.dtype))
        if b_kn:
            b = pltriton.load(b_ref.at[gb, ks, pl.ds(j * bn, bn)], mask=col_in[None, :],
                              other=_zero(b_ref.dtype))
            prod = _dot(a, b, 1, 0)
        else:
            b = pltriton.load(b_ref.at[gb, pl.ds(j * bn, bn), ks], mask=col_in[:, None],
                              other=_zero(b_ref.dtype))
            prod = _dot(a, b, 1, 1)
        if scaled:
            sa = pltriton.load(as_ref.at[kk, pl.ds(blk * bm, bm)], mask=row_in, other=0.0)
            sb = pltriton.load(bs_ref.at[gb, kk, pl.ds(j * bn, bn)], mask=col_in, other=0.0)
            prod = prod * sa[:, None] * sb[None, :]
        return acc + prod

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    keep = ((rows >= lo) & (rows < hi))[:, None] & col_in[None, :]
    pltriton.store(o_ref.at[pl.ds(blk * bm, bm), pl.ds(j * bn, bn)],
                   acc.astype(o_ref.dtype), mask=keep)


def _with_init(kernel, out_init):
    """Drops the aliased initial-output ref (tests pass a poisoned buffer through it)."""
    if out_init is None:
        return kernel
    return lambda *refs, **kw: kernel(*refs[:-2], refs[-1], **kw)


def _compiler_params(cfg: TileConfig):
    return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check_step(cfg: TileConfig, scaled: bool) -> None:
    if scaled and cfg.block_k != TILE:
        raise ValueError(f"FP8 block scaling needs block_k == {TILE}, got {cfg.block_k}")


@functools.partial(jax.jit, static_argnames=("b_row_tile", "b_kn", "out_dtype", "cfg",
                                             "interpret"))
def grouped_matmul(a, b, group_sizes, *, a_scale=None, b_scale=None, b_row_tile=128,
                   b_kn=False, out_dtype=jnp.bfloat16, cfg=None, interpret=False,
                   out_init=None):
    """See reference.grouped_matmul. FP8 needs b_kn=False (K-major b for WGMMA).

    K is zero-padded to a multiple of the K step when needed (a copy: rare shapes).
    """
    scaled = a_scale is not None
    cfg = _pick(cfg, scaled, a.dtype.itemsize)
    if scaled and b_kn:
        raise ValueError("scaled operands need K-major b (G, N, K)")
    _check_step(cfg, scaled)
    a = _pad_axis(a, 1, cfg.block_k)
    b = _pad_axis(b, 1 if b_kn else 2, cfg.block_k)
    m, k = a.shape
    groups = b.shape[0]
    n = b.shape[2] if b_kn else b.shape[1]
    sched = tile_schedule(group_sizes, m, cfg.block_m)
    tiles_m, tiles_n = sched.tile_group.shape[0], cdiv(n, cfg.block_n)
    operands = [*sched, a, b]
    if scaled:
        operands.append(a_scale.T)  # (K/128, M): contiguous along the tile's rows
        col = jnp.repeat(b_scale, b_row_tile, axis=-2)[..., :n, :]  # (G, N, K/128)
        operands.append(jnp.swapaxes(col, 1, 2))  # (G, K/128, N)
    kernel = functools.partial(_with_init(_grouped_kernel, out_init), groups=groups, m=m, n=n, k=k, cfg=cfg,
                               b_kn=b_kn, scaled=scaled, tiles_m=tiles_m, tiles_n=tiles_n)
    return pl.pallas_call(
        kernel,
        out_shape=_out_shape((m, n), out_dtype, a, b),
        grid=(tiles_m * tiles_n,),
        compiler_params=_compiler_params(cfg),
        name="grouped_gemm",  # what traces show (moejax.profiling files it under GEMM)
        interpret=interpret,
        input_output_aliases={} if out_init is None else {len(operands): 0},
    )(*operands, *([] if out_init is None else [out_init]))


def _tn_kernel(starts_ref, ends_ref, x_ref, y_ref, *rest, p, q, cfg, token_major, scaled):
    if scaled:
        xs_ref, ys_ref, o_ref = rest
    else:
        (o_ref,) = rest
    bp, bq, bt = cfg.block_m, cfg.block_n, cfg.block_k
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    first = start // bt
    steps = jnp.maximum(cdiv(end, bt) - first, 0)
    pr = i * bp + jax.lax.broadcasted_iota(jnp.int32, (bp,), 0)
    qc = j * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
    p_in, q_in = pr < p, qc < q

    def step(s, acc):
        mb = first + s
        toks = mb * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
        t_in = (toks >= start) & (toks < end)
        ts = pl.ds(mb * bt, bt)
        if token_major:
            x = pltriton.load(x_ref.at[ts, pl.ds(i * bp, bp)], mask=t_in[:, None] & p_in[None, :],
                              other=_zero(x_ref.dtype))
            y = pltriton.load(y_ref.at[ts, pl.ds(j * bq, bq)], mask=t_in[:, None] & q_in[None, :],
                              other=_zero(y_ref.dtype))
            prod = _dot(x, y, 0, 0)
        else:
            x = pltriton.load(x_ref.at[pl.ds(i * bp, bp), ts], mask=p_in[:, None] & t_in[None, :],
                              other=_zero(x_ref.dtype))
            y = pltriton.load(y_ref.at[pl.ds(j * bq, bq), ts], mask=q_in[:, None] & t_in[None, :],
                              other=_zero(y_ref.dtype))
            prod = _dot(x, y, 1, 1)
        if scaled:
            sx = pltriton.load(xs_ref.at[mb, pl.ds(i * bp, bp)], mask=p_in, other=0.0)
            sy = pltriton.load(ys_ref.at[mb, pl.ds(j * bq, bq)], mask=q_in, other=0.0)
            prod = prod * sx[:, None] * sy[None, :]
        return acc + prod

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bp, bq), jnp.float32))
    pltriton.store(o_ref.at[g, pl.ds(i * bp, bp), pl.ds(j * bq, bq)], acc.astype(o_ref.dtype),
                   mask=p_in[:, None] & q_in[None, :])


@functools.partial(jax.jit, static_argnames=("token_major", "out_dtype", "cfg", "interpret"))
def grouped_matmul_tn(x, y, group_sizes, *, x_scale=None, y_scale=None, token_major=True,
                      out_dtype=jnp.bfloat16, cfg=None, interpret=False,
                      out_init=None):
    """See reference.grouped_matmul_tn. FP8 needs token_major=False (K-major operands)."""
    scaled = x_scale is not None
    cfg = _pick(cfg, scaled, x.dtype.itemsize, tn=True)
    if scaled and token_major:
        raise ValueError("scaled operands need token-minor x (P, M) and y (Q, M)")
    _check_step(cfg, scaled)
    if token_major:
        (m, p), q = x.shape, y.shape[1]
    else:
        (p, m), q = x.shape, y.shape[0]
    groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, m)
    operands = [starts, ends, x, y]
    if scaled:
        operands += [x_scale.T, y_scale.T]  # (M/128, P), (M/128, Q)
    kernel = functools.partial(_with_init(_tn_kernel, out_init), p=p, q=q, cfg=cfg, token_major=token_major,
                               scaled=scaled)
    return pl.pallas_call(
        kernel,
        out_shape=_out_shape((groups, p, q), out_dtype, x, y),
        grid=(groups, cdiv(p, cfg.block_m), cdiv(q, cfg.block_n)),
        compiler_params=_compiler_params(cfg),
        name="grouped_wgrad_gemm",
        interpret=interpret,
        input_output_aliases={} if out_init is None else {len(operands): 0},
    )(*operands, *([] if out_init is None else [out_init]))

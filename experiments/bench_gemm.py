"""GEMM benchmark: our Pallas kernels vs XLA, JAX's Mosaic GPU example and torch.

    python -m experiments.bench_gemm [--quick] [--tune]
        [--only dense|grouped|small_grouped|fp8_wgrad|small_fp8] [--groups G] [--json PATH]

"ours" is the public op on the backend `pallas_kernels.backend()` picks (on an H100:
the Mosaic GPU WGMMA kernels for all block-scaled FP8 GEMMs, the FP8 wgrad on tokens in
the tile-aligned layout, and the three BF16 grouped GEMMs); the Triton kernel of the same
op is a comparator column.

Prints one row per (op, shape): TFLOP/s, the floor time (METHOD.md: max of FLOPs
over peak and bytes over bandwidth), the ratio to each comparator and the error.
Times are device times on both sides: the JAX calls' kernels in a profiler trace, torch's
from CUDA events around back-to-back calls (a wall clock adds JAX's heavier host dispatch,
tens of microseconds, to GEMMs of a few hundred).
Torch comparators (cuBLAS bf16, cuBLASLt block-scaled FP8, torch._grouped_mm,
torch._scaled_grouped_mm) run first in a subprocess, since both frameworks grab
GPU memory; rows say "absent" where torch or an op is missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np

PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100 SXM datasheet, dense
PEAK_BW = 3.35e12  # HBM3 datasheet bytes/s
M_DENSE = 8192
DENSE_NK = [(8192, 8192), (2112, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
GROUPED = [(8, 32768, 7168, 4096), (8, 32768, 2048, 7168), (64, 65536, 2048, 1408)]
# The `small` preset's expert GEMMs as its training step runs them (--only small_grouped):
# 16 x 1024 tokens x top-6 rows over 64 experts, gate/up (1024 -> 704) and down (704 -> 1024).
SMALL_GROUPED = [(64, 98304, 1024, 704), (64, 98304, 704, 1024)]
GROUPED_TABLES = ("grouped", "small_grouped")
TORCHLESS = ("fp8_wgrad", "small_fp8")  # tables without torch comparators
CPU_REFUSAL = ("times GPU kernels from a profiler trace's device time, and this process runs "
               "on cpu: run it on a GPU (tests/test_kernels_gemm.py checks the kernels' "
               "numerics on CPU in interpret mode)")


def dense_shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    """(pass, M, N, K) of fprop, dgrad and wgrad for each projection."""
    out = []
    for n, k in DENSE_NK[:2] if quick else DENSE_NK:
        m = M_DENSE
        for name, shape in (("fprop", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m))):
            if (m, n, k) == (8192, 8192, 8192) and name != "fprop":
                continue  # cube: all three passes are the same GEMM
            out.append((name, *shape))
    return out


def grouped_shapes(quick: bool, groups: int | None, only: str | None
                   ) -> list[tuple[int, int, int, int]]:
    """The grouped (G, rows, K, N) shapes to run: none for the dense table, the small
    preset's for its own table; the first only with quick, those of G groups only with
    groups (a device call's time limit fits two of them with torch's)."""
    if only == "dense":
        return []
    shapes = SMALL_GROUPED if only == "small_grouped" else GROUPED
    shapes = shapes[:1] if quick else shapes
    return [s for s in shapes if groups is None or s[0] == groups]


def group_sizes(g: int, rows: int, seed: int = 0) -> np.ndarray:
    """Uneven (Dirichlet) sizes in multiples of 16 (torch's grouped kernels need it)."""
    p = np.random.default_rng(seed).dirichlet(np.ones(g))
    sizes = np.floor(p * rows / 16).astype(np.int64) * 16
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes.astype(np.int32)


# ----------------------------------------------------------------------------- torch side
def torch_worker(quick: bool, only: str | None, groups: int | None) -> dict[str, float | str]:
    """Seconds per call of each torch comparator, keyed like the JAX rows."""
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    res: dict[str, float | str] = {}

    def seconds(fn: Callable[[], object], iters: int = 20) -> float:
        """Device time per call from CUDA events around back-to-back calls (the launches
        run ahead of the GPU, so the events time the kernels, as the JAX side's trace does)."""
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters

    def timed(key: str, fn: Callable[[], object]) -> None:
        try:
            res[key] = seconds(fn)
        except Exception as e:  # an op missing or refusing a layout is a result too
            res[key] = f"failed: {type(e).__name__}: {str(e)[:120]}"

    def padded(x, rows: int, cols: int):  # zeros to whole tiles, for the amax only
        return F.pad(x.float(), (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))

    def fp8_1x128(x):  # (R, C) -> fp8 (R, C), scale (R, ceil(C/128)): a partial last tile
        t = padded(x, 1, 128)
        t = t.reshape(t.shape[0], -1, 128)
        s = t.abs().amax(-1).clamp(min=1e-12) / 448.0
        q = (t / s[..., None]).to(torch.float8_e4m3fn).reshape(t.shape[0], -1)
        return q[:, :x.shape[1]].contiguous(), s

    def fp8_128x128(w):  # (N, K) -> fp8 (N, K), scale (ceil(N/128), ceil(K/128))
        n, k = w.shape
        t = padded(w, 128, 128)
        t = t.reshape(t.shape[0] // 128, 128, t.shape[1] // 128, 128)
        s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        q = (t / s[:, None, :, None]).to(torch.float8_e4m3fn).reshape(t.shape[0] * 128, -1)
        return q[:n, :k].contiguous(), s

    def k_blocks_to_4(s):
        """b's (N/128, K blocks) scales with the K blocks zero-padded to a multiple of 4,
        the layout torch's scaled_mm checks for (L4 = round_up(K/128, 4) in 2.13's meta
        registration); torch 2.11 refused K = 2112's 17 blocks unpadded and reads them
        padded (H100, docs/performance.md, sessions 53 and 54)."""
        return F.pad(s, (0, -s.shape[1] % 4))

    for name, m, n, k in [] if only in GROUPED_TABLES else dense_shapes(quick):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        timed(f"cublas_bf16/{name}/{m}x{n}x{k}", lambda: a @ w.t())
        try:
            from torch.nn.functional import ScalingType
            aq, as_ = fp8_1x128(a)
            wq, ws = fp8_128x128(w)
            timed(f"cublaslt_fp8_block/{name}/{m}x{n}x{k}", lambda: F.scaled_mm(
                aq, wq.t(), as_.t().contiguous().t(), ScalingType.BlockWise1x128,
                k_blocks_to_4(ws).t(), ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16))
        except Exception as e:
            res[f"cublaslt_fp8_block/{name}/{m}x{n}x{k}"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        del a, w
    for g, rows, k, n in grouped_shapes(quick, groups, only):
        sizes = torch.tensor(group_sizes(g, rows), device=dev)
        offs = torch.cumsum(sizes, 0).to(torch.int32)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        w_nk = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)  # (G, K, N) column-major view
        key = f"{g}x{rows}x{k}->{n}"
        timed(f"torch_grouped_mm/fwd/{key}", lambda: torch._grouped_mm(x, w_nk.transpose(1, 2), offs=offs))
        w_kn = w_nk.transpose(1, 2).contiguous()  # dgrad: dy @ w^T, w^T column-major
        timed(f"torch_grouped_mm/dgrad/{key}", lambda: torch._grouped_mm(dy, w_kn.transpose(1, 2), offs=offs))
        xt = x.t().contiguous()
        dy_cm = dy.t().contiguous().t()
        timed(f"torch_grouped_mm/wgrad/{key}", lambda: torch._grouped_mm(xt, dy_cm, offs=offs))
        xq = x.to(torch.float8_e4m3fn)
        wq = w_nk.to(torch.float8_e4m3fn)
        sx = torch.ones(rows, device=dev, dtype=torch.float32)
        sw = torch.ones(g, n, device=dev, dtype=torch.float32)
        timed(f"torch_scaled_grouped_mm/fwd/{key}", lambda: torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16))
        del x, dy, w_nk, w_kn, xt, dy_cm, xq, wq
    return res


def jax_backend_in_child() -> str | None:
    """JAX's default backend, asked in a child process (None where it fails): the torch
    comparators must run before this process starts JAX, which takes most of the GPU's
    memory, yet a host without a GPU must be refused before they start."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        child = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                               capture_output=True, text=True, env=env, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = child.stdout.split()
    return words[-1] if child.returncode == 0 and words else None


def run_torch(quick: bool, only: str | None, groups: int | None) -> dict[str, float | str]:
    cmd = [sys.executable, "-m", "experiments.bench_gemm", "--torch-worker"] + (
        ["--quick"] if quick else []) + (["--only", only] if only else []) + (
        ["--groups", str(groups)] if groups else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    except Exception as e:
        print(f"torch worker did not run: {e}")
        return {}
    for line in out.stdout.splitlines():
        if line.startswith("TORCHJSON "):
            return json.loads(line[len("TORCHJSON "):])
    print("torch comparators absent:", (out.stderr or out.stdout)[-400:])
    return {}


# ----------------------------------------------------------------------------- jax side
@dataclasses.dataclass
class Row:
    op: str
    shape: str
    flops: float
    bytes: float
    dtype: str
    seconds: float | str
    err: float | None = None
    vs: dict[str, float | str] = dataclasses.field(default_factory=dict)

    def floor_s(self) -> float:
        return max(self.flops / (PEAK_TFLOPS[self.dtype] * 1e12), self.bytes / PEAK_BW)


def bind(fn: Callable, *args) -> Callable[[], object]:
    """jit fn and bind its arrays as arguments (closing over them would make them
    compile-time constants: huge modules and slow constant folding)."""
    import functools

    import jax
    return functools.partial(jax.jit(fn), *args)


def tflops(flops: float, s: float | str) -> float | str:
    return flops / s / 1e12 if isinstance(s, float) else s


def time_or_failure(fn: Callable[[], object]) -> float | str:
    """Device seconds of fn (its kernels in a profiler trace, over 10 calls), or why it
    failed (a comparator that cannot run says so in its table cell instead of stopping
    the bench)."""
    from moejax.profiling import device_seconds
    try:
        return device_seconds(fn, 10)
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e)[:100]}"


def rel_err(out_fn: Callable[[], object], ref_fn: Callable[[], object]) -> float | None:
    """Relative Frobenius error; None (printed "-") if either side fails to run."""
    import jax.numpy as jnp
    try:
        out, ref = jnp.asarray(out_fn(), jnp.float32), jnp.asarray(ref_fn(), jnp.float32)
    except Exception as e:
        print(f"error check failed: {type(e).__name__}: {str(e)[:300]}")
        return None
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def jax_rows(quick: bool, torch_res: dict, cfgs: dict, only: str | None,
             groups: int | None) -> list[Row]:
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from pallas_kernels import reference, triton_gemm as tg
    from pallas_kernels.backend import ops
    from pallas_kernels.group_schedule import aligned_layout
    from pallas_kernels.quantize import dequantize

    hi = jax.lax.Precision.HIGHEST
    key = iter(jax.random.split(jax.random.key(0), 10_000))
    qw = jax.jit(jax.vmap(pk.quantize_128x128))

    def tq(name: str) -> float | str:
        return time_or_failure(fns[name])

    rows: list[Row] = []
    for name, m, n, k in [] if only in (*GROUPED_TABLES, "fp8_wgrad") else dense_shapes(quick):
        shape = f"{m}x{n}x{k}"
        a = jax.random.normal(next(key), (m, k), jnp.bfloat16)
        w = jax.random.normal(next(key), (n, k), jnp.bfloat16)
        aq, as_ = pk.quantize_1x128(a)
        wq, ws = pk.quantize_128x128(w)
        ours = bind(pk.fp8_gemm, aq, as_, wq, ws)
        fns = {"ours": ours, "xla_bf16": bind(lambda a, w: a @ w.T, a, w),
               "triton_ours": bind(lambda aq, as_, wq, ws: tg.grouped_matmul(
                   aq, wq[None], jnp.array([aq.shape[0]], jnp.int32), a_scale=as_,
                   b_scale=ws[None], cfg=cfgs["fp8"]), aq, as_, wq, ws)}
        err = rel_err(ours, bind(lambda aq, as_, wq, ws: jnp.dot(
            dequantize(aq, as_, 1), dequantize(wq, ws, 128).T, precision=hi), aq, as_, wq, ws))
        if (m, n, k) == (8192, 8192, 8192):
            print("fp8_gemm 8192^3 error vs unquantized f32 product:", rel_err(ours, bind(
                lambda a, w: jnp.dot(a.astype(jnp.float32), w.astype(jnp.float32).T, precision=hi), a, w)))
        t_ours = tq("ours")
        vs = {"xla_bf16": tq("xla_bf16"), "triton_ours": tq("triton_ours")}
        for tk in ("cublas_bf16", "cublaslt_fp8_block"):
            vs[tk] = torch_res.get(f"{tk}/{name}/{shape}", "absent")
        emit(rows, Row(f"fp8_gemm {name}", shape, 2.0 * m * n * k, m * k + n * k + 2 * m * n + 4 * m * k / 128,
                        "fp8", t_ours, err, vs))
        del a, w, aq, wq
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    for g, rows_, k, n in grouped_shapes(quick, groups, only):
        gkey = f"{g}x{rows_}x{k}->{n}"
        sizes = jnp.asarray(group_sizes(g, rows_))
        x = jax.random.normal(next(key), (rows_, k), jnp.bfloat16)
        dy = jax.random.normal(next(key), (rows_, n), jnp.bfloat16)
        b = jax.random.normal(next(key), (g, k, n), jnp.bfloat16)  # ragged_dot layout
        flops = 2.0 * rows_ * k * n
        passes = {
            "fwd": dict(
                ours=lambda x, dy, b, sizes: pk.grouped_gemm(x, b, sizes),
                triton_ours=lambda x, dy, b, sizes: tg.grouped_matmul(x, b, sizes, b_kn=True, cfg=cfgs["bf16"]),
                ragged_dot=lambda x, dy, b, sizes: jax.lax.ragged_dot(x, b, sizes),
                mgpu_example=lambda x, dy, b, sizes: ragged_dot_mgpu.ragged_dot(
                    x, b, group_sizes=sizes, block_m=128, block_n=128, block_k=64,
                    max_concurrent_steps=4, grid_block_n=1),
                ref=lambda x, dy, b, sizes: jax.lax.ragged_dot(x.astype(jnp.float32), b.astype(jnp.float32), sizes, precision=hi)),
            "dgrad": dict(
                ours=lambda x, dy, b, sizes: ops().grouped_matmul(dy, b, sizes, b_kn=False, out_dtype=dy.dtype),
                triton_ours=lambda x, dy, b, sizes: tg.grouped_matmul(dy, b, sizes, b_kn=False, cfg=cfgs["bf16"]),
                ragged_dot=lambda x, dy, b, sizes: jax.lax.ragged_dot(dy, jnp.swapaxes(b, 1, 2), sizes),
                mgpu_example=lambda x, dy, b, sizes: ragged_dot_mgpu.ragged_dot(
                    dy, b, group_sizes=sizes, block_m=128, block_n=128, block_k=64,
                    max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True),
                ref=lambda x, dy, b, sizes: jax.lax.ragged_dot(dy.astype(jnp.float32), jnp.swapaxes(b, 1, 2).astype(jnp.float32),
                                               sizes, precision=hi)),
            "wgrad": dict(
                ours=lambda x, dy, b, sizes: ops().grouped_matmul_tn(x, dy, sizes, token_major=True, out_dtype=b.dtype),
                triton_ours=lambda x, dy, b, sizes: tg.grouped_matmul_tn(x, dy, sizes, token_major=True, cfg=cfgs["bf16_tn"]),
                ragged_dot=lambda x, dy, b, sizes: jax.vjp(lambda bb: jax.lax.ragged_dot(x, bb, sizes), b)[1](dy)[0],
                ref=lambda x, dy, b, sizes: jax.vjp(lambda bb: jax.lax.ragged_dot(x.astype(jnp.float32), bb, sizes, precision=hi),
                                    b.astype(jnp.float32))[1](dy.astype(jnp.float32))[0]),
        }
        wgrad_only = only == "fp8_wgrad"
        for pname, pf in {} if wgrad_only else passes.items():
            fns = {kk: bind(v, x, dy, b, sizes) for kk, v in pf.items() if kk != "ref"}
            # XLA's FP32 ragged_dot for 64 groups compiles past a device call's time limit
            # (2026-11-22); that shape's correctness is in tests/test_kernels_gpu.py.
            err = rel_err(fns["ours"], bind(pf["ref"], x, dy, b, sizes)) if g <= 8 else None
            vs = {kk: tq(kk) for kk in fns if kk != "ours"}
            vs["torch_grouped_mm"] = torch_res.get(f"torch_grouped_mm/{pname}/{gkey}", "absent")
            io = (rows_ * k + g * k * n + rows_ * n) * 2
            emit(rows, Row(f"grouped_gemm bf16 {pname}", gkey, flops, io, "bf16", tq("ours"), err, vs))
        # FP8 grouped (fwd, dgrad: K-major weights) and the equal-FLOP dense FP8 GEMM.
        xq, xs = pk.quantize_1x128(x)
        dyq, dys = pk.quantize_1x128(dy)
        w_nk = jnp.swapaxes(b, 1, 2)  # (G, N, K)
        wq, ws = qw(w_nk)
        bq, bs = qw(b)  # (G, K, N): dgrad's K-major weights
        fp8_passes = {
            "fwd": (xq, xs, wq, ws, (x, w_nk)),
            "dgrad": (dyq, dys, bq, bs, (dy, b)),
        }
        for pname, (aq, as_, wq_, ws_, _) in {} if wgrad_only else fp8_passes.items():
            ours = bind(pk.fp8_grouped_gemm, aq, as_, wq_, ws_, sizes)
            triton = bind(lambda aq, as_, wq_, ws_, sizes: tg.grouped_matmul(
                aq, wq_, sizes, a_scale=as_, b_scale=ws_, cfg=cfgs["fp8"]), aq, as_, wq_, ws_, sizes)
            mm, kk_ = aq.shape
            nn = wq_.shape[1]
            dq, dqs = pk.quantize_1x128(jax.random.normal(next(key), (mm, kk_), jnp.bfloat16))
            dw, dws = pk.quantize_128x128(jax.random.normal(next(key), (nn, kk_), jnp.bfloat16))
            dense = bind(pk.fp8_gemm, dq, dqs, dw, dws)
            ref = bind(lambda aq, as_, wq_, ws_, sizes: jax.lax.ragged_dot(
                dequantize(aq, as_, 1), jnp.swapaxes(dequantize(wq_, ws_, 128), 1, 2), sizes, precision=hi),
                aq, as_, wq_, ws_, sizes)
            err = rel_err(ours, ref)
            fns = {"ours": ours, "dense_fp8_ours": dense, "triton_ours": triton}
            vs = {"dense_fp8_ours": tq("dense_fp8_ours"), "triton_ours": tq("triton_ours"),
                  "torch_scaled_grouped_mm": torch_res.get(f"torch_scaled_grouped_mm/{pname}/{gkey}", "absent")}
            io = rows_ * kk_ + g * kk_ * nn + rows_ * nn * 2
            emit(rows, Row(f"fp8_grouped_gemm {pname}", gkey, flops, io, "fp8", tq("ours"), err, vs))
        # FP8 wgrad: ours quantizes along tokens into the tile-aligned layout (what the
        # training linears do) and runs the public wgrad; Triton runs the unaligned layout.
        layout = aligned_layout(sizes, rows_)
        (xtq, xts), (dytq, dyts) = (pk.quantize_along_tokens(v, layout) for v in (x, dy))
        fns = {"ours": bind(lambda dytq, xtq, dyts, xts, al_sizes: ops().grouped_matmul_tn(
                   dytq, xtq, al_sizes, x_scale=dyts, y_scale=xts, token_major=False,
                   tile_aligned=True), dytq, xtq, dyts, xts, layout.sizes)}
        (uxq, uxs), (udq, uds) = (pk.quantize_1x128(v.T) for v in (x, dy))
        fns["triton_ours"] = bind(lambda udq, uxq, uds, uxs, sizes: tg.grouped_matmul_tn(
            udq, uxq, sizes, x_scale=uds, y_scale=uxs, token_major=False, cfg=cfgs["fp8"]),
            udq, uxq, uds, uxs, sizes)
        dq, dqs = pk.quantize_1x128(jax.random.normal(next(key), (n, rows_), jnp.bfloat16))
        dw, dws = pk.quantize_128x128(jax.random.normal(next(key), (k, rows_), jnp.bfloat16))
        fns["dense_fp8_ours"] = bind(pk.fp8_gemm, dq, dqs, dw, dws)
        # The same FLOPs as one group, scaled like the wgrad (1x128 along tokens on both
        # operands, one more multiply an element than fp8_gemm's 128x128 weight blocks):
        # what grouping alone costs.
        (tq1, ts1), (tq2, ts2) = (pk.quantize_along_tokens(jax.random.normal(
            next(key), (rows_, d), jnp.bfloat16)) for d in (n, k))
        fns["dense_wgrad_ours"] = bind(lambda tq1, tq2, ts1, ts2: ops().grouped_matmul_tn(
            tq1, tq2, jnp.array([rows_], jnp.int32), x_scale=ts1, y_scale=ts2,
            token_major=False, tile_aligned=True), tq1, tq2, ts1, ts2)
        err = rel_err(fns["ours"], bind(
            lambda dytq, xtq, dyts, xts, al_sizes: reference.grouped_matmul_tn(
                dytq, xtq, al_sizes, x_scale=dyts, y_scale=xts, token_major=False,
                out_dtype=jnp.float32), dytq, xtq, dyts, xts, layout.sizes)) if g <= 8 else None
        vs = {kk: tq(kk) for kk in ("dense_fp8_ours", "dense_wgrad_ours", "triton_ours")}
        io = layout.length * (k + n) + g * k * n * 2
        emit(rows, Row("fp8_grouped_gemm wgrad", gkey, flops, io, "fp8", tq("ours"), err, vs))
        del x, dy, b, xq, dyq, wq, bq, xtq, dytq, uxq, udq, dq, dw, tq1, tq2
    return rows


def tune(cands: dict[str, list]) -> dict:
    """Pick the fastest TileConfig per kernel family on one representative shape."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from moejax.profiling import device_seconds
    from pallas_kernels import triton_gemm as tg

    kx, kw = jax.random.split(jax.random.key(1))
    a = jax.random.normal(kx, (8192, 7168), jnp.bfloat16)
    w = jax.random.normal(kw, (8, 7168, 4096), jnp.bfloat16)
    sizes = jnp.asarray(group_sizes(8, 8192))
    aq, as_ = pk.quantize_1x128(a)
    wq, ws = jax.vmap(pk.quantize_128x128)(jnp.swapaxes(w, 1, 2))
    calls = {  # (aq, as_, wq, ws, a, w, cfg); dy and sizes are small-rank stand-ins below
        "fp8": lambda aq, as_, wq, ws, a, w, c: tg.grouped_matmul(aq, wq, sizes, a_scale=as_, b_scale=ws, cfg=c),
        "bf16": lambda aq, as_, wq, ws, a, w, c: tg.grouped_matmul(a, w, sizes, b_kn=True, cfg=c),
        "bf16_tn": lambda aq, as_, wq, ws, a, w, c: tg.grouped_matmul_tn(a, a[:, :4096], sizes, token_major=True, cfg=c),
    }
    best = {}
    for fam, cs in cands.items():
        results = []
        for c in cs:
            try:
                f = functools.partial(jax.jit(calls[fam], static_argnums=6), aq, as_, wq, ws, a, w, c)
                t = device_seconds(f, 10)
            except Exception as e:
                print(f"tune {fam} {c}: failed {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"tune {fam} {c}: {2 * 8192 * 7168 * 4096 / t / 1e12:.0f} TFLOP/s")
            results.append((t, c))
        best[fam] = min(results, key=lambda r: r[0])[1] if results else cs[0]
    return best


HEADER = (f"{'op':28} {'shape':24} {'TFLOP/s':>8} {'floor_us':>9} {'us':>9} {'err':>9}  "
          "ratios: ours/other (other's TFLOP/s)")


def format_row(r: Row) -> str:
    def ratio(v: float | str) -> str:
        both = isinstance(v, float) and isinstance(r.seconds, float)
        return f"{v / r.seconds:.2f}x" if both else "n/a"

    ratios = "  ".join(f"{k}={ratio(v)}({fmt(v, r.flops)})" for k, v in r.vs.items())
    us = f"{r.seconds * 1e6:.0f}" if isinstance(r.seconds, float) else str(r.seconds)[:40]
    err = f"{r.err:.2e}" if r.err is not None else "-"
    return f"{r.op:28} {r.shape:24} {fmt(r.seconds, r.flops):>8} {r.floor_s() * 1e6:9.0f} {us:>9} {err:>9}  {ratios}"


def emit(rows: list[Row], row: Row) -> None:
    """Record a row and print it at once, so a run cut short still reports it."""
    rows.append(row)
    print(format_row(row), flush=True)


SMALL_TOKENS = 16384  # the small preset's batch 16 x 1024
SMALL_DENSE_WGRAD = [(1024, 320), (1024, 384), (384, 1536), (256, 2048), (1024, 1024),
                     (1408, 1024)]  # (P, Q) of its dense FP8 wgrads: dW (P, Q) = x^T dy
SMALL_EXPERTS = (64, 98304, 704, 1024)  # (G, rows = tokens x top-6, K, N): the down projection


def small_fp8_rows() -> list[Row]:
    """The `small` preset's FP8 GEMMs that its step trace showed wasting the GPU, each
    against what it replaced, on one H100:
    - dense wgrads over 16384 tokens: few output tiles of long K, so without split-K most
      SMs idle (comparators: our kernel unsplit, and the BF16 dot XLA gives to cuBLAS);
    - the expert down projection, K = 704: now a chained 3-deep ring read as 64-byte
      swizzle rows (comparators: the former path, K padded to 768 by XLA and an unchained
      4-deep ring; and our BF16 grouped GEMM)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from pallas_kernels import mosaic_common, mosaic_gemm, reference
    from pallas_kernels.quantize import dequantize
    from pallas_kernels.triton_gemm import _pad_axis

    key = iter(jax.random.split(jax.random.key(1), 100))
    rows: list[Row] = []

    def timed(fns: dict[str, Callable[[], object]]) -> dict[str, float | str]:
        return {name: time_or_failure(fn) for name, fn in fns.items()}

    t = SMALL_TOKENS
    for p, q in SMALL_DENSE_WGRAD:
        x = jax.random.normal(next(key), (t, p), jnp.bfloat16)
        dy = jax.random.normal(next(key), (t, q), jnp.bfloat16)
        (xq, xs), (dq, ds) = pk.quantize_along_tokens(x), pk.quantize_along_tokens(dy)
        sizes = jnp.array([t], jnp.int32)
        wgrad = lambda xq, dq, xs, ds, sizes, piece=None: mosaic_gemm.scaled_grouped_matmul_tn(
            xq, dq, sizes, x_scale=xs, y_scale=ds, out_dtype=jnp.float32, piece=piece)
        fns = {"ours": bind(wgrad, xq, dq, xs, ds, sizes),
               "unsplit": bind(functools.partial(wgrad, piece=mosaic_gemm.UNSPLIT),
                               xq, dq, xs, ds, sizes),
               "xla_bf16_dot": bind(lambda x, dy: jnp.dot(x.T, dy, preferred_element_type=jnp.float32), x, dy)}
        times = timed(fns)
        err = rel_err(fns["ours"], bind(lambda xq, dq, xs, ds, sizes: reference.grouped_matmul_tn(
            xq, dq, sizes, x_scale=xs, y_scale=ds, token_major=False, out_dtype=jnp.float32),
            xq, dq, xs, ds, sizes))
        piece = mosaic_gemm.wgrad_plan(mosaic_gemm.DEFAULT_CONFIG, 1, p, q, t // 128,
                                       mosaic_common.sm_count())[1]
        rows.append(Row(f"fp8 dense wgrad (pieces of {piece} blocks)", f"{t}->{p}x{q}",
                        2 * t * p * q,
                        t * (p + q) + p * q * 4, "fp8", times.pop("ours"), err, times))
    g, m, k, n = SMALL_EXPERTS
    sizes = jnp.asarray(group_sizes(g, m), jnp.int32)
    a = jax.random.normal(next(key), (m, k), jnp.bfloat16)
    w = jax.random.normal(next(key), (g, n, k), jnp.bfloat16)
    aq, as_ = pk.quantize_1x128(a)
    wq, ws = jax.jit(jax.vmap(pk.quantize_128x128))(w)
    fprop = lambda aq, wq, as_, ws, sizes, cfg=None: mosaic_gemm.scaled_grouped_matmul(
        aq, wq, sizes, a_scale=as_, b_scale=ws, cfg=cfg)
    unchained = mosaic_gemm.MosaicConfig(chain=False)
    fns = {"ours": bind(fprop, aq, wq, as_, ws, sizes),
           "padded_768_unchained": bind(lambda aq, wq, as_, ws, sizes: fprop(
               _pad_axis(aq, 1, 128), _pad_axis(wq, 2, 128), as_, ws, sizes, unchained),
               aq, wq, as_, ws, sizes),
           "bf16_grouped_ours": bind(lambda a, w, sizes: pk.grouped_gemm(
               a, jnp.swapaxes(w, 1, 2), sizes), a, w, sizes)}
    times = timed(fns)
    ends = np.cumsum(np.asarray(sizes))[:3]  # the first three groups (a 64-group FP32
    first = ends - np.asarray(sizes)[:3]     # reference of every row would not fit)
    err = rel_err(lambda: jnp.concatenate([fns["ours"]()[lo:hi] for lo, hi in zip(first, ends)]),
                  lambda: jnp.concatenate([
                      jnp.dot(dequantize(aq[lo:hi], as_[lo:hi], 1),
                              dequantize(wq[i], ws[i], 128).T, precision="highest")
                      for i, (lo, hi) in enumerate(zip(first, ends))]))
    rows.append(Row("fp8 grouped fprop (K % 128 != 0)", f"{g}x{m}x{k}->{n}", 2 * m * k * n,
                    m * k + g * n * k + m * n * 2, "fp8", times.pop("ours"), err, times))
    return rows


def fmt(v: float | str, flops: float) -> str:
    return f"{tflops(flops, v):.0f}" if isinstance(v, float) else str(v)[:40]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-worker", action="store_true")
    ap.add_argument("--quick", action="store_true", help="first shapes only")
    ap.add_argument("--tune", action="store_true", help="sweep tile configs first")
    ap.add_argument("--only", choices=("dense", *GROUPED_TABLES, "fp8_wgrad", "small_fp8"),
                    default=None,
                    help="one table only (each fits one device call); fp8_wgrad: the grouped "
                         "FP8 wgrad rows alone; small_grouped: the grouped table on the small "
                         "preset's expert shapes; small_fp8: the small preset's FP8 GEMMs "
                         "that split-K and the chained short-K ring changed")
    ap.add_argument("--groups", type=int, default=None,
                    help="only the grouped shapes of this many groups (8 or 64)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.groups is not None and args.groups not in {s[0] for s in GROUPED}:
        ap.error(f"--groups {args.groups}: the grouped shapes have "
                 f"{sorted({s[0] for s in GROUPED})} groups")
    if args.torch_worker:
        print("TORCHJSON " + json.dumps(torch_worker(args.quick, args.only, args.groups)))
        return
    if args.only not in TORCHLESS and jax_backend_in_child() == "cpu":
        ap.error(CPU_REFUSAL)
    torch_res = {} if args.only in TORCHLESS else run_torch(args.quick, args.only, args.groups)
    import jax

    from pallas_kernels import triton_gemm as tg

    import pallas_kernels as pk
    if jax.default_backend() == "cpu":  # after torch's run: JAX then takes the GPU's memory
        ap.error(CPU_REFUSAL)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; our backend: {pk.backend()}")
    TC = tg.TileConfig
    cands = {
        "fp8": [tg.FP8_CONFIG, TC(128, 256, 128, 8, 8, 3), TC(128, 128, 128, 8, 4, 4),
                TC(256, 128, 128, 8, 8, 3), TC(128, 256, 128, 8, 8, 4)],
        "bf16": [tg.BF16_CONFIG, TC(128, 256, 64, 8, 8, 3), TC(128, 128, 64, 8, 8, 3),
                 TC(256, 128, 64, 8, 8, 3), TC(128, 256, 64, 8, 8, 4)],
        "bf16_tn": [tg.BF16_TN_CONFIG, tg.BF16_CONFIG, TC(128, 128, 128, 8, 8, 3)],
    }
    cfgs = tune(cands) if args.tune else {k: v[0] for k, v in cands.items()}
    print("configs:", cfgs)
    print(HEADER)
    rows = small_fp8_rows() if args.only == "small_fp8" else jax_rows(
        args.quick, torch_res, cfgs, args.only, args.groups)
    print(HEADER)
    for r in rows:
        print(format_row(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()

"""Token-movement benchmark: the fused Pallas kernels vs XLA's compile of the pure-JAX
reference on the same inputs, both against the device's own copy bandwidth.

    python -m experiments.bench_movement [--quick] [--json PATH] [--profile DIR]

1. Copy bandwidth: `x * 1.5` over 1 GiB of bf16, bytes read + written (measured here, in
   the same run, not the datasheet).
2. Per shape (T tokens, H hidden, E experts, k = 8) and op: the bytes floor (each input read
   once, each output written once), kernel and XLA times, each as a fraction of copy
   bandwidth, and XLA time / kernel time; and a plain copy of the floor's bytes (what a
   streaming kernel of the op's size reaches). Outputs are checked against the reference first
   (bitwise where the op is a permutation or a quantization). Then the FP8 linears' weight
   quantization (FP32 (G, K, N) -> both FP8 layouts) on expert-stack shapes, and SwiGLU
   fused with its 1x128 quantization on expert-row shapes.
3. One MoE layer (`small` preset shapes) forward+backward on one device: fused movement ops
   vs the unfused reference (argsort, XLA gather/scatter, plain autodiff), tokens/s, and
   data movement's share of the device time from a jax.profiler trace (with --profile) and
   from timing the layer with identity experts.
Times: device-busy time (the union of the call's kernels in a profiler trace; wall time on
the CPU) of one jitted call that runs the op on R distinct input sets, divided by R, averaged
over repeats. R is up to 8, as many as x (T, H) fits 512 MiB: the sets keep the small
shapes' inputs out of the 50 MB L2 between calls.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pallas_kernels as pk
from pallas_kernels import mosaic_common
from pallas_kernels import mosaic_movement as mm
from pallas_kernels import movement_reference as ref
from pallas_kernels import triton_movement as tm
from pallas_kernels.group_schedule import aligned_layout
from pallas_kernels.quantize import TILE, cdiv

from experiments import cli
from moejax import profiling
from moejax.config import get_model_preset
from moejax.model import dispatch as model_dispatch
from moejax.model import moe
from moejax.model.expert_ffn import ExpertWeights

K = 8
TOKENS = (4096, 16384, 65536)
# Expert stacks (G, K, N): the small preset's gate/up and down, DeepSeek-V3's 8 local experts.
WEIGHT_SHAPES = "64x1024x704,64x704x1024,8x7168x2048"
MOE_SEQ = 1024  # tokens per sequence in the MoE layer's batch (the small preset's)
# Expert rows (T*k, I): the small preset's batch of 16 x 1024 tokens (k = 6), and V3's I.
SWIGLU_SHAPES = "98304x704,32768x2048"
PAIRED = ((7168, 256), (2048, 64))  # DeepSeek-V3's and V2-Lite's (hidden, experts)
CROSSED = ((7168, 256), (7168, 64), (2048, 256), (2048, 64))
SET_BYTES = 512 * 2**20  # input sets per call: as many x (T, H) as fit this (<= 8 sets)


def sets_fitting(nbytes: int) -> int:
    """Input sets per timed call: as many inputs of nbytes as fit SET_BYTES, at most 8."""
    return max(1, min(8, SET_BYTES // nbytes))


def input_sets(tokens: int, hidden: int) -> int:
    """Input sets per timed call of the token ops: as many x (T, H) as fit SET_BYTES."""
    return sets_fitting(tokens * hidden * 2)


def per_call_seconds(fn: Callable, arg_sets: list[tuple], repeats: int) -> float:
    """Seconds per input set of one jitted call over all sets: device-busy time from a trace
    on an accelerator (a wall clock would add the host's dispatch, most of the reading for
    ops of tens of microseconds), wall time on the CPU (its trace has no kernel events)."""
    run = jax.jit(lambda sets: [fn(*args) for args in sets])
    call = lambda: run(arg_sets)  # noqa: E731
    if jax.default_backend() == "cpu":
        return profiling.median_seconds(call, repeats) / len(arg_sets)
    return profiling.device_seconds(call, repeats) / len(arg_sets)


def same_size_copy_seconds(nbytes: int, sets: int, repeats: int) -> float:
    """Seconds of `x * 1.5` reading + writing nbytes in all (bf16), over `sets` input sets
    like the op's: what a plain streaming kernel moving the op's floor bytes takes at the
    op's own size, where ramp and tail weigh more than in the 1 GiB copy."""
    keys = jax.random.split(jax.random.key(nbytes % 2**31), sets)
    xs = [(jax.random.normal(key, (max(1, nbytes // 4),), jnp.bfloat16),) for key in keys]
    return per_call_seconds(lambda x: x * 1.5, xs, repeats)


def copy_bandwidth(repeats: int) -> float:
    """Bytes/s of a 1 GiB bf16 read + 1 GiB write."""
    moved = 2 * 2**30
    return moved / same_size_copy_seconds(moved, 1, repeats)


@dataclasses.dataclass
class Row:
    shape: str
    op: str
    floor_bytes: int
    kernel_s: float | None  # None: the kernel cannot run this shape (see note)
    xla_s: float | None  # None: failed (see note)
    check: str
    copy_s: float  # a copy of floor_bytes (same_size_copy_seconds)
    note: str = ""


def _bitwise(a, b) -> bool:
    as_bits = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint8) if v.dtype.itemsize == 1 else v  # noqa: E731
    return bool(jnp.array_equal(as_bits(a), as_bits(b)))


def _rel(a, b, rows: int = 2**16) -> float:
    """Relative error on the leading rows (an FP32 copy of a 7.5 GB output does not fit)."""
    a, b = jnp.asarray(a[:rows], jnp.float32), jnp.asarray(b[:rows], jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _routing(key, tokens: int, experts: int) -> jax.Array:
    """k distinct experts per token, uniformly at random (as a balanced top-k gives)."""
    return jax.lax.top_k(jax.random.uniform(key, (tokens, experts)), K)[1].astype(jnp.int32)


def op_inputs(tokens: int, hidden: int, experts: int) -> list[dict[str, jax.Array]]:
    """`input_sets` sets of every op's random inputs: x (and its FP8 copy xq, xs), the
    routing (ids, perm), router weights w, expert outputs y and a gradient g."""
    inputs = []
    for key in jax.random.split(jax.random.key(tokens + hidden + experts),
                                input_sets(tokens, hidden)):
        kx, ki, kw, ky, kg = jax.random.split(key, 5)
        ids = _routing(ki, tokens, experts)
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16) * 3
        xq, xs = pk.quantize_1x128(x)
        inputs.append(dict(
            x=x, xq=xq, xs=xs, ids=ids, perm=pk.sort_by_expert(ids, experts)[0],
            w=jax.random.uniform(kw, (tokens, K), jnp.float32),
            y=jax.random.normal(ky, (tokens * K, hidden), jnp.bfloat16),
            g=jax.random.normal(kg, (tokens, hidden), jnp.bfloat16)))
    return inputs


class Op(NamedTuple):
    """One row kind of the per-shape table."""

    name: str
    floor_bytes: int
    kernel: Callable
    xla: Callable  # XLA's compile of the pure-JAX reference
    inputs: tuple[str, ...]  # keys of `op_inputs`
    check: str  # "bitwise" or "rel"
    runs: bool  # whether the kernel takes these shapes here


def shape_ops(tokens: int, hidden: int, experts: int, interpret: bool) -> list[Op]:
    """The per-shape table's ops for T = tokens, H = hidden, E = experts."""
    n = tokens * K

    def reference_combine_vjp(g, y, perm, w):
        _, pullback = jax.vjp(lambda y, w: ref.combine(y, perm, w), y, w)
        return pullback(g)

    def argsort_sort(ids):
        flat = ids.reshape(-1)
        return (jnp.argsort(flat, stable=True).astype(jnp.int32),
                jnp.bincount(flat, length=experts).astype(jnp.int32))

    kern = lambda name: functools.partial(getattr(tm, name), interpret=interpret)  # noqa: E731
    fp8_fits = tm.offsets_fit((n, hidden), jnp.float8_e4m3fn) or tm.packs_fp8(n, hidden)
    scale_bytes = n * cdiv(hidden, TILE) * 4
    transpose_floor = 3 * tokens * hidden + hidden * cdiv(tokens, TILE) * 4
    # The library's kernel for the plain layout: streamed through TMA on a Hopper.
    streamed = (mm.quantize_along_tokens if not interpret and mosaic_common.available()
                and mm.applies((tokens, hidden), jnp.bfloat16) else None)
    ops = [
        Op("sort_by_expert (vs argsort+bincount)", 8 * n + 4 * experts,
           lambda ids: pk.sort_by_expert(ids, experts), argsort_sort, ("ids",), "bitwise", True),
        Op("dispatch fp8 (permute+quantize)",
           2 * tokens * hidden + n * hidden + scale_bytes + 4 * n,
           lambda x, p: kern("permute")(x, p, K, quantize=True),
           lambda x, p: ref.permute(x, p, K, quantize=True), ("x", "perm"), "bitwise", fp8_fits),
        Op("dispatch bf16 (permute)", 2 * tokens * hidden + 2 * n * hidden + 4 * n,
           lambda x, p: kern("permute")(x, p, K, quantize=False)[0],
           lambda x, p: ref.permute(x, p, K, quantize=False)[0], ("x", "perm"), "bitwise", True),
        Op("combine (fwd)", 2 * n * hidden + 2 * tokens * hidden + 8 * n,
           kern("combine"), ref.combine, ("y", "perm", "w"), "rel", True),
        Op("combine (bwd: dy, dweights)", 2 * tokens * hidden + 4 * n * hidden + 12 * n,
           kern("combine_backward"), reference_combine_vjp, ("g", "y", "perm", "w"), "rel", True),
        Op("quantize_along_tokens (x^T, 1x128)", transpose_floor,
           streamed or kern("quantize_along_tokens"), ref.quantize_along_tokens, ("x",),
           "bitwise", True),
        Op("quantize_along_tokens from fp8 (FP8 x -> x^T)",
           2 * tokens * hidden + (tokens * cdiv(hidden, TILE) + hidden * cdiv(tokens, TILE)) * 4,
           lambda q, s: kern("quantize_along_tokens")(q, None, s),
           lambda q, s: ref.quantize_along_tokens(q, None, s), ("xq", "xs"), "bitwise", True),
    ]
    if streamed:  # the Triton kernel it replaces, side by side
        ops.append(Op("quantize_along_tokens (Triton kernel)", transpose_floor,
                      kern("quantize_along_tokens"), ref.quantize_along_tokens, ("x",),
                      "bitwise", True))
    return ops


def shape_rows(tokens: int, hidden: int, experts: int, repeats: int,
               interpret: bool, only: str = "") -> list[Row]:
    """The measured rows of the ops whose name contains ``only``."""
    label = f"T={tokens} H={hidden} E={experts}"
    inputs = op_inputs(tokens, hidden, experts)
    rows = []
    for op in shape_ops(tokens, hidden, experts, interpret):
        if only in op.name:
            rows += _measured_row(label, op.name, op.floor_bytes,
                                  op.kernel if op.runs else None, op.xla,
                                  [tuple(i[name] for name in op.inputs) for i in inputs],
                                  op.check, repeats)
    return rows


def weight_rows(shape: tuple[int, int, int], repeats: int, interpret: bool) -> list[Row]:
    """quantize_weights of FP32 (G, K, N) weights: floor = 4 bytes read and 2 written (both
    FP8 layouts) per element, plus the block scales."""
    g, k, n = shape
    keys = jax.random.split(jax.random.key(g + k + n), sets_fitting(4 * g * k * n))
    args = [(jax.random.normal(key, shape, jnp.float32),) for key in keys]
    floor = 6 * g * k * n + 4 * g * cdiv(k, TILE) * cdiv(n, TILE)
    kernel = functools.partial(tm.quantize_weights, interpret=interpret)
    return _measured_row(f"W={g}x{k}x{n}", "quantize_weights (FP32 -> FP8 w, w^T)", floor,
                         kernel, ref.quantize_weights, args, "bitwise", repeats)


def expert_rows(shape: tuple[int, int], repeats: int, interpret: bool) -> list[Row]:
    """The FP8 expert rows' (M, I) passes. quantize_rows of BF16 rows (an FP8 linear's
    gradient for its dgrad): floor = 2 bytes read, 1 written an element, plus the scales;
    quantize_both_ways (the gradient for dgrad and wgrad, one group): 2 read, 2 written.
    swiglu_quantize of BF16 gate and up: 4 bytes read and 1 written an element, plus the
    scales; with_inputs writes gate's and up's FP8 copies too (2 bytes more an element,
    and their scales). swiglu_quantize is checked as "rel": Triton's SiLU rounds a few
    BF16 values one ulp off XLA's."""
    rows, cols = shape
    keys = jax.random.split(jax.random.key(rows + cols), sets_fitting(4 * rows * cols))
    args = [tuple(jax.random.normal(k, shape, jnp.bfloat16) * 3 for k in jax.random.split(key))
            for key in keys]
    scales = 4 * rows * cdiv(cols, TILE)
    out = _measured_row(f"M={rows} I={cols}", "quantize_rows (x -> FP8)",
                        3 * rows * cols + scales,
                        functools.partial(tm.quantize_rows, interpret=interpret),
                        ref.quantize_rows, [a[:1] for a in args], "bitwise", repeats)
    one_group = aligned_layout(jnp.asarray([rows], jnp.int32), rows)
    both_ways = {"quantize_both_ways (x -> FP8 x, x^T)":
                 lambda x: tm.quantize_both_ways(x, one_group, interpret=interpret)}
    if mosaic_common.available() and mm.both_ways_applies(shape, jnp.bfloat16):
        both_ways["quantize_both_ways streamed (Mosaic GPU)"] = mm.quantize_both_ways
    for name, kernel in both_ways.items():
        out += _measured_row(f"M={rows} I={cols}", name,
                             4 * rows * cols + scales + 4 * cols * cdiv(rows, TILE), kernel,
                             lambda x: ref.quantize_both_ways(x, one_group),
                             [a[:1] for a in args], "bitwise", repeats)
    for with_inputs, name in ((False, "swiglu_quantize (gate, up -> FP8)"),
                              (True, "swiglu_quantize with_inputs (+ gate, up FP8)")):
        copies = 3 if with_inputs else 1
        floor = (4 + copies) * rows * cols + copies * scales
        kernel = functools.partial(tm.swiglu_quantize, with_inputs=with_inputs,
                                   interpret=interpret)
        xla = functools.partial(ref.swiglu_quantize, with_inputs=with_inputs)
        out += _measured_row(f"M={rows} I={cols}", name, floor, kernel, xla, args, "rel",
                             repeats)
    return out


def _measured_row(label, name, floor, kernel, xla, args, check, repeats) -> list[Row]:
    """One op's row, printed as it lands (the progress line)."""
    row = _measure(label, name, floor, kernel, xla, args, check, repeats)
    print(format_row(row, None), flush=True)
    return [row]


def _measure(label, name, floor, kernel, xla, args, check, repeats) -> Row:
    notes = []

    def timed(fn):
        try:
            return per_call_seconds(fn, args, repeats)
        except Exception as e:  # e.g. out of memory at the largest shape: keep the others
            notes.append(f"failed: {type(e).__name__}: {str(e)[:90]}")
            return None

    xla_s = timed(xla)
    copy_s = same_size_copy_seconds(floor, len(args), repeats)
    if kernel is None:
        return Row(label, name, floor, None, xla_s, "-", copy_s,
                   "FP8 buffer of 2-4 GiB with H not a multiple of 4: routed to the reference")
    kernel_s = timed(kernel)
    verdict = "-"
    if xla_s is not None and kernel_s is not None:
        got, want = jax.jit(kernel)(*args[0]), jax.jit(xla)(*args[0])
        pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        if check == "bitwise":
            verdict = "ok" if all(_bitwise(a, b) for a, b in pairs) else "MISMATCH"
        else:
            errs = [_rel(a, b) for a, b in pairs]
            verdict = (("ok " if max(errs) <= 1e-2 else "MISMATCH ")
                       + "/".join(f"{e:.1e}" for e in errs))
        del got, want, pairs
    return Row(label, name, floor, kernel_s, xla_s, verdict, copy_s, "; ".join(notes))


@contextlib.contextmanager
def patched(module, **attrs) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def unfused_dispatch(x, experts, num_experts, quantize=False):
    """The model's BF16 dispatch before the fused ops: stable argsort, bincount, XLA gather."""
    if quantize:
        raise ValueError("the unfused dispatch is the BF16 path: quantize must be False")
    order = jnp.argsort(experts.reshape(-1), stable=True).astype(jnp.int32)
    sizes = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)
    rows, _ = ref.permute(x.reshape(-1, x.shape[-1]), order, experts.shape[1], quantize=False)
    return model_dispatch.Dispatched(rows, sizes, order)


def unfused_sum_copies(y, order, k):
    """The reference un-sort and sum under plain autodiff (its backward: XLA scatter-adds)."""
    return ref.combine(y, order, jnp.ones((order.shape[0] // k, k), jnp.float32))


def moe_layer(tokens: int, repeats: int, profile_dir: str | None) -> list[dict]:
    """Forward+backward of the routed experts of one `small` MoE layer, fused vs unfused."""
    config = get_model_preset("small")
    h, e, inner = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    ks = jax.random.split(jax.random.key(tokens), 6)
    seq = min(tokens, MOE_SEQ)
    x = jax.random.normal(ks[0], (tokens // seq, seq, h), jnp.bfloat16)
    router = jax.random.normal(ks[1], (h, e), jnp.float32) * 0.05
    weights = ExpertWeights(*(jax.random.normal(kk, shape, jnp.bfloat16) * 0.02 for kk, shape in
                              zip(ks[2:5], ((e, h, inner), (e, h, inner), (e, inner, h)))))
    probe = jax.random.normal(ks[5], x.shape, jnp.float32)
    bias = jnp.zeros((e,), jnp.float32)

    def make_step(*run_experts):  # a fresh function per variant: jit caches per function
        def step(x, router, weights):
            def loss(x, router, weights):
                out = moe.routed_experts_local(x, router, bias, weights, config, *run_experts)
                return jnp.sum(out.y.astype(jnp.float32) * probe)
            return jax.grad(loss, argnums=(0, 1, 2))(x, router, weights)
        return jax.jit(step)

    results = []
    unfused = dict(dispatch=unfused_dispatch, sum_copies=unfused_sum_copies)
    for variant, attrs in (("fused", {}), ("unfused", unfused)):
        with patched(moe, **attrs):
            full = make_step()
            t_full = per_call_seconds(full, [(x, router, weights)], repeats)
            # identity experts (rows weighted, as the experts weight them): movement + router
            bare = make_step(lambda rows, sizes, w, rows_fp8, row_weights:
                             rows * row_weights[:, None].astype(rows.dtype))
            t_bare = per_call_seconds(bare, [(x, router, weights)], repeats)
            split, top = None, None
            if profile_dir:
                trace_dir = f"{profile_dir}/moe_{variant}_{tokens}"
                split = profiling.profile(lambda: full(x, router, weights), trace_dir)
                top = profiling.top_kernels(profiling.load_kernel_events(trace_dir))
        results.append({
            "tokens": tokens, "variant": variant, "layer_ms": 1e3 * t_full,
            "tokens_per_s": tokens / t_full, "identity_experts_ms": 1e3 * t_bare,
            "trace_movement_ms": split.busy_ms["movement"] if split else None,
            "trace_busy_ms": split.total_busy_ms if split else None,
            "trace_busy_by_category_ms": split.busy_ms if split else None,
            "trace_top_kernels": top})
    return results


TUNE = {  # (block_rows, block_cols, num_warps) tried per kernel by --tune
    "permute": [(1, 2048, 4), (2, 2048, 4), (4, 2048, 4), (8, 2048, 4), (16, 2048, 8),
                (4, 1024, 4), (8, 1024, 4), (8, 4096, 8)],
    "combine": [(8, 1024, 4), (4, 2048, 4), (16, 512, 4), (32, 256, 4)],
    "transpose": [(128, 32, 2), (128, 32, 4), (128, 64, 2), (128, 64, 4), (128, 64, 8),
                  (128, 128, 4)],
}


def tune(tokens: int, copy_bw: float, repeats: int) -> None:
    """Times each kernel under each TUNE config at one T, both hidden sizes, over as many
    input sets as the op table uses (one set of a small T would be timed from L2)."""
    print("\n| kernel | H | block_rows x block_cols, warps | us | % copy |\n|---|---|---|---|---|")
    for hidden, experts in PAIRED:
        n = tokens * K
        sets = op_inputs(tokens, hidden, experts)
        cases = [
            ("permute fp8", "permute", 2 * tokens * hidden + n * hidden,
             lambda c: (lambda x, p: tm.permute(x, p, K, quantize=True, cfg=c)), ("x", "perm")),
            ("permute bf16", "permute", 2 * tokens * hidden + 2 * n * hidden,
             lambda c: (lambda x, p: tm.permute(x, p, K, quantize=False, cfg=c)), ("x", "perm")),
            ("combine", "combine", 2 * n * hidden + 2 * tokens * hidden,
             lambda c: functools.partial(tm.combine, cfg=c), ("y", "perm", "w")),
            ("combine_backward", "combine", 2 * tokens * hidden + 4 * n * hidden,
             lambda c: functools.partial(tm.combine_backward, cfg=c), ("x", "y", "perm", "w")),
            ("quantize_along_tokens", "transpose", 3 * tokens * hidden,
             lambda c: functools.partial(tm.quantize_along_tokens, cfg=c), ("x",)),
        ]
        for label, family, nbytes, make, names in cases:
            args = [tuple(s[name] for name in names) for s in sets]
            for rows, cols, warps in TUNE[family]:
                cfg = tm.MoveConfig(rows, cols, warps)
                try:
                    sec = per_call_seconds(make(cfg), args, repeats)
                    print(f"| {label} | {hidden} | {rows}x{cols}, {warps} | {1e6 * sec:.0f} "
                          f"| {100 * nbytes / copy_bw / sec:.0f}% |", flush=True)
                except Exception as e:  # a config Triton refuses is a result too
                    print(f"| {label} | {hidden} | {rows}x{cols}, {warps} | failed: "
                          f"{type(e).__name__} {str(e)[:80]} | |", flush=True)


def _us(s: float | None) -> str:
    return "n/a" if s is None else f"{1e6 * s:.0f}"


def format_row(r: Row, copy_bw: float | None) -> str:
    """A table row; without copy_bw (progress lines) the fractions are left out."""
    floor = r.floor_bytes / copy_bw if copy_bw else None
    pct = lambda s: "n/a" if s is None or floor is None else f"{100 * floor / s:.0f}%"  # noqa: E731
    speed = "n/a" if None in (r.kernel_s, r.xla_s) else f"{r.xla_s / r.kernel_s:.2f}x"
    of_copy = "n/a" if r.kernel_s is None else f"{100 * r.copy_s / r.kernel_s:.0f}%"
    return (f"| {r.shape} | {r.op} | {_us(floor)} | {_us(r.kernel_s)} | {pct(r.kernel_s)} "
            f"| {_us(r.xla_s)} | {pct(r.xla_s)} | {speed} | {_us(r.copy_s)} | {of_copy} "
            f"| {r.check} {r.note} |")


def print_tables(copy_bw: float, rows: list[Row], layers: list[dict]) -> None:
    print(f"\ncopy bandwidth (x * 1.5, 1 GiB bf16, read + write): {copy_bw / 1e9:.0f} GB/s")
    print("\n| shape | op | floor us | kernel us | kernel % copy | XLA us | XLA % copy "
          "| XLA / kernel | same-size copy us | kernel % same-size copy | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(format_row(r, copy_bw))
    if not layers:
        return
    print("\n| MoE layer fwd+bwd (small) | tokens | ms | tokens/s | without expert FFN ms "
          "| share (timed) | trace movement ms | trace busy ms | share (trace) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in layers:
        trace = d["trace_movement_ms"]
        share = "-" if trace is None else f"{100 * trace / d['trace_busy_ms']:.0f}%"
        print(f"| {d['variant']} | {d['tokens']} | {d['layer_ms']:.2f} | {d['tokens_per_s']:,.0f} "
              f"| {d['identity_experts_ms']:.2f} "
              f"| {100 * d['identity_experts_ms'] / d['layer_ms']:.0f}% "
              f"| {'-' if trace is None else f'{trace:.2f}'} "
              f"| {'-' if trace is None else '%.2f' % d['trace_busy_ms']} | {share} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=4096 only, one MoE size")
    parser.add_argument("--tokens", type=cli.integers(1), default=",".join(map(str, TOKENS)),
                        help="'' to skip the per-op table")
    parser.add_argument("--crossed", action="store_true",
                        help="every (H, E) pair, not only V3's and V2-Lite's (E changes only "
                             "the sort: the data passes move the same bytes)")
    parser.add_argument("--interpret", action="store_true",
                        help="kernels in Pallas interpret mode (a CPU smoke run at tiny --tokens)")
    parser.add_argument("--repeats", type=cli.integer(1), default=10)
    parser.add_argument("--weights", type=cli.shapes("GxKxN"), default=WEIGHT_SHAPES,
                        help="GxKxN weight stacks for quantize_weights ('' to skip)")
    parser.add_argument("--swiglu", type=cli.shapes("MxI"), default=SWIGLU_SHAPES,
                        help="MxI expert rows for quantize_rows and swiglu_quantize ('' to skip)")
    parser.add_argument("--moe-tokens", type=cli.integers(1), default="8192,32768",
                        help="'' to skip the MoE layer")
    parser.add_argument("--profile", default=None, help="trace dir for the MoE layer split")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tune", action="store_true", help="sweep kernel tile configs first")
    parser.add_argument("--tune-tokens", type=cli.integer(1), default=16384,
                        help="T of the --tune sweep")
    parser.add_argument("--only", default="", help="the ops whose name contains this text")
    args = parser.parse_args(argv)
    names = [op.name for op in shape_ops(TOKENS[0], *PAIRED[-1], args.interpret)]
    if not any(args.only in name for name in names):
        parser.error(f"--only {args.only!r}: no op's name contains it; the ops: {names}")
    ragged = [t for t in args.moe_tokens if t > MOE_SEQ and t % MOE_SEQ]
    if ragged:  # the layer runs whole sequences: the remainder was dropped, yet counted
        parser.error(f"--moe-tokens {ragged[0]}: must be <= {MOE_SEQ} or a multiple of "
                     f"{MOE_SEQ} (the MoE layer runs sequences of {MOE_SEQ} tokens)")
    if jax.default_backend() != "gpu" and not args.interpret:  # else every row fails
        parser.error(f"--interpret not given, and this process runs on "
                     f"{jax.default_backend()}: the compiled kernels need a GPU; pass "
                     "--interpret (Pallas interpret mode, a smoke run at tiny --tokens)")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"backend {pk.backend()}", flush=True)
    copy_bw = copy_bandwidth(args.repeats)
    if args.tune:
        tune(args.tune_tokens, copy_bw, args.repeats)
    rows: list[Row] = []
    for tokens in args.tokens[:1 if args.quick else None]:
        for hidden, experts in CROSSED if args.crossed else PAIRED:
            rows += shape_rows(tokens, hidden, experts, args.repeats, args.interpret,
                               args.only)
            print(f"done T={tokens} H={hidden} E={experts}", flush=True)
    for shape in args.weights:
        rows += weight_rows(shape, args.repeats, args.interpret)
    for shape in args.swiglu:
        rows += expert_rows(shape, args.repeats, args.interpret)
    layers = [d for t in args.moe_tokens[:1 if args.quick else None]
              for d in moe_layer(t, args.repeats, args.profile)]
    copy_bw = max(copy_bw, copy_bandwidth(args.repeats))  # again, with the clocks up
    print_tables(copy_bw, rows, layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBps": copy_bw / 1e9, "rows": [dataclasses.asdict(r) for r in rows],
                       "moe_layer": layers}, f, indent=1)


if __name__ == "__main__":
    main()

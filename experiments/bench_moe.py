"""One MoE layer over the ``expert`` mesh axis: forward+backward, the token exchange alone,
and XLA's plain all_to_all on the same bytes, side by side in one run.

    python -m experiments.bench_moe                          # every expert size the GPUs allow
    python -m experiments.bench_moe --expert 1,2 --tokens-per-device 16384 --profile /tmp/moe

Several processes (one GPU each) join with ``jax.distributed``, e.g. on one 2-GPU host:

    for i in 0 1; do
      python -m experiments.bench_moe --coordinator localhost:12355 --num-processes 2 \\
          --process-id $i --local-device-ids $i &
    done; wait

(across processes the default transport is padded: the ragged one, with
``XLA_FLAGS=--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true``, hung on 2
H200). Every process builds the same inputs from the same seeds and contributes its own
shards of them.

Weak scaling: tokens per device stay fixed as ``expert`` grows. Bytes of the exchange are
the routed copies each device sends and receives (T*k*H*itemsize each way, twice: dispatch
and combine; an FP8 dispatch moves T*k*(H + 4H/128) bytes); the raw all_to_all moves the
compute-dtype buffer once each way. With
``--profile`` the layer's device time is split from a trace (``moejax.profiling``): busy time
of communication, GEMM and data-movement kernels, and the communication left exposed (no
other kernel running beside it), and the device's idle time inside the call (its wall time
less the union of its kernels: host round trips and launch gaps); each row is followed
by the kernels with the most device time in one call.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments import cli
from moejax.config import get_model_preset
from moejax.model.expert_ffn import ExpertWeights
from moejax.model.moe import MoE
from moejax.parallel.expert import (EXPERT_AXIS, ExpertParallelOptions, expert_parallel_moe,
                                    expert_parallel_options)
from moejax import profiling
from moejax.parallel import distributed
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.precision import PRECISIONS, Precision


PROFILED_CALLS = 3  # layer calls in each --profile trace


def _identity_experts(rows, group_sizes, weights, rows_fp8,  # noqa: ARG001 - RunExperts
                      row_weights):
    return rows


def _global(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds alike: each process places
    only its own devices' shards (no cross-process transfer, unlike ``device_put``)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def bench_one(expert: int, transport: str, token_format: str,
              args: argparse.Namespace) -> dict[str, float]:
    devices = jax.device_count()
    mesh = build_mesh(MeshSpec(data=devices // expert, expert=expert))
    config = get_model_preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    layer = MoE(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                precision=Precision(args.precision))
    graphdef, params = nnx.split(layer)
    seqs = args.tokens_per_device // args.seq_len * devices
    rng = np.random.default_rng(1)
    x = rng.standard_normal((seqs, args.seq_len, config.hidden_size), np.float32).astype(dtype)
    with jax.set_mesh(mesh), expert_parallel_options(
            ExpertParallelOptions("auto" if transport == "-" else transport,
                                  token_format=token_format)):
        x = _global(x, NamedSharding(mesh, P(("data", EXPERT_AXIS))))
        replicated = NamedSharding(mesh, P())
        params = jax.tree.map(lambda a: _global(np.asarray(a), replicated), params)
        bias = _global(np.zeros((config.n_routed_experts,), np.float32), replicated)

        @jax.jit
        def fwd_bwd(params, x):
            def loss(params, x):
                y, _ = nnx.merge(graphdef, params)(x, bias)
                return jnp.sum(y.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1))(params, x)

        @jax.jit
        def exchange(params, x):
            weights = ExpertWeights(params["gate_proj"][...], params["up_proj"][...],
                                    params["down_proj"][...])
            return expert_parallel_moe(x, params["router"][...], bias, weights, config,
                                       run_experts=_identity_experts)[0]

        k, hidden = config.num_experts_per_tok, config.hidden_size
        rows = args.tokens_per_device * k
        buffer = _global(np.ones((devices * rows, hidden), dtype),
                         NamedSharding(mesh, P(("data", EXPERT_AXIS))))
        raw = jax.jit(jax.shard_map(
            lambda b: jax.lax.all_to_all(b, EXPERT_AXIS, 0, 0, tiled=True),
            in_specs=P(("data", EXPERT_AXIS)), out_specs=P(("data", EXPERT_AXIS))))
        t_layer = profiling.median_seconds(lambda: fwd_bwd(params, x), args.repeats)
        t_exchange = t_raw = float("nan")
        if expert > 1:  # in turn, so their ratio reads one window of the links
            t = profiling.interleaved_median_seconds(
                {"exchange": lambda: exchange(params, x), "raw": lambda: raw(buffer)},
                2 * args.repeats)
            t_exchange, t_raw = t["exchange"], t["raw"]
        split, top = None, []
        if args.profile and jax.default_backend() != "cpu":
            trace_dir = f"{args.profile}/expert{expert}_{transport}_{token_format}"
            split = profiling.profile(lambda: fwd_bwd(params, x), trace_dir, PROFILED_CALLS)
            events = profiling.load_kernel_events(trace_dir)
            first = min(e.device for e in events)  # the device the split is of
            top = [(name, category, us / PROFILED_CALLS) for name, category, us in
                   profiling.top_kernels([e for e in events if e.device == first], 10)]
    bytes_one_way = rows * hidden * dtype.itemsize  # per device, what combine sends back
    # FP8 dispatch sends one byte per element plus a 4-byte scale per 128 of them
    dispatch_bytes = (rows * (hidden + 4 * -(-hidden // 128)) if token_format == "fp8"
                      else bytes_one_way)
    nan = float("nan")
    return {
        "expert": expert, "transport": transport if expert > 1 else "-",
        "tokens": token_format if expert > 1 else "-",
        "layer_ms": 1e3 * t_layer,
        "comm_ms": split.busy_ms["communication"] if split else nan,
        "gemm_ms": split.busy_ms["gemm"] if split else nan,
        "movement_ms": split.busy_ms["movement"] if split else nan,
        "exposed_comm_ms": split.exposed_communication_ms if split else nan,
        "idle_ms": 1e3 * t_layer - split.total_busy_ms if split else nan,
        "tokens_per_s_per_device": args.tokens_per_device / t_layer,
        "exchange_ms": 1e3 * t_exchange, "raw_a2a_ms": 1e3 * t_raw,
        # dispatch + combine move the copies twice; the raw all_to_all moves them once
        "exchange_GBps": (dispatch_bytes + bytes_one_way) / t_exchange / 1e9,
        "raw_a2a_GBps": bytes_one_way / t_raw / 1e9,
        "top_kernels": top,
    }


def measure_and_print(sizes: list[int], transports: list[str], formats: list[str],
                     args: argparse.Namespace) -> None:
    """Runs every configuration and prints its row as soon as it is measured (process 0),
    so a run cut off by a time limit still reports what it finished."""
    lead = jax.process_index() == 0
    if lead:
        print(f"# {jax.devices()[0].device_kind} x{jax.device_count()}, "
              f"{jax.process_count()} process(es), preset {args.preset}, "
              f"{args.tokens_per_device} tokens/device, {args.dtype} compute, "
              f"{args.precision} expert GEMMs")
        print(f"{'expert':>6} {'transport':>9} {'tokens':>7} {'layer ms':>9} {'tok/s/dev':>11} "
              f"{'vs first':>8} {'exch ms':>8} {'exch GB/s':>9} {'raw a2a GB/s':>12} "
              f"{'exch/raw':>8} {'comm ms':>8} {'gemm ms':>8} {'move ms':>8} {'exposed':>8} "
              f"{'idle ms':>8}",
              flush=True)
    base = None
    for e in sizes:
        for t, f in ([(t, f) for t in transports for f in formats] if e > 1 else [("-", "compute")]):
            print(f"[process {jax.process_index()}] expert={e} transport={t} tokens={f} ...",
                  file=sys.stderr, flush=True)
            r = bench_one(e, t, f, args)
            base = base or r["tokens_per_s_per_device"]
            if lead:
                print(f"{r['expert']:>6} {r['transport']:>9} {r['tokens']:>7} "
                      f"{r['layer_ms']:>9.2f} {r['tokens_per_s_per_device']:>11.0f} "
                      f"{r['tokens_per_s_per_device'] / base:>8.2f} {r['exchange_ms']:>8.2f} "
                      f"{r['exchange_GBps']:>9.4g} {r['raw_a2a_GBps']:>12.4g} "
                      f"{r['exchange_GBps'] / r['raw_a2a_GBps']:>8.2f} {r['comm_ms']:>8.2f} "
                      f"{r['gemm_ms']:>8.2f} {r['movement_ms']:>8.2f} "
                      f"{r['exposed_comm_ms']:>8.2f} {r['idle_ms']:>8.2f}", flush=True)
                for name, category, us in r["top_kernels"]:
                    print(f"#   {us:>8.1f} us/call  {category:<13} {name}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset whose MoE shapes to use")
    parser.add_argument("--expert", default="", help="comma list of expert axis sizes "
                        "(default: 1, 2, 4, ... up to the device count)")
    parser.add_argument("--tokens-per-device", type=cli.integer(1), default=8192)
    parser.add_argument("--seq-len", type=cli.integer(1), default=1024)
    parser.add_argument("--dtype", type=cli.float_dtype, default="bfloat16")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS,
                        help="expert GEMMs: bf16, or fp8 (FP8 tokens then feed the FP8 GEMMs "
                        "as they arrived)")
    parser.add_argument("--transports", default="",
                        help="comma list of ragged,padded (default: both in one GPU process, "
                        "padded on CPU or across processes, where ragged hung: README)")
    parser.add_argument("--token-formats", default="",
                        help="comma list of compute,fp8 (default: both on GPU, compute on CPU)")
    parser.add_argument("--profile", default="", help="directory for jax.profiler traces of "
                        "the layer; adds the device-time split (GPU only)")
    parser.add_argument("--repeats", type=cli.integer(1), default=10)
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    cli.checked(parser, lambda: get_model_preset(args.preset), "--preset")
    cli.checked(parser, lambda: cli.join_run(args))
    devices = jax.device_count()
    try:
        sizes = ([int(s) for s in args.expert.split(",")] if args.expert
                 else [e for e in (1, 2, 4, 8, 16, 32, 64) if e <= devices and devices % e == 0])
    except ValueError:
        parser.error(f"--expert {args.expert!r}: expected a comma list of integers, e.g. 1,2,4")
    if bad := [e for e in sizes if e < 1 or devices % e]:
        parser.error(f"--expert {args.expert}: {bad} do not divide the {devices} devices "
                     "(each size runs on a mesh of data = devices / expert)")
    if args.tokens_per_device % args.seq_len:
        parser.error(f"--tokens-per-device {args.tokens_per_device} must be a multiple of "
                     f"--seq-len {args.seq_len}")
    padded_only = jax.default_backend() == "cpu" or jax.process_count() > 1
    transports = (args.transports.split(",") if args.transports
                  else ["padded"] if padded_only else ["ragged", "padded"])
    for t in transports:
        if t not in ("ragged", "padded"):
            parser.error(f"--transports: {t!r} is not one of ragged, padded")
    formats = (args.token_formats.split(",") if args.token_formats
               else ["compute"] if jax.default_backend() == "cpu" else ["compute", "fp8"])
    for f in formats:
        if f not in ("compute", "fp8"):
            parser.error(f"--token-formats: {f!r} is not one of compute, fp8")
    measure_and_print(sizes, transports, formats, args)


if __name__ == "__main__":
    main()

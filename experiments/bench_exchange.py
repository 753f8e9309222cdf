"""The expert exchange's collectives alone, side by side in one run: XLA's all_to_all and
``ragged_all_to_all`` moving the same rows, with the ragged one cut into one slice per peer
or many (as the MoE layer cuts one per expert), and both again on a one-column payload
(the per-call cost when bytes are ~0).

    python -m experiments.bench_exchange                     # all devices on the expert axis
    python -m experiments.bench_exchange --rows 49152 --width 1024 --slices 1,32

Why: the MoE layer's exchange reaches 32-47% of the raw all_to_all on two H100s
(docs/performance.md), and XLA's NCCL path of ``ragged_all_to_all`` reads its offsets on
the host before every call and sends one message per slice. Each case runs ``--chain``
exchanges back to back in one jit (each feeding the next), so a per-call host round trip
shows up as device idle time (wall less the union of the kernels, from a trace) rather
than hiding behind the launch of the next call. Read the device-busy columns: on two
H100s the wall-clock rate of one case varied 137-171 GB/s between runs, its busy time by 1%.
A collective's kernel also counts as busy while it waits for its peers, so across processes
(each tracing only itself) busy can exceed wall time.
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax import profiling
from moejax.parallel import distributed
from moejax.parallel.expert import EXPERT_AXIS, cut_into_pieces
from moejax.parallel.mesh import MeshSpec, build_mesh


def ragged_exchange(x: jax.Array, ep: int, slices_per_peer: int) -> jax.Array:
    """``ragged_all_to_all`` of this device's rows, ``rows/ep`` to each peer, each peer's
    share cut into ``slices_per_peer`` pieces as the MoE layer cuts its slices
    (``cut_into_pieces``), landing in the block the receiver holds for this sender,
    inside a ``shard_map`` over ``expert``."""
    share = x.shape[0] // ep
    starts = jnp.arange(ep, dtype=jnp.int32) * share
    within, sizes = cut_into_pieces(jnp.full((ep,), share, jnp.int32), slices_per_peer)
    land = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32) * share
    return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x),
                                     jnp.repeat(starts, slices_per_peer) + within, sizes,
                                     land + within, sizes, axis_name=EXPERT_AXIS)


def dense_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0, tiled=True)


def chained(exchange, chain: int):
    """``chain`` exchanges in a row, each moving what the one before received."""
    def run(x):
        for _ in range(chain):
            x = exchange(x)
        return x
    return run


def measure(mesh, exchange, shape: tuple[int, int], dtype, args) -> dict[str, float]:
    spec = P(EXPERT_AXIS)
    fn = jax.jit(jax.shard_map(chained(exchange, args.chain), mesh=mesh, in_specs=spec,
                               out_specs=spec))
    devices = mesh.devices.size
    host = np.random.default_rng(0).standard_normal((devices * shape[0], shape[1]))
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                     lambda index: host[index].astype(dtype))
    expect = chained(lambda h: h.reshape(devices, devices, -1, shape[1]).swapaxes(0, 1)
                     .reshape(host.shape), args.chain)(host.astype(dtype))
    got = np.asarray(jax.device_get(fn(x))) if jax.process_count() == 1 else None
    if got is not None and not np.array_equal(got, expect):
        raise AssertionError("the exchange did not move the rows where a transpose of the "
                             "(sender, receiver) blocks puts them")
    wall = profiling.median_seconds(lambda: fn(x), args.repeats) / args.chain
    busy, kernels = float("nan"), []
    if jax.default_backend() != "cpu":
        with tempfile.TemporaryDirectory() as log_dir:
            busy = profiling.profile(lambda: fn(x), log_dir).total_busy_ms / 1e3 / args.chain
            kernels = profiling.top_kernels(profiling.load_kernel_events(log_dir), 2)
    nbytes = shape[0] * shape[1] * jnp.dtype(dtype).itemsize
    moved = nbytes * (devices - 1) / devices  # what leaves the device
    return {"ms": 1e3 * wall, "busy_ms": 1e3 * busy, "idle_ms": 1e3 * (wall - busy),
            "GBps": moved / wall / 1e9, "busy_GBps": moved / busy / 1e9,
            "kernels": "; ".join(name[:48] for name, _, _ in kernels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=49152,
                        help="rows each device sends (default: 8192 tokens x top-6)")
    parser.add_argument("--width", type=int, default=1024, help="row width (hidden size)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--slices", default="1,32",
                        help="comma list of slices per peer for the ragged exchange")
    parser.add_argument("--chain", type=int, default=4, help="exchanges per timed call")
    parser.add_argument("--repeats", type=int, default=10)
    distributed.add_arguments(parser)
    args = parser.parse_args()
    distributed.initialize(args)
    ep = jax.device_count()
    slices = [int(s) for s in args.slices.split(",")]
    for s in slices:
        if s < 1 or args.rows % (ep * s):
            parser.error(f"--rows {args.rows} must split into {ep} peers x {s} slices")
    mesh = build_mesh(MeshSpec(expert=ep))
    ragged_ok = jax.default_backend() != "cpu"
    cases = [("all_to_all", "-", dense_exchange)] + (
        [("ragged", str(s), lambda x, s=s: ragged_exchange(x, ep, s)) for s in slices]
        if ragged_ok else [])
    lead = jax.process_index() == 0
    if lead:
        print(f"# {jax.devices()[0].device_kind} x{ep}, {jax.process_count()} process(es), "
              f"{args.rows} rows/device, chain {args.chain}"
              + ("" if ragged_ok else "; ragged_all_to_all: not on XLA:CPU"))
        print(f"{'payload':>16} {'collective':>10} {'slices':>6} {'ms/call':>8} "
              f"{'GB/s':>8} {'busy ms':>8} {'busy GB/s':>9} {'idle ms':>8}  kernels (most device "
              "time)", flush=True)
    payloads = [(f"{args.width} x {args.dtype}", (args.rows, args.width), args.dtype),
                ("1 x float32", (args.rows, 1), "float32")]
    for label, shape, dtype in payloads:
        for name, s, exchange in cases:
            r = measure(mesh, exchange, shape, jnp.dtype(dtype), args)
            if lead:
                print(f"{label:>16} {name:>10} {s:>6} {r['ms']:>8.3f} {r['GBps']:>8.1f} "
                      f"{r['busy_ms']:>8.3f} {r['busy_GBps']:>9.1f} {r['idle_ms']:>8.3f}  "
                      f"{r['kernels']}", flush=True)


if __name__ == "__main__":
    main()

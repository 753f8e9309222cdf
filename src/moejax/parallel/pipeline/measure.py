"""Timing the executor on real devices: step time, per-tick bubble, and the F&B overlap.

Used by ``experiments/pipeline_study.py``. Every number here is a wall-clock or a trace
measurement of compiled code (compiled and run once before timing), never a model.

- :func:`measure_schedule`: the step (median of repeats of ``PipelineExecutor.timed_step``'s
  chain of programs, whose tick loop takes its bounds as arguments) and, from a run that
  waits after every tick of the same compiled loop, each tick's time. A rank's measured
  bubble is the time of the ticks in which it runs no F or B, over the sum of tick times
  (lock-step ticks hide the imbalance inside a tick, so this is a lower bound of its idle
  time).
- :func:`fb_pair`: one F&B pair of two micro-batches through the model's MoE blocks on a
  mesh without ``pipe`` (e.g. ``expert=2``): the forward of micro-batch A interleaved
  piece by piece with the backward of micro-batch B (``fb_pair.run_pair``) in each of
  its orders, the sequential one the baseline. With a profile directory, busy, compute
  and exposed communication time of each come from the trace (``moejax.profiling``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ModelConfig, get_model_preset
from moejax.model import DeepseekV3, RouterBias
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.parallel.pipeline.executor import PipelineExecutor
from moejax.parallel.pipeline.fb_pair import ORDERS, Stack, run_pair, stack_specs
from moejax.parallel.pipeline.placement import PIPE_AXIS
from moejax.parallel.pipeline.schedule import build
from moejax.parallel.pipeline.storage import pad_stacks
from moejax.parallel.sharding import (ZeroStage, batch_sharding, mesh_batch_axes,
                                      state_shardings)
from moejax.profiling import exposed_share, load_kernel_events, median_seconds, profile

MTP_LAMBDA = 0.3


class Problem(NamedTuple):
    config: ModelConfig
    dtype: jnp.dtype
    graphdef: nnx.GraphDef
    params: nnx.State
    biases: nnx.State
    tokens: jax.Array  # (B, S+1)


def make_problem(preset: str, layers: int, batch: int, seq: int, dtype: str,
                 seed: int = 0) -> Problem:
    """A freshly initialised model of ``preset`` with ``layers`` layers, random tokens."""
    config = dataclasses.replace(get_model_preset(preset), num_hidden_layers=layers)
    compute = jnp.dtype(dtype)
    graphdef, params, biases = nnx.split(
        DeepseekV3(config, rngs=nnx.Rngs(seed), dtype=compute), nnx.Param, RouterBias)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0,
                                config.vocab_size)
    return Problem(config, compute, graphdef, params, biases, tokens)


class Measured(NamedTuple):
    step_s: float  # median wall time of the whole jitted step
    tick_s: tuple[float, ...]  # each tick's wall time (host waits after each)
    bubble_fraction: tuple[float, ...]  # per rank: idle ticks' time / all ticks' time
    loss: float
    layers_held: tuple[int, ...]  # per rank: layer rows its stages hold during the step
    act_entries: tuple[int, ...]  # per rank: stage inputs its activation buffer holds
    # per rank, the most any of its devices has held since the process began (bytes;
    # None where the backend keeps no statistics, e.g. XLA:CPU)
    peak_bytes: tuple[int, ...] | None
    # per device, from the traced step (None without a profile): the time all_to_all
    # kernels ran with no compute kernel beside them, as a share of the step
    exposed_all_to_all: tuple[float, ...] | None = None


def _peak_bytes(mesh: jax.sharding.Mesh) -> tuple[int, ...] | None:
    """Per ``pipe`` rank, the largest ``peak_bytes_in_use`` of its devices."""
    pipe = mesh.axis_names.index(PIPE_AXIS)
    by_rank: dict[int, int] = {}
    for index, device in np.ndenumerate(mesh.devices):
        stats = device.memory_stats()
        if stats is None or "peak_bytes_in_use" not in stats:
            return None
        by_rank[index[pipe]] = max(by_rank.get(index[pipe], 0), stats["peak_bytes_in_use"])
    return tuple(by_rank[r] for r in sorted(by_rank))


def placed(problem: Problem, mesh: jax.sharding.Mesh, zero: ZeroStage
           ) -> tuple[nnx.State, nnx.State, jax.Array]:
    """The problem's parameters (stacks padded for the pipe), router biases and tokens where
    training keeps them on ``mesh``. Left on the default device, every call of the step
    re-sent them to the others first: on one rank of ``expert=2`` that was 53 peer copies
    (11.5 ms) of the 278 ms step session 41 timed (docs/performance.md, session 42)."""
    params = pad_stacks(problem.params, problem.config, dict(mesh.shape)[PIPE_AXIS])
    return (jax.device_put(params, state_shardings(params, mesh, zero)),
            jax.device_put(problem.biases, NamedSharding(mesh, P())),
            jax.device_put(problem.tokens, batch_sharding(mesh)))


def measure_schedule(problem: Problem, name: str, mesh: MeshSpec, microbatches: int,
                     repeats: int = 5, profile_dir: pathlib.Path | None = None,
                     pair_pieces: bool = True,
                     log: Callable[[str], None] = lambda line: print(line, flush=True),
                     ) -> Measured:
    """Runs schedule ``name`` over ``mesh`` (its ``pipe`` axis = ranks) on ``problem``,
    with the executor's F&B ticks piece by piece or not (``pair_pieces``)."""
    devices = jax.devices()[:mesh.size]
    executor = PipelineExecutor(build(name, mesh.pipe, microbatches), problem.graphdef,
                                problem.config, problem.dtype, MTP_LAMBDA, pair_pieces)
    start = time.perf_counter()
    device_mesh = build_mesh(mesh, devices)
    with jax.set_mesh(device_mesh):
        result, step_s, ticks = executor.timed_step(
            *placed(problem, device_mesh, executor.zero_stage), repeats,
            None if profile_dir is None else str(profile_dir / name))
    log(f"  {name}: step {step_s * 1e3:.2f} ms, ticks timed ({time.perf_counter() - start:.0f} s "
        "with compile)")
    total = sum(ticks)
    bubbles = tuple(sum(t for t, idle in zip(ticks, executor.idle_ticks(r)) if idle) / total
                    for r in range(mesh.pipe))
    held = tuple(sum(len(s.held[r]) for s in executor.placement.stacks.values())
                 for r in range(mesh.pipe))
    exposed = None  # without a profile, or where its trace has no kernels (XLA:CPU)
    if profile_dir is not None:
        exposed = tuple(exposed_share(load_kernel_events(profile_dir / name)).values()) or None
    return Measured(step_s, tuple(ticks), bubbles, float(result.total), held,
                    executor.tables.act_entries, _peak_bytes(device_mesh), exposed)


class OrderResult(NamedTuple):
    """One way of running the pair's pieces (``fb_pair.ORDERS``)."""

    wall_s: float  # median wall time of one pair
    busy_ms: float | None  # device busy time per pair (trace; None without a profile)
    exposed_comm_ms: float | None  # communication under no compute, per pair (trace)
    compute_ms: float | None  # time with a non-communication kernel running (trace)


def fb_pair(problem: Problem, mesh: MeshSpec, repeats: int = 10,
            profile_dir: pathlib.Path | None = None,
            orders: tuple[str, ...] = ORDERS,
            log: Callable[[str], None] = lambda line: print(line, flush=True),
            ) -> dict[str, OrderResult]:
    """Times an F&B pair of the model's MoE blocks on ``mesh`` (no pipe axis): the forward
    of micro-batch A (first half of ``problem.tokens``) with the backward of micro-batch B
    (second half; its residuals from its own forward, run beforehand), in each of
    ``orders`` (``free``: pieces interleaved in program order, no barriers; ``lockstep``:
    barriers between steps; ``sequential``: one chunk after the other). With
    ``profile_dir``, each order is traced too."""
    config = problem.config
    model = nnx.merge(problem.graphdef, problem.params, problem.biases)
    graphdef, blocks = nnx.split(model.moe_blocks)
    stack = Stack(blocks, model.router_bias[...][:config.num_moe_layers])
    h = model.embed(problem.tokens[:, :-1])
    half = h.shape[0] // 2
    h_a, h_b = h[:half], h[half:]
    d_h = 1e-3 * jax.random.normal(jax.random.key(0), h_b.shape, h_b.dtype)
    d_balance = jnp.full((config.num_moe_layers,), config.aux_loss_alpha, jnp.float32)

    def chunks(order: str):
        return jax.jit(lambda stack, h_a, saved, d_h, d_balance: run_pair(
            graphdef, config, forward=(stack, h_a), backward=(stack, saved, d_h, d_balance),
            order=order))

    results = {}
    device_mesh = build_mesh(mesh, jax.devices()[:mesh.size])
    with jax.set_mesh(device_mesh):
        # Where run_pair takes them: left on the default device, every timed call would
        # first re-send them (as ``placed`` says for the executor's step).
        sharded = lambda spec: NamedSharding(device_mesh, spec)  # noqa: E731
        stack = jax.device_put(stack, jax.tree.map(sharded, stack_specs(stack),
                                                   is_leaf=lambda x: isinstance(x, P)))
        h_a, h_b, d_h = jax.device_put((h_a, h_b, d_h), sharded(P(mesh_batch_axes())))
        d_balance = jax.device_put(d_balance, sharded(P()))
        saved = jax.jit(lambda stack, h: run_pair(graphdef, config, forward=(stack, h))[0]
                        .saved)(stack, h_b)
        log("  micro-batch B's forward done (its residuals feed the backward chunk)")
        for order in orders:
            run = (lambda f=chunks(order): f(stack, h_a, saved, d_h, d_balance))
            start = time.perf_counter()
            wall = median_seconds(run, repeats)
            log(f"  {order}: {wall * 1e3:.2f} ms per pair ({time.perf_counter() - start:.0f} s "
                "with compile)")
            busy = exposed = compute = None
            if profile_dir is not None:
                try:
                    split = profile(run, profile_dir / f"fb_pair_{order}")
                    busy, exposed = split.total_busy_ms, split.exposed_communication_ms
                    compute = split.compute_ms
                except ValueError:  # no accelerator kernels in the trace (CPU)
                    pass
                log(f"  {order}: traced ({time.perf_counter() - start:.0f} s so far)")
            results[order] = OrderResult(wall, busy, exposed, compute)
    return results

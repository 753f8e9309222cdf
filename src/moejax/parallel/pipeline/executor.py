"""Runs a pipeline schedule on the real model's stages: jit + shard_map over the mesh.

The static schedule becomes per-tick tables (:mod:`.tables`: every op takes one lock-step
tick, data sent in tick t is usable in tick t+1, buffer entries allocated ahead). Inside
one ``jax.shard_map`` manual over every mesh axis (``pipe`` and the batch axes ``data``,
``expert``), each device reads its row of the tables with ``rank = lax.axis_index('pipe')``
and a ``lax.scan`` walks the ticks. A tick runs one ``lax.switch`` over the tick
*programs* that occur in the schedule: each program is a static pair (shape of the F
stage or none, shape of the B stage or none), see :class:`Work`, so an F&B tick is one
straight-line computation holding both chunks, with no nested conditional between them.

Per device. Each device holds its share of every micro-batch (the batch split over ``data``
x ``expert``) and its own routed experts; the MoE layers see that their axes are already
manual and run their per-device bodies as they are (``sharding.per_device``), their
collectives included (the expert exchange, the routing totals), and the fused head scans
this device's rows and ``pmean``s the loss. The held parameters are typed as varying over
every axis right after the fetch, so each tick's backward leaves this device's partial
gradients and no collective over the batch axes sits in a tick: the transposes of that
typing and of the step's one ZeRO-3 all-gather, applied once when the step ends, sum them
over ``data`` and ``expert`` (a reduce-scatter over ``data`` where the parameter is stored
in shards; and over ``pipe`` for the parameters every rank holds whole). Left to the
partitioner (manual over ``pipe`` only), every B tick all-reduced its gradients at once: on
one rank of ``expert=4`` the executor ran at about a third of the whole-batch step's
tokens/s (session 39).

- F: the stage's forward (``stages.stage_forward``) on its input from the activation
  buffer (stage rows picked by traced local offsets);
- B: ``jax.vjp`` of the same stage function, recomputing the forward from the saved stage
  input (no residuals kept across ticks), with cotangents ``(grad buffer entry, 1/M)``: the
  1/M seeds the stage's share of the mean loss; it frees both entries;
- then four ``lax.ppermute`` over ``pipe`` (activations and input-gradients, each to the
  right and to the left neighbour); the receiving rank's tables say which buffer entry, if
  any, each arrival fills. Transfers between two stages of one rank (the V's bottom in
  DualPipeV) are plain buffer writes.

Memory. The buffers have the entries the schedule keeps in flight on the busiest rank
(``TickTables.buffer_sizes``: at most its activation bound + 1, one input waiting for its
F), each one micro-batch's stage input (this device's rows of it). Parameters are stored
as the normal model tree, stacked layers split over ``pipe``; the step gathers ZeRO-3
shards over ``data`` once (routed experts stay split over ``expert``), and before
the first tick each rank fetches the rows of its own stages (:mod:`.placement`: 1x the
layers over the pipe for GPipe, 1F1B and DualPipeV, 2x for DualPipe); after the last one
the fetch's VJP returns their gradients to where they are stored. Router counts sum over
micro-batches and stages; losses are means over micro-batches, so they equal the
unpipelined step's.

W chunks run nothing: a B computes its weight gradients at once, so a W tick is idle time.

F&B overlap. In an F&B tick the F of one micro-batch and the B of another share no data
(different buffer entries, different tokens) and sit in one branch of the tick's switch:
one HLO computation, where the only order XLA must keep is each chain's own. XLA's
latency-hiding scheduler (GPU: ``--xla_gpu_enable_latency_hiding_scheduler``) may then
issue one chain's ``all_to_all``/``ragged_all_to_all`` while the other chain's matmuls
run. Two separate conditionals would not do: a conditional is one instruction to the
scheduler, so their bodies could never interleave. When both stages have MoE blocks and
the mesh has an ``expert`` axis (there is an exchange to hide), the tick runs them piece
by piece (:mod:`.paired`: attention / dispatch / experts / combine, ``fb_pair``'s
``free`` order, B's recompute keeping the pieces' pullbacks); ``pair_pieces=False`` or no
expert axis run the two whole stage functions side by side instead.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from pallas_kernels.varying import mark_varying, varying_axes

from moejax.config import ConfigError, ModelConfig
from moejax.model import DeepseekV3, ModelLosses
from moejax.parallel.expert import expert_axis_size, varying_over
from moejax.parallel.pipeline.paired import Chunk, fb_tick, pairs_pieces
from moejax.parallel.pipeline.placement import PIPE_AXIS, ParamPlacement, sum_over_pipe
from moejax.parallel.pipeline.storage import map_leaves
from moejax.parallel.pipeline.schedule import Schedule
from moejax.parallel.pipeline.stages import (StagePlan, StageRows, StageShape, StageStats,
                                             add_stats, stage_forward)
from moejax.parallel.sharding import (ZeroStage, check_batch_divides, mesh_batch_axes,
                                      param_specs, split_microbatches)
from moejax.parallel.pipeline.tables import ACT_SOURCES, GRAD_SOURCES, TickTables, tick_tables
from moejax.profiling import median_seconds

class StepResult(NamedTuple):
    """One pipelined step: means over micro-batches, sums of counts, summed gradients."""

    total: jax.Array
    main: jax.Array
    mtp: jax.Array
    aux: jax.Array
    counts: jax.Array
    dropped: jax.Array
    cross_node: jax.Array
    grads: nnx.State


class Work(NamedTuple):
    """A tick's program: the shapes of the F and B stages it runs (None: no such chunk)."""

    f: StageShape | None
    b: StageShape | None


class Carry(NamedTuple):
    acts: jax.Array  # (act entries, b, S, H) stage inputs in flight
    grad_in: jax.Array  # (grad entries, b, S, H) gradients w.r.t. stage outputs
    grads: nnx.State  # this device's part of its held parameters' gradients so far
    stats: StageStats  # this rank's forward stats summed so far


class TimingPrograms(NamedTuple):
    """The jitted pieces of one step, run in turn: fetch the held rows, allocate the
    buffers, run a range of ticks (fed its own output, tick by tick), finish."""
    held: Callable
    init: Callable
    ticks: Callable
    finish: Callable


@dataclasses.dataclass(frozen=True)
class PipelineExecutor:
    """A schedule bound to a model graph; ``step`` is the jittable whole step.

    Call under ``jax.set_mesh(mesh)`` with a mesh whose ``pipe`` axis has
    ``schedule.num_ranks`` devices.
    """

    schedule: Schedule
    graphdef: nnx.GraphDef  # of DeepseekV3, split into (graph, Param, RouterBias)
    config: ModelConfig
    compute_dtype: Any  # dtype of activations between stages
    mtp_lambda: float
    pair_pieces: bool = True  # F&B ticks piece by piece where they can (module docstring)
    zero_stage: ZeroStage = 3  # how the parameters are stored over ``data`` (sharding rules)

    @functools.cached_property
    def plan(self) -> StagePlan:
        return StagePlan.split(self.config, self.schedule.num_stages)

    @functools.cached_property
    def tables(self) -> TickTables:
        return tick_tables(self.schedule)

    @functools.cached_property
    def placement(self) -> ParamPlacement:
        return ParamPlacement.build(self.plan, self.schedule)

    # --- the pieces, run per rank inside shard_map -------------------------------------

    @functools.cached_property
    def programs(self) -> tuple[tuple[Work, ...], np.ndarray]:
        """The distinct tick programs that occur, and ``[ticks, P]`` which one runs where."""
        f, b = self.tables.rows["f"], self.tables.rows["b"]
        works = [Work(None, None)]
        index = np.zeros(f.shape[:2], np.int32)
        for (t, r), _ in np.ndenumerate(index):
            work = Work(self.plan.shape(f[t, r, 1]) if f[t, r, 0] else None,
                        self.plan.shape(b[t, r, 1]) if b[t, r, 0] else None)
            if work not in works:
                works.append(work)
            index[t, r] = works.index(work)
        return tuple(works), index

    def _rows(self) -> dict[str, np.ndarray]:
        """The tables plus the program index: what ``_tick`` reads per tick."""
        return {**self.tables.rows, "program": self.programs[1]}

    def _stage_rows(self, stage: jax.Array) -> StageRows:
        """Where ``stage``'s rows sit in this rank's held stacks (``placement.fetch``)."""
        rank = jax.lax.axis_index(PIPE_AXIS)
        dense_start, moe_start = jnp.asarray(self.placement.offsets)[rank, stage]
        return StageRows(dense_start, moe_start, jnp.asarray(self._moe_layers)[stage])

    def _forward(self, shape: StageShape, stage: jax.Array, params: nnx.State,
                 biases: nnx.State, h: jax.Array, tokens: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], StageStats]:
        """``((h_out, loss), stats)`` of ``stage`` (of ``shape``) on one micro-batch, with
        this rank's held parameters."""
        model: DeepseekV3 = nnx.merge(self.graphdef, params, biases)
        out, stats = stage_forward(shape, self._stage_rows(stage), model, h, tokens,
                                   self.mtp_lambda)
        return (out, stats.loss), stats

    def runs_pieces(self, work: Work) -> bool:
        """Whether ``work``'s F&B tick runs piece by piece (call under the mesh)."""
        return self.pair_pieces and pairs_pieces(work.f, work.b) and expert_axis_size() > 1

    @functools.cached_property
    def _moe_layers(self) -> np.ndarray:
        """Per stage, its first MoE block's index in the whole model."""
        return np.asarray([self.plan.offsets(s)[1] for s in range(self.schedule.num_stages)],
                          np.int32)

    def _init(self, params: nnx.State, biases: nnx.State, mb_tokens: jax.Array) -> Carry:
        _, b, seq1 = mb_tokens.shape
        entry = (b, seq1 - 1, self.config.hidden_size)
        acts, grads = self.tables.buffer_sizes
        dtype = self.compute_dtype
        stats = jax.eval_shape(lambda: self._forward(
            self.plan.shape(0), 0, params, biases, jnp.zeros(entry, dtype), mb_tokens[0]))[1]
        # Typed as the ticks leave them (``everywhere``, ``per_rank``): the tick loop's
        # carry keeps its type.
        return Carry(everywhere(jnp.zeros((acts, *entry), dtype)),
                     everywhere(jnp.zeros((grads, *entry), dtype)),
                     everywhere(jax.tree.map(jnp.zeros_like, params)),
                     per_rank(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)))

    def _tick(self, params: nnx.State, biases: nnx.State, mb_tokens: jax.Array,
              carry: Carry, row: dict[str, jax.Array]) -> Carry:
        rank = jax.lax.axis_index(PIPE_AXIS)
        mine = {k: v[rank] for k, v in row.items()}
        m = mb_tokens.shape[0]
        _, f_stage, f_act, f_mb = (mine["f"][i] for i in range(4))
        _, b_stage, b_act, b_grad, b_mb = (mine["b"][i] for i in range(5))
        nothing = everywhere(jnp.zeros(carry.acts.shape[1:], carry.acts.dtype))

        def forward(shape: StageShape, stats: StageStats) -> tuple[jax.Array, StageStats]:
            (out, _), new = self._forward(shape, f_stage, params, biases, carry.acts[f_act],
                                          mb_tokens[f_mb])
            return out, add_stats(stats, new)

        def backward(shape: StageShape, grads: nnx.State) -> tuple[jax.Array, nnx.State]:
            (_, loss), vjp, _ = jax.vjp(
                lambda p, h: self._forward(shape, b_stage, p, biases, h, mb_tokens[b_mb]),
                params, carry.acts[b_act], has_aux=True)
            seed = mark_varying(jnp.float32(1.0 / m), tuple(varying_axes(loss)))
            d_params, d_h = vjp((carry.grad_in[b_grad], seed))
            return d_h, jax.tree.map(jnp.add, grads, d_params)

        def paired(work: Work, stats: StageStats, grads: nnx.State):
            f_out, f_stats, b_out, d_params = fb_tick(
                lambda p: nnx.merge(self.graphdef, p, biases), params,
                Chunk(work.f, self._stage_rows(f_stage), carry.acts[f_act], mb_tokens[f_mb]),
                Chunk(work.b, self._stage_rows(b_stage), carry.acts[b_act], mb_tokens[b_mb]),
                carry.grad_in[b_grad], 1.0 / m, self.mtp_lambda)
            return (f_out, b_out, add_stats(stats, f_stats),
                    jax.tree.map(jnp.add, grads, d_params))

        def program(work: Work) -> Callable:
            def run(stats: StageStats, grads: nnx.State):
                if self.runs_pieces(work):
                    f_out, b_out, stats, grads = paired(work, stats, grads)
                else:
                    f_out, stats = forward(work.f, stats) if work.f else (nothing, stats)
                    b_out, grads = backward(work.b, grads) if work.b else (nothing, grads)
                # every branch of the switch returns the same types
                return everywhere(f_out), everywhere(b_out), per_rank(stats), everywhere(grads)
            return run

        works, _ = self.programs
        f_out, b_out, stats, grads = jax.lax.switch(
            mine["program"], [program(w) for w in works], carry.stats, carry.grads)

        ranks = self.schedule.num_ranks
        to_right = [(i, i + 1) for i in range(ranks - 1)]
        to_left = [(i + 1, i) for i in range(ranks - 1)]

        def land(buffer: jax.Array, sources: tuple[str, ...], value: jax.Array) -> jax.Array:
            arrivals = (jax.lax.ppermute(value, PIPE_AXIS, to_right),  # from my left
                        jax.lax.ppermute(value, PIPE_AXIS, to_left),  # from my right
                        value)  # from myself
            for source, arrived in zip(sources, arrivals):
                on, entry = mine[source][0], mine[source][1]
                buffer = buffer.at[entry].set(jnp.where(on == 1, arrived, buffer[entry]))
            return buffer

        return Carry(land(carry.acts, ACT_SOURCES, f_out),
                     land(carry.grad_in, GRAD_SOURCES, b_out), grads, stats)

    def _finish(self, carry: Carry, unfetch: Callable, num_microbatches: int) -> StepResult:
        """Gradients w.r.t. the stored parameters (summed over the devices by the VJP of
        ``_held``'s typing), and the stats summed over ``pipe``."""
        (grads,) = unfetch(carry.grads)
        s = sum_over_pipe(carry.stats)
        mean = lambda x: x / num_microbatches  # noqa: E731
        return StepResult(mean(s.loss), mean(s.main), mean(s.mtp), mean(s.aux), s.counts,
                          s.dropped, s.cross_node, grads)

    def _held(self, params: nnx.State, specs: nnx.State) -> tuple[nnx.State, Callable]:
        """This rank's held parameters, typed as varying over every device so each tick's
        gradients stay this device's part, and the VJP of gathering, fetching and typing
        them, applied once: it sums those parts over the devices (a reduce-scatter over
        ``data`` where ZeRO-3 stores shards, the gather's transpose; all-reduces elsewhere,
        the typing's) and sends stack rows back to where they are stored (call in
        shard_map; ``specs`` as ``_specs`` gives them)."""
        rank = jax.lax.axis_index(PIPE_AXIS)
        return jax.vjp(lambda p: everywhere(self.placement.fetch(_gather_data(p, specs), rank)),
                       params)

    def _ticks(self, held: nnx.State, biases: nnx.State, mb_tokens: jax.Array, carry: Carry,
               start: int | jax.Array, stop: int | jax.Array) -> Carry:
        """Ticks ``start..stop-1`` (static bounds: a scan; traced: a while loop)."""
        tables = {k: jnp.asarray(v) for k, v in self._rows().items()}
        return jax.lax.fori_loop(
            start, stop, lambda t, c: self._tick(held, biases, mb_tokens, c,
                                                 {k: v[t] for k, v in tables.items()}),
            carry)

    def _specs(self, params: nnx.State) -> tuple[nnx.State, P]:
        """``shard_map`` specs of the parameters as the train state stores them (stacks by
        their layer axis over ``pipe``, routed experts over ``expert``, ZeRO-3 shards over
        ``data``; their gradients leave the same way) and of the token batch (over the
        batch axes)."""
        mesh = jax.sharding.get_abstract_mesh()
        if dict(mesh.shape).get("tensor", 1) > 1:
            raise ValueError(f"the pipeline executor has no tensor parallelism: mesh "
                             f"tensor={dict(mesh.shape)['tensor']}; use 1")
        self.placement.check_stored(params)
        return param_specs(params, mesh, self.zero_stage), P(mesh_batch_axes())

    def _check_batch(self, batch: int, axes: P) -> None:
        """Every micro-batch splits evenly over the batch axes (a clear error if not)."""
        shards = check_batch_divides(batch, axes[0])
        m = self.schedule.num_microbatches
        if batch % (shards * m):
            raise ConfigError(f"batch {batch}: must be divisible by the {m} micro-batches "
                             f"x the {shards} devices of the batch axes {axes[0]}")

    # --- public -----------------------------------------------------------------------

    def step(self, params: nnx.State, biases: nnx.State, tokens: jax.Array) -> StepResult:
        """The whole pipelined forward + backward of ``tokens`` (B, S+1) (trace under jit)."""
        m = self.schedule.num_microbatches
        specs, batch = self._specs(params)
        self._check_batch(tokens.shape[0], batch)

        def body(params, biases, tokens):
            held, unfetch = self._held(params, specs)
            mb_tokens = split_microbatches(tokens, m)
            carry = self._init(held, biases, mb_tokens)
            carry = self._ticks(held, biases, mb_tokens, carry, 0, self.tables.num_ticks)
            return self._finish(carry, unfetch, m)

        out_specs = StepResult(*(P(),) * 7, specs)
        return jax.shard_map(body, in_specs=(specs, P(), batch), out_specs=out_specs)(
            params, biases, tokens)

    def timing_programs(self, params: nnx.State) -> TimingPrograms:
        """The step as four jitted programs (``TimingPrograms``) for ``timed_step``; the
        tick-range program takes its bounds as arguments, so the step and the per-tick
        timing share one compile of the tick loop. Between programs each device's values
        travel stacked along a leading axis split over every axis they vary over."""
        m = self.schedule.num_microbatches
        mine = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        stack = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        specs, batch = self._specs(params)
        device = P((PIPE_AXIS, *batch[0]))
        carry = Carry(device, device, device, P(PIPE_AXIS))

        def sharded(fn, in_specs, out_specs):
            return jax.jit(jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs))

        return TimingPrograms(
            held=sharded(lambda p: stack(self._held(p, specs)[0]), (specs,), device),
            init=sharded(lambda h, b, tok: stack(self._init(mine(h), b,
                                                            split_microbatches(tok, m))),
                         (device, P(), batch), carry),
            ticks=sharded(lambda h, b, tok, c, start, stop: stack(self._ticks(
                mine(h), b, split_microbatches(tok, m), mine(c), start, stop)),
                          (device, P(), batch, carry, P(), P()), carry),
            finish=sharded(lambda p, c: self._finish(mine(c), self._held(p, specs)[1], m),
                           (specs, carry), StepResult(*(P(),) * 7, specs)))

    def timed_step(self, params: nnx.State, biases: nnx.State, tokens: jax.Array,
                   repeats: int = 5, profile_dir: str | None = None
                   ) -> tuple[StepResult, float, list[float]]:
        """The step run through ``timing_programs``, each compiled once: the result, the
        median wall time of the whole chain over ``repeats`` runs, and each tick's wall
        time (the host waits after each; every rank runs in lock-step, so a tick lasts as
        long as its slowest rank's op). ``profile_dir``: one chain traced."""
        self._check_batch(tokens.shape[0], self._specs(params)[1])
        held_of, init, ticks, finish = self.timing_programs(params)
        num_ticks = jnp.int32(self.tables.num_ticks)

        def chain() -> StepResult:
            held = held_of(params)
            carry = init(held, biases, tokens)
            return finish(params, ticks(held, biases, tokens, carry, jnp.int32(0), num_ticks))

        step_s = median_seconds(chain, repeats)
        if profile_dir is not None:
            with jax.profiler.trace(profile_dir):
                jax.block_until_ready(chain())
        held = held_of(params)
        carry = jax.block_until_ready(init(held, biases, tokens))
        times = []
        for t in range(self.tables.num_ticks):
            start = time.perf_counter()
            carry = jax.block_until_ready(ticks(held, biases, tokens, carry, jnp.int32(t),
                                                jnp.int32(t + 1)))
            times.append(time.perf_counter() - start)
        return finish(params, carry), step_s, times

    def idle_ticks(self, rank: int) -> list[bool]:
        """Per tick: True where ``rank`` runs no F or B (idle, or a W that runs nothing)."""
        f, b = self.tables.rows["f"], self.tables.rows["b"]
        return [not (f[t, rank, 0] or b[t, rank, 0]) for t in range(self.tables.num_ticks)]

    def loss_and_grads(self, params: nnx.State, biases: nnx.State, tokens: jax.Array
                       ) -> tuple[tuple[jax.Array, tuple], nnx.State]:
        """``step`` in the shape ``make_train_step(loss_and_grads=...)`` takes."""
        r = self.step(params, biases, tokens)
        out = ModelLosses(r.main, r.mtp, r.counts, r.aux, r.dropped, r.cross_node)
        return (r.total, (r.main, r.mtp, out)), r.grads


def _gather_data(params: nnx.State, specs: nnx.State) -> nnx.State:
    """Each parameter whole over ``data`` (ZeRO-3 stores shards; call in the step's
    shard_map): one all-gather a parameter as the step begins, whose transpose
    reduce-scatters its gradient as the step ends."""
    dims = {path: [d for d, axis in enumerate(v.get_value()) if axis == "data"]
            for path, v in nnx.to_flat_state(specs)}

    def gather(path: tuple, value: jax.Array) -> jax.Array:
        for dim in dims[path]:
            value = jax.lax.all_gather(value, "data", axis=dim, tiled=True)
        return value
    return map_leaves(params, gather)


def everywhere(tree: Any) -> Any:
    """``tree`` typed as varying over ``pipe`` and the mesh's batch axes (call in the step's
    shard_map): what each device holds of the step's buffers and gradients."""
    return varying_over(tree, (PIPE_AXIS, *mesh_batch_axes()))


def per_rank(tree: Any) -> Any:
    """``tree`` typed as varying over ``pipe``: the stats, equal on a rank's devices."""
    return varying_over(tree, (PIPE_AXIS,))

"""Runs a pipeline schedule on the real model's stages: jit + shard_map over ``pipe``.

The static schedule becomes per-tick tables (:func:`tick_tables`, from ``tick_grid``: every
op takes one lock-step tick, data sent in tick t is usable in tick t+1). Inside one
``jax.shard_map`` that is manual over ``pipe`` only (``data``/``expert`` stay automatic, so
the MoE layers still run expert-parallel through their own nested shard_map), each device
reads its row of the tables with ``rank = lax.axis_index('pipe')`` and a ``lax.scan`` walks
the ticks. A tick runs one ``lax.switch`` over the tick *programs* that occur in the
schedule: each program is a static pair (shape of the F stage or none, shape of the B
stage or none), see :class:`Work`, so an F&B tick is one straight-line computation holding
both chunks, with no nested conditional between them.

- F: the stage's forward (``stages.stage_forward``) on its input from a fixed buffer
  ``acts[slot, micro-batch]`` (stage rows picked by traced offsets);
- B: ``jax.vjp`` of the same stage function, recomputing the forward from the saved stage
  input (no residuals kept across ticks), with cotangents ``(grad buffer entry, 1/M)``: the
  1/M seeds the stage's share of the mean loss;
- then four ``lax.ppermute`` over ``pipe`` (activations and input-gradients, each to the
  right and to the left neighbour); the receiving rank's tables say which buffer entry, if
  any, each arrival fills. Transfers between two stages of one rank (the V's bottom in
  DualPipeV) are plain buffer writes.

Parameters are the normal unpipelined tree, replicated over ``pipe``: a stage reads its
own rows of the stacked layers, so DualPipe's two copies of a stage (one per direction)
and the embedding/head shared by stages 0 and S-1 are one array. Each rank accumulates
gradients of what its stages touched; one ``psum`` over ``pipe`` after the last tick sums
ranks (and DualPipe's two directions). Router counts sum over micro-batches and stages;
losses are means over micro-batches, so they equal the unpipelined step's.

W chunks run nothing: a B computes its weight gradients at once, so a W tick is idle time.

F&B overlap. In an F&B tick the F of one micro-batch and the B of another share no data
(different buffer entries, different tokens) and sit in one branch of the tick's switch:
one HLO computation, where the only order XLA must keep is each chain's own. XLA's
latency-hiding scheduler (GPU: ``--xla_gpu_enable_latency_hiding_scheduler``) may then
issue one chain's ``all_to_all``/``ragged_all_to_all`` while the other chain's matmuls
run. Two separate conditionals would not do: a conditional is one instruction to the
scheduler, so their bodies could never interleave. The tick leaves the interleave to the
scheduler; the explicit piece-by-piece pairing (attention / dispatch / experts / combine,
lock-step barriers) is ``fb_pair.run_pair``, on MoE-block stacks, which this executor
does not call yet: its stages run ``stage_forward`` (embedding, dense blocks, head, MTP
around the MoE stack) with the MoE layer's own nested shard_map, while ``run_pair`` needs
the MoE blocks of both chunks inside one shard_map over the batch axes.

Memory: the buffers hold M micro-batches per stage slot (not the schedule's in-flight
bound) and the parameters are replicated over ``pipe``; both are simplifications.
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

from moejax.config import ModelConfig
from moejax.model import DeepseekV3, ModelOutput
from moejax.parallel.pipeline.schedule import Kind, Schedule, ScheduleError
from moejax.parallel.pipeline.simulate import tick_grid
from moejax.parallel.pipeline.stages import StagePlan, StageShape, StageStats, stage_forward

PIPE_AXIS = "pipe"
ACT_SOURCES = ("act_left", "act_right", "act_local")
GRAD_SOURCES = ("grad_left", "grad_right", "grad_local")


def tick_tables(schedule: Schedule) -> dict[str, np.ndarray]:
    """Per-tick, per-rank int32 tables ``[ticks, P, ...]`` the executor indexes by rank.

    ``f``/``b``: (on, stage, slot, micro-batch) of the rank's F and B chunk this tick.
    ``act_*``/``grad_*``: (on, slot, micro-batch) of the buffer entry that an arrival at
    the end of the tick fills, by source (left neighbour, right neighbour, same rank).
    """
    grid = tick_grid(schedule)
    ticks, ranks = len(grid), schedule.num_ranks
    tables = {"f": np.zeros((ticks, ranks, 4), np.int32),
              "b": np.zeros((ticks, ranks, 4), np.int32),
              **{k: np.zeros((ticks, ranks, 3), np.int32) for k in ACT_SOURCES + GRAD_SOURCES}}

    def deliver(kind: str, t: int, src: int, stage: int, direction: int, mb: int) -> None:
        dest = schedule.rank_of(stage, direction)
        source = {src: "local", src + 1: "left", src - 1: "right"}.get(dest)
        if source is None:
            raise ScheduleError(f"schedule={schedule.name!r}: rank {src} sends to rank {dest}; "
                                "the executor moves data between neighbours only")
        entry = tables[f"{kind}_{source}"][t, dest]
        if entry[0]:
            raise ScheduleError(f"schedule={schedule.name!r}: two {kind} arrivals at rank "
                                f"{dest} from one source in tick {t}")
        entry[:] = (1, schedule.slot_of(stage, direction), mb)

    last = schedule.num_stages - 1
    for t, row in enumerate(grid):
        for r, op in enumerate(row):
            for c in op.chunks if op is not None else ():
                if c.kind is Kind.W:
                    continue
                name = "f" if c.kind is Kind.F else "b"
                tables[name][t, r] = (1, c.stage, schedule.slot_of(c.stage, c.direction), c.mb)
                if c.kind is Kind.F and c.stage < last:
                    deliver("act", t, r, c.stage + 1, c.direction, c.mb)
                if c.kind is Kind.B and c.stage > 0:
                    deliver("grad", t, r, c.stage - 1, c.direction, c.mb)
    return tables


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
    acts: jax.Array  # (slots, M, b, S, H) stage inputs
    grad_in: jax.Array  # (slots, M, b, S, H) gradients w.r.t. stage outputs
    grads: nnx.State  # this rank's parameter gradients so far
    stats: StageStats  # this rank's forward stats summed so far


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

    @functools.cached_property
    def plan(self) -> StagePlan:
        return StagePlan.split(self.config, self.schedule.num_stages)

    @functools.cached_property
    def tables(self) -> dict[str, np.ndarray]:
        return tick_tables(self.schedule)

    @property
    def num_ticks(self) -> int:
        return len(next(iter(self.tables.values())))

    @property
    def num_slots(self) -> int:
        return 1 + max(slot for leg in self.schedule.placement for _, slot in leg)

    # --- the pieces, run per rank inside shard_map -------------------------------------

    @functools.cached_property
    def programs(self) -> tuple[tuple[Work, ...], np.ndarray]:
        """The distinct tick programs that occur, and ``[ticks, P]`` which one runs where."""
        works = [Work(None, None)]
        index = np.zeros(self.tables["f"].shape[:2], np.int32)
        for (t, r), _ in np.ndenumerate(index):
            f_on, f_stage = self.tables["f"][t, r, :2]
            b_on, b_stage = self.tables["b"][t, r, :2]
            work = Work(self.plan.shape(f_stage) if f_on else None,
                        self.plan.shape(b_stage) if b_on else None)
            if work not in works:
                works.append(work)
            index[t, r] = works.index(work)
        return tuple(works), index

    def _rows(self) -> dict[str, np.ndarray]:
        """The tables plus the program index: what ``_tick`` reads per tick."""
        return {**self.tables, "program": self.programs[1]}

    def _forward(self, shape: StageShape, stage: jax.Array, params: nnx.State,
                 biases: nnx.State, h: jax.Array, tokens: jax.Array
                 ) -> tuple[tuple[jax.Array, jax.Array], StageStats]:
        """``((h_out, loss), stats)`` of ``stage`` (of ``shape``) on one micro-batch."""
        dense_start, moe_start = jnp.asarray(self._offsets)[stage]
        model: DeepseekV3 = nnx.merge(self.graphdef, params, biases)
        out, stats = stage_forward(shape, dense_start, moe_start, model, h, tokens,
                                   self.mtp_lambda)
        return (out, stats.loss), stats

    @functools.cached_property
    def _offsets(self) -> np.ndarray:
        return np.asarray([self.plan.offsets(s) for s in range(self.schedule.num_stages)],
                          np.int32)

    def _init(self, params: nnx.State, biases: nnx.State, mb_tokens: jax.Array) -> Carry:
        m, b, seq1 = mb_tokens.shape
        shape = (self.num_slots, m, b, seq1 - 1, self.config.hidden_size)
        dtype = self.compute_dtype
        stats = jax.eval_shape(lambda: self._forward(
            self.plan.shape(0), 0, params, biases, jnp.zeros(shape[2:], dtype),
            mb_tokens[0]))[1]
        return Carry(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                     jax.tree.map(jnp.zeros_like, params),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats))

    def _tick(self, params: nnx.State, biases: nnx.State, mb_tokens: jax.Array,
              carry: Carry, row: dict[str, jax.Array]) -> Carry:
        rank = jax.lax.axis_index(PIPE_AXIS)
        mine = {k: v[rank] for k, v in row.items()}
        m = mb_tokens.shape[0]
        _, f_stage, f_slot, f_mb = (mine["f"][i] for i in range(4))
        _, b_stage, b_slot, b_mb = (mine["b"][i] for i in range(4))
        nothing = jnp.zeros(carry.acts.shape[2:], carry.acts.dtype)

        def forward(shape: StageShape, stats: StageStats) -> tuple[jax.Array, StageStats]:
            (out, _), new = self._forward(shape, f_stage, params, biases,
                                          carry.acts[f_slot, f_mb], mb_tokens[f_mb])
            return out, jax.tree.map(jnp.add, stats, new)

        def backward(shape: StageShape, grads: nnx.State) -> tuple[jax.Array, nnx.State]:
            _, vjp, _ = jax.vjp(
                lambda p, h: self._forward(shape, b_stage, p, biases, h, mb_tokens[b_mb]),
                params, carry.acts[b_slot, b_mb], has_aux=True)
            d_params, d_h = vjp((carry.grad_in[b_slot, b_mb], jnp.float32(1.0 / m)))
            return d_h, jax.tree.map(jnp.add, grads, d_params)

        def program(work: Work) -> Callable:
            def run(stats: StageStats, grads: nnx.State):
                f_out, stats = forward(work.f, stats) if work.f else (nothing, stats)
                b_out, grads = backward(work.b, grads) if work.b else (nothing, grads)
                return f_out, b_out, stats, grads
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
                on, slot, mb = (mine[source][i] for i in range(3))
                buffer = buffer.at[slot, mb].set(jnp.where(on == 1, arrived, buffer[slot, mb]))
            return buffer

        return Carry(land(carry.acts, ACT_SOURCES, f_out),
                     land(carry.grad_in, GRAD_SOURCES, b_out), grads, stats)

    def _finish(self, carry: Carry, num_microbatches: int) -> StepResult:
        grads = jax.lax.psum(carry.grads, PIPE_AXIS)
        s = jax.lax.psum(carry.stats, PIPE_AXIS)
        mean = lambda x: x / num_microbatches  # noqa: E731
        return StepResult(mean(s.loss), mean(s.main), mean(s.mtp), mean(s.aux), s.counts,
                          s.dropped, s.cross_node, grads)

    # --- public -----------------------------------------------------------------------

    def step(self, params: nnx.State, biases: nnx.State, tokens: jax.Array) -> StepResult:
        """The whole pipelined forward + backward of ``tokens`` (B, S+1) (trace under jit)."""
        m = self.schedule.num_microbatches
        tables = {k: jnp.asarray(v) for k, v in self._rows().items()}

        def body(params, biases, tokens):
            params = gathered(params)
            mb_tokens = split_microbatches(tokens, m)
            carry = self._init(params, biases, mb_tokens)
            carry, _ = jax.lax.scan(
                lambda c, row: (self._tick(params, biases, mb_tokens, c, row), None),
                carry, tables)
            return self._finish(carry, m)

        return jax.shard_map(body, in_specs=(P(), P(), P()), out_specs=P(),
                             axis_names={PIPE_AXIS}, check_vma=False)(params, biases, tokens)

    def timed_step(self, params: nnx.State, biases: nnx.State, tokens: jax.Array
                   ) -> tuple[StepResult, list[float]]:
        """``step`` with the host waiting after each tick: the result and each tick's wall
        time in seconds (every rank runs in lock-step, so a tick lasts as long as its
        slowest rank's op). Each piece is compiled (and the tick run once) before timing."""
        m = self.schedule.num_microbatches
        rows = [{k: jnp.asarray(v[t]) for k, v in self._rows().items()}
                for t in range(self.num_ticks)]
        mine = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        stack = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        per_rank = P(PIPE_AXIS)

        def sharded(fn, in_specs, out_specs):
            return jax.jit(jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                                         axis_names={PIPE_AXIS}, check_vma=False))

        init = sharded(lambda p, b, tok: stack(self._init(p, b, split_microbatches(tok, m))),
                       (P(), P(), P()), per_rank)
        tick = sharded(lambda p, b, tok, c, row: stack(self._tick(
            gathered(p), b, split_microbatches(tok, m), mine(c), row)),
                       (P(), P(), P(), per_rank, P()), per_rank)
        finish = sharded(lambda c: self._finish(mine(c), m), (per_rank,), P())
        carry = jax.block_until_ready(init(params, biases, tokens))
        jax.block_until_ready(tick(params, biases, tokens, carry, rows[0]))
        times = []
        for row in rows:
            start = time.perf_counter()
            carry = jax.block_until_ready(tick(params, biases, tokens, carry, row))
            times.append(time.perf_counter() - start)
        return finish(carry), times

    def idle_ticks(self, rank: int) -> list[bool]:
        """Per tick: True where ``rank`` runs no F or B (idle, or a W that runs nothing)."""
        return [not (self.tables["f"][t, rank, 0] or self.tables["b"][t, rank, 0])
                for t in range(self.num_ticks)]

    def loss_and_grads(self, params: nnx.State, biases: nnx.State, tokens: jax.Array
                       ) -> tuple[tuple[jax.Array, tuple], nnx.State]:
        """``step`` in the shape ``make_train_step(loss_and_grads=...)`` takes."""
        r = self.step(params, biases, tokens)
        out = ModelOutput(None, (), r.counts, r.aux, r.dropped, r.cross_node)
        return (r.total, (r.main, r.mtp, out)), r.grads


def gathered(params: nnx.State) -> nnx.State:
    """``params`` whole on every device of the automatic axes (ZeRO-3 shards gathered once,
    before the tick loop): no partitioner-made collective may sit inside a tick's branch,
    where ranks of ``pipe`` that take another branch would never join it."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), params)


def split_microbatches(tokens: jax.Array, num_microbatches: int) -> jax.Array:
    """(B, S+1) -> (M, B/M, S+1), micro-batch i = rows i, i+M, ...: every micro-batch
    takes an equal share of each data shard's rows (the batch dim is split over devices
    in contiguous blocks)."""
    batch = tokens.shape[0]
    return tokens.reshape(batch // num_microbatches, num_microbatches, -1).swapaxes(0, 1)

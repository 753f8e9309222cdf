"""Per-device memory budget of one training step: "will it fit?" before compiling it.

Terms (bytes per device; the worst device when the layers are split over ``pipe``):

- **parameters, gradients, optimizer state** are exact: the abstract train state
  (``state_initializer``) laid out by the run's own shardings
  (``moejax.train.placement.train_state_shardings`` over an abstract mesh of the requested
  shape), each leaf counted at its per-device shard shape. ZeRO-3 splits all three over
  ``data``, ZeRO-1 only the optimizer state; experts split over ``expert``. Gradients have
  the FP32 master parameters' shapes and layout. With ``pipe`` > 1 the layer stacks are
  stored split over ``pipe`` where it divides them (the ``layers -> pipe`` rule), else whole
  on every rank, exactly as the sharding rules place them.
- **pipeline stage rows held** (``pipe`` > 1): inside the step the executor gathers the
  parameters over ``data`` (routed experts stay split over ``expert``) and fetches the rows
  of its rank's stages
  (``parallel.pipeline.placement``: DualPipe holds twice the layers over the pipe), and
  accumulates their gradients alike: twice those bytes on the busiest rank. (Until
  session 44 the fetch's gradient also kept integer id arrays of the held rows' shape,
  which this term did not count: DualPipe's budget read 19-33% under XLA's peak. Now it
  reads +9% on the GPU (`small`, 5 layers), but still 10-19% under on CPU's `tiny`.
  There, every branch of the tick's switch copies the gradient accumulator into the
  switch's output, a second held-gradients buffer this term does not count: about half
  the gap. docs/performance.md, Pipeline executor, sessions 44 and 45.)
- **gradient accumulator** (``train.microbatches`` = k > 1 without ``pipe``): the FP32 sum
  of the micro-batches' gradients, laid out like them, beside the micro-batch's own; the
  activation terms are one micro-batch's (``moejax.train.accumulate``).
- **EMA**: a parameter copy in host RAM (``moejax.memory.ema``): 0 device bytes. Its
  **snapshot** is on the device: each step copies one of ``train.ema_every`` parameter
  groups out for the host, and that copy lives into the next step (the largest group).
- **saved activations** (per micro-batch): what XLA keeps for the MoE layers' backward,
  measured (``depth_fit``): two reduced-depth copies of the step (the dense layers and 3 and
  4 MoE layers, or fewer in a shallower model; per-device micro-batch) are compiled alone
  on this backend, and the growth of their temp beyond the gradients per MoE layer is taken
  for every MoE layer. It is XLA's own keep under the remat policy, the compute dtype and
  FP8 storage, net of what XLA fuses away or recomputes (a count of autodiff's residuals,
  as earlier versions used, overstated the full-remat `small` step on the GPU by 21%).
  With ``expert`` > 1 the probes' experts run on the receive buffer's rows
  (``expert_side_rows``: ep x the routed rows, dropless), as an expert-parallel device's
  do and its backward keeps: without that the `small` step on 4 x H200 was under-counted
  2.5x (22.14 GiB said, 55.59 used).
  With ``pipe`` > 1 the executor keeps only stage inputs between ticks and recomputes a
  stage in its B tick: the largest stage's share of one micro-batch's MoE-layer keep, plus
  the stage inputs and gradients its buffers hold at once (``parallel.pipeline.tables``,
  busiest rank).
- **backward workspace**: the rest of the shallower copy's temp beyond its gradients and
  its MoE layers' keep: the dense layers', MTP's and the loss head's activations, the
  activations and cotangents of the block being differentiated, and kernel scratch (on
  XLA:CPU the reference grouped GEMM expands (rows, experts, hidden) one-hot products; the
  GPU kernels need none). Taken as independent of depth.
- **ZeRO-3 gathered layer**: with ZeRO-3 over ``data`` > 1, XLA all-gathers one layer's
  weights (FP32) inside the layer loop.
- **communication buffers** of the expert-parallel exchange (``moejax.parallel.expert``)
  for one MoE layer: padded transport: send and receive buffers of ``ep * C`` rows
  (``C = T * min(k, E/ep)`` dropless, ``ceil(f * T * k / ep)`` with capacity factor f);
  ragged: the ``T * k`` sorted rows plus a worst-case receive buffer of ``ep * C`` rows.

XLA's peak is ``arguments + temp`` (outputs alias the donated state), i.e. parameters +
optimizer state + temp, and temp = gradients + saved activations + workspace (+ gathered
layer + exchange buffers on a mesh). Single-device estimates are checked against
``compiled.memory_analysis()`` of the real step (``tests/test_budget.py``,
``python -m moejax.budget --validate``); the EMA snapshot is outside the step program, so
that check leaves it out (``Budget.step_total``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import re
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from moejax.config import ConfigError
from moejax.memory.ema import largest_snapshot_bytes
from moejax.model.moe import experts_on_rows
from moejax.parallel.expert import expert_parallel_options, make_transport
from moejax.parallel.mesh import AXES, MeshSpec, build_mesh
from moejax.parallel.pipeline.placement import ParamPlacement
from moejax.parallel.pipeline.schedule import build as build_schedule
from moejax.parallel.pipeline.stages import StagePlan
from moejax.parallel.pipeline.tables import tick_tables
from moejax.parallel.sharding import (STACKED, batch_sharding, param_logical_axes,
                                      state_shardings)
from moejax.train.config import ExperimentConfig, apply_overrides
from moejax.train.optimizer import make_optimizer
from moejax.train.placement import train_state_shardings
from moejax.train.step import (TrainState, attention_implementation, make_train_step,
                              pipelined, state_initializer)

GIB = 2**30
_UNITS = {"": 1, "B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20,
          "GB": 2**30, "GIB": 2**30, "TB": 2**40, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' / '80GiB' / '1.5TB' / '123456' -> bytes (binary units: an "80GB" H100 holds
    about 79 GiB usable, so GB is read as GiB rather than overstating the card)."""
    match = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    size = int(float(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    if size < 1:
        raise ConfigError(f"--device-memory={text!r}: expected a size of at least one byte, "
                          f"like 80GB, 141GiB or 85899345920")
    return size


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str
    on_device: bool = True
    in_step: bool = True  # False: device memory beside the step program (the EMA's copy)


@dataclasses.dataclass(frozen=True)
class Budget:
    terms: tuple[Term, ...]
    device_memory: int | None  # bytes; None: unknown (no verdict)
    title: str

    @property
    def device_total(self) -> int:
        return sum(t.bytes for t in self.terms if t.on_device)

    @property
    def step_total(self) -> int:
        """Device bytes of the step program alone: what XLA's memory_analysis counts."""
        return sum(t.bytes for t in self.terms if t.on_device and t.in_step)

    @property
    def largest(self) -> Term:
        return max((t for t in self.terms if t.on_device), key=lambda t: t.bytes)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.device_total <= self.device_memory

    def term(self, name: str) -> Term:
        (found,) = [t for t in self.terms if t.name == name]
        return found

    def table(self) -> str:
        rows = [self.title, f"{'term':<28}{'GiB':>12}  where   note"]
        for t in self.terms:
            rows.append(f"{t.name:<28}{t.bytes / GIB:>12.3f}  "
                        f"{'device' if t.on_device else 'host  '}  {t.note}")
        rows.append(f"{'total on device':<28}{self.device_total / GIB:>12.3f}")
        if self.device_memory is None:
            rows.append("verdict: device memory unknown (pass --device-memory)")
        else:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            rows.append(f"verdict: {verdict} in {self.device_memory / GIB:.2f} GiB "
                        f"({self.device_total / self.device_memory:.0%} used); largest term: "
                        f"{self.largest.name} ({self.largest.bytes / GIB:.3f} GiB)")
        return "\n".join(rows)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes of one device's shards (the shardings split stacks over ``pipe`` where they
    can, so every device holds the same)."""
    return sum(_nbytes(sharding.shard_shape(leaf.shape), leaf.dtype)
               for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings),
                                         strict=True))


def _gathered_layer(params: Any, shardings: Any, data: int) -> int:
    """One stacked layer's weights with the ``data`` split undone (ZeRO-3 all-gather)."""
    per_stack: dict[str, int] = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings), strict=True):
        key = jax.tree_util.keystr(path)
        stack = next((name for name in STACKED if name in key), None)
        if stack is None:
            continue
        shape = sharding.shard_shape(leaf.shape)
        gathered = data if "data" in jax.tree.leaves(tuple(sharding.spec)) else 1
        per_stack[stack] = per_stack.get(stack, 0) + (
            _nbytes(shape[1:], leaf.dtype) * gathered)
    return max(per_stack.values(), default=0)


def _abstract_mesh(mesh: MeshSpec) -> AbstractMesh:
    return AbstractMesh(mesh.shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# MoE layers of the deeper reduced copy; the shallower has one less. Why not 3: on the GPU
# the `small` step peaks at its end, where every MoE layer's expert gradients are live, so
# the peak grows by a layer's gradients per MoE layer; a copy with 2 MoE layers peaks
# elsewhere, at a point that does not grow with depth, which hid that growth from the fit
# (full remat: 0 per layer, -11.1% in FP8; docs/performance.md, session 35). From 3 MoE
# layers the end is the peak.
CALIBRATION_MOE_LAYERS = 4
# XLA's last-resort rematerialization (run when a step exceeds the device) is off when the
# budget compiles: an over-limit step then compiles in its normal time and reports its true
# size, instead of minutes of a pass that rarely brings it under the limit.
MEASURE_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


def _at_depth(cfg: ExperimentConfig, micro_batch: int, moe_layers: int) -> ExperimentConfig:
    """The dense layers and ``moe_layers`` MoE layers, one device, the micro-batch in one
    pass."""
    m = cfg.model
    return dataclasses.replace(
        cfg, model=m.replace(num_hidden_layers=m.first_k_dense_replace + moe_layers),
        mesh=MeshSpec(), train=dataclasses.replace(cfg.train, batch_size=micro_batch,
                                                   microbatches=None))


def _resolved_for(cfg: ExperimentConfig, pipe: int) -> ExperimentConfig:
    """``cfg`` with its attention core fixed to what the step picks on a mesh of ``pipe``
    stages. The reduced copies compile one device's share, which would resolve "auto" as an
    unpipelined step does (cuDNN's attention on a GPU) where a pipelined step runs XLA's
    attention (session 42)."""
    if pipe == 1:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, attention=attention_implementation(cfg, pipe)))


def _in_background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread. XLA releases the GIL while it compiles, so the
    budget's compiles (two reduced copies, and the real step under ``--validate``) run side
    by side and beside the next one's lowering, which is Python: an FP8 step's lowering and
    compile take minutes on a GPU (docs/performance.md, session 34). Daemon, so that Ctrl-C
    ends the process without waiting for a compile to finish."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(err)

    threading.Thread(target=run, name="budget-compile", daemon=True).start()
    return future


def _lower_step(cfg: ExperimentConfig, expert_rows: int | None = None
                ) -> tuple[Any, TrainState]:
    """The real one-device step lowered for ``cfg``, and the abstract state it takes;
    ``expert_rows``: its MoE layers' experts run on that many rows (``moe.experts_on_rows``)."""
    graphdef, init = state_initializer(cfg, pipe=1)
    abstract = jax.eval_shape(init, jnp.uint32(0))
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32)
    with experts_on_rows(expert_rows):
        return make_train_step(graphdef, cfg).lower(abstract, tokens), abstract


def _memory_analysis(lowered: Any, autotune: bool, dump_to: str | None) -> Any:
    """``memory_analysis()`` of the lowered step, compiled (never run). Without ``autotune``
    XLA takes its default GEMM configs instead of timing candidates on the GPU: the same
    buffers but for GEMM workspace, a faster compile (the fit search's probes).
    ``dump_to``: a folder for XLA's dumps of the step (its optimized HLO and live ranges,
    read by ``memory.peak``)."""
    options = MEASURE_OPTIONS if autotune else {**MEASURE_OPTIONS, "xla_gpu_autotune_level": 0}
    if dump_to is not None:
        options = {**options, "xla_dump_to": dump_to}
    return lowered.compile(compiler_options=options).memory_analysis()


def start_compile(cfg: ExperimentConfig, autotune: bool = True, expert_rows: int | None = None
                  ) -> tuple[concurrent.futures.Future, TrainState]:
    """Lowers ``cfg``'s one-device step now (``expert_rows`` as in ``_lower_step``) and
    compiles it on a budget thread: the future of its ``memory_analysis()``, and the
    abstract state. Remembered per config, so a step asked for twice compiles once
    (``--validate`` on a model no deeper than the budget's deeper probe, ``tiny``, is that
    probe's very step). The cache sits behind this call, which passes every argument by
    position: ``lru_cache`` keys a defaulted argument apart from the same value passed."""
    return _started_compile(cfg, autotune, expert_rows)


@functools.lru_cache(maxsize=8)
def _started_compile(cfg: ExperimentConfig, autotune: bool, expert_rows: int | None
                     ) -> tuple[concurrent.futures.Future, TrainState]:
    lowered, abstract = _lower_step(cfg, expert_rows)
    return _in_background(_memory_analysis, lowered, autotune, None), abstract


Progress = Callable[[str], None]  # takes a line saying what is being done, for long work


def _silent(message: str) -> None:
    del message


class DepthFit(NamedTuple):
    """XLA's temp beyond the gradients, as a line in the number of MoE layers, fitted to two
    reduced-depth copies of the step compiled on this backend."""
    per_moe_layer: int  # bytes: what XLA keeps for one more MoE layer's backward
    rest: int  # bytes: the dense layers', MTP's and the loss head's keep, and the workspace
    depths: tuple[int, int]  # MoE layers of the two copies


def depth_fit(cfg: ExperimentConfig, micro_batch: int, progress: Progress = _silent,
              expert_rows: int | None = None) -> DepthFit:
    """Two copies of the step with 3 and 4 MoE layers (fewer if the model has fewer; XLA
    unrolls a one-trip layer scan, so one layer alone is not typical of the stack). The
    slope is XLA's own keep per layer: it counts what XLA fuses away or recomputes (an
    ``exp`` re-derived from its logits, a remat policy's recomputation), which a count of
    autodiff's residuals overstates, and how XLA packs the stack's buffers at depth.
    ``expert_rows``: the experts of each MoE layer run on an expert-parallel device's
    receive buffer of that many rows (``expert_side_rows``)."""
    deep = min(cfg.model.num_moe_layers, CALIBRATION_MOE_LAYERS)
    shallow = max(deep - 1, 0)
    start = time.perf_counter()
    started = {}
    for n in sorted({shallow, deep}):
        progress(f"memory budget: lowering the step with {n} MoE layer(s) and compiling it "
                 "to measure XLA's activation memory (minutes for an FP8 step on a GPU)")
        started[n] = start_compile(_at_depth(cfg, micro_batch, n), True, expert_rows)
    beyond = {}
    for n, (future, abstract) in started.items():
        analysis = future.result()
        progress(f"memory budget: {n} MoE layer(s) compiled, "
                 f"{time.perf_counter() - start:.0f} s after the first lowering began")
        grads = sum(_nbytes(x.shape, x.dtype) for x in jax.tree.leaves(abstract.params))
        beyond[n] = analysis.temp_size_in_bytes - grads
    per_layer = max(beyond[deep] - beyond[shallow], 0)
    return DepthFit(per_layer, max(beyond[shallow] - shallow * per_layer, 0), (shallow, deep))


def _sized_transport(cfg: ExperimentConfig, mesh: MeshSpec, micro_batch: int,
                     transport: str) -> Any:
    """The MoE layers' transport as the layer sizes it (``expert.make_transport``), or None
    without an exchange."""
    m = cfg.model
    if mesh.expert == 1 or m.num_moe_layers == 0:
        return None
    options = dataclasses.replace(cfg.expert_parallel, transport=transport)
    return make_transport(options, mesh.expert, (), micro_batch * cfg.train.seq_len,
                          m.num_experts_per_tok, m.n_routed_experts)


def expert_side_rows(cfg: ExperimentConfig, mesh: MeshSpec, micro_batch: int,
                     transport: str) -> int | None:
    """Rows an expert-parallel device's experts run on, and every MoE layer's backward
    keeps: the receive buffer, sized for the dropless worst case (ep x T x min(k, E/ep))
    or the capacity. None on one device. On 4 x H200 (``small``, ep = 4) it is 4x the
    routed rows, and the budget that left it out under-counted the step by 2.5x
    (docs/performance.md, session 37)."""
    sized = _sized_transport(cfg, mesh, micro_batch, transport)
    if sized is None:
        return None
    return sized.recv_rows if transport == "ragged" else sized.ep * sized.capacity


def exchange_bytes(cfg: ExperimentConfig, mesh: MeshSpec, micro_batch: int,
                   transport: str) -> int:
    """One MoE layer's expert-parallel send + receive buffers on one device, as the
    layer's own transport sizes them (``expert.make_transport``)."""
    sized = _sized_transport(cfg, mesh, micro_batch, transport)
    if sized is None:
        return 0
    row_bytes = _nbytes((cfg.model.hidden_size,), cfg.train.compute_dtype)
    if transport == "ragged":
        return (sized.num_rows + sized.recv_rows) * row_bytes
    return 2 * sized.ep * sized.capacity * (row_bytes + 4)  # tokens and int32 ids, both ways


class PipelineTerms(NamedTuple):
    held: int  # bytes: the busiest rank's gathered stage rows, parameters + gradients
    stage_share: float  # the largest stage's layers over all layers
    buffers: int  # bytes: stage inputs and gradients the busiest rank's buffers hold


def pipeline_terms(cfg: ExperimentConfig, mesh: MeshSpec, params: Any, micro_batch: int
                   ) -> PipelineTerms:
    """What the pipeline executor adds on a device, for ``micro_batch`` sequences per
    micro-batch; ``params`` is the abstract parameter state."""
    schedule = build_schedule(cfg.train.pipeline_schedule, mesh.pipe,
                              cfg.train.microbatches_on(mesh.pipe))
    plan = StagePlan.split(cfg.model, schedule.num_stages)
    placement = ParamPlacement.build(plan, schedule)
    held = [0] * mesh.pipe
    for keys, variable in nnx.to_flat_state(params):
        leaf = variable.get_value()
        # gathered over data, routed experts still split over expert (executor._gather_data)
        shape = [n // mesh.expert if axis == "expert" and n % mesh.expert == 0 else n
                 for n, axis in zip(leaf.shape, param_logical_axes(keys, leaf.ndim))]
        for rank in range(mesh.pipe):
            if keys[0] in placement.stacks:
                rows = len(placement.stacks[keys[0]].held[rank])
                held[rank] += rows * _nbytes(shape[1:], leaf.dtype)
            else:
                held[rank] += _nbytes(shape, leaf.dtype)
    tables = tick_tables(schedule)
    entries = max(a + g for a, g in zip(tables.act_entries, tables.grad_entries))
    entry = _nbytes((micro_batch, cfg.train.seq_len, cfg.model.hidden_size),
                    cfg.train.compute_dtype)
    largest = max(end - start for start, end in plan.layers)
    return PipelineTerms(2 * max(held), largest / cfg.model.num_hidden_layers,
                         entries * entry)


def estimate(cfg: ExperimentConfig, mesh: MeshSpec | None = None, *,
             micro_batch: int | None = None, device_memory: int | None = None,
             progress: Progress = _silent) -> Budget:
    """The per-device budget of ``cfg``'s train step on ``mesh`` (default ``cfg.mesh``).

    ``micro_batch``: sequences per device per forward/backward (default: the global batch
    over data x expert and ``train.microbatches``, as the train step runs it). Compiles two
    reduced-depth copies of the step (``depth_fit``), reporting each to ``progress``.
    """
    mesh = mesh or cfg.mesh
    tc = cfg.train
    batch_shards = tc.batch_shards(mesh)
    if micro_batch is None:
        if tc.batch_size % batch_shards:
            raise ConfigError(f"train.batch_size={tc.batch_size}: must divide over data x "
                              f"expert x train.microbatches = {batch_shards}, or pass a "
                              "micro-batch")
        micro_batch = tc.batch_size // batch_shards
    transport = cfg.expert_parallel.resolved_transport()

    _, init = state_initializer(cfg, mesh.pipe)
    abstract: TrainState = jax.eval_shape(init, jnp.uint32(0))
    shardings = train_state_shardings(abstract, _abstract_mesh(mesh), make_optimizer(tc),
                                      tc.zero_stage)
    params = per_device_bytes(abstract.params, shardings.params)
    # The gradients and their accumulator are counted in the optimizer state's layout,
    # split over data, under ZeRO-1 too (the update they feed is sharded there). Against
    # XLA's step on 8 CPU devices, data=8 ZeRO-1 (session 58): tiny -10.5% (whole copies:
    # +1.4%); 5 layers, seq 32, batch 16: -7.7% (+16.8%), and with 2 micro-batches +4.4%
    # (+58.2%).
    grads = per_device_bytes(abstract.params,
                             state_shardings(abstract.params, _abstract_mesh(mesh), zero=3))
    biases = per_device_bytes(abstract.biases, shardings.biases)
    optimizer = per_device_bytes(abstract.opt_state, shardings.opt_state)
    snapshot = (largest_snapshot_bytes(abstract.params, shardings.params, tc.ema_every)
                if tc.ema_decay else 0)
    pipeline = (pipeline_terms(cfg, mesh, abstract.params, micro_batch) if mesh.pipe > 1
                else PipelineTerms(0, 1.0, 0))
    expert_rows = expert_side_rows(cfg, mesh, micro_batch, transport)
    fit = depth_fit(_resolved_for(cfg, mesh.pipe), micro_batch, progress, expert_rows)
    saved = fit.per_moe_layer * cfg.model.num_moe_layers
    gathered = (_gathered_layer(abstract.params, shardings.params, mesh.data)
                if tc.zero_stage == 3 and mesh.data > 1 else 0)
    exchange = exchange_bytes(cfg, mesh, micro_batch, transport)

    tokens = micro_batch * tc.seq_len
    accumulating = mesh.pipe == 1 and tc.microbatches_on(1) > 1
    terms = (
        Term("parameters", params + biases,
             f"FP32 master, ZeRO-{tc.zero_stage} over data={mesh.data}, "
             f"experts over expert={mesh.expert}"),
        Term("gradients", grads, f"FP32, split over data={mesh.data} like the optimizer "
                                 "state"),
        Term("gradient accumulator", grads if accumulating else 0,
             f"FP32 sum over {tc.microbatches_on(1)} micro-batches" if accumulating
             else "n/a (pipelined)" if mesh.pipe > 1 else "n/a (train.microbatches=1)"),
        Term("optimizer state", optimizer, f"AdamW moments in {tc.moments_dtype}, sharded "
                                           "over data"),
        Term("EMA", params if tc.ema_decay else 0,
             "host RAM, blended by a host thread" if tc.ema_decay else "off",
             on_device=False),
        Term("EMA snapshot", snapshot,
             f"the largest of {tc.ema_every} parameter groups, copied out for the host "
             "while the next step runs" if snapshot else "n/a (no EMA)", in_step=False),
        Term("pipeline stage rows held", pipeline.held,
             "gathered stage rows and their gradients, busiest rank" if pipeline.held
             else "n/a (pipe=1)"),
        Term("saved activations", int(saved * pipeline.stage_share) + pipeline.buffers,
             f"{cfg.model.num_moe_layers} MoE layers x {fit.per_moe_layer / GIB:.3f} GiB "
             f"(XLA's temp growth from {fit.depths[0]} to {fit.depths[1]} MoE layers, "
             f"less that layer's gradients); "
             f"micro-batch {micro_batch} x {tc.seq_len} tokens"
             + (f", experts on {expert_rows} received rows" if expert_rows else "")
             + f", remat={tc.remat}, "
             f"precision={tc.precision}, compute {tc.compute_dtype}"
             + (f"; {pipeline.stage_share:.0%} of the layers recomputed per B, "
                f"{pipeline.buffers / GIB:.3f} GiB of stage inputs in flight"
                if mesh.pipe > 1 else "")),
        Term("backward workspace", fit.rest, "XLA temp of the reduced copies beyond "
                                             "gradients and the MoE layers' keep: dense "
                                             "layers, MTP, loss head, working set"),
        Term("ZeRO-3 gathered layer", gathered,
             "one layer's weights all-gathered over data" if gathered else "n/a"),
        Term("expert exchange buffers", exchange,
             f"{transport} all_to_all over expert={mesh.expert}, {tokens} tokens"
             if exchange else "n/a (expert=1)"),
    )
    title = (f"memory budget per device: {cfg.model.hidden_size}-wide, "
             f"{cfg.model.num_hidden_layers} layers, mesh {mesh}, "
             f"backend {jax.default_backend()}")
    return Budget(terms, device_memory, title)


def device_memory_limit(device: jax.Device) -> int | None:
    """The allocator's limit on ``device`` (GPU/TPU), None where the runtime has none."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def allocator_share_hint(platform: str, environ: Mapping[str, str]) -> str:
    """Where the limit is JAX's default share of a GPU, how to raise it: JAX's GPU client
    takes 75% of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise. The `small`
    step at batch 64 (71.82 GiB) needs 0.95 on an 80 GB H100 (docs/performance.md,
    session 47)."""
    if platform != "gpu" or "XLA_PYTHON_CLIENT_MEM_FRACTION" in environ:
        return ""
    return (" JAX's allocator holds 75% of the GPU by default; "
            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives it more.")


def check_fits(cfg: ExperimentConfig, device: jax.Device, progress: Progress = _silent
               ) -> Budget | None:
    """Raises ConfigError with the budget table when the step cannot fit on ``device``."""
    limit = device_memory_limit(device)
    if limit is None:
        return None
    budget = estimate(cfg, device_memory=limit, progress=progress)
    if not budget.fits:
        raise ConfigError(
            f"the train step needs about {budget.device_total / GIB:.2f} GiB per device, "
            f"more than the {limit / GIB:.2f} GiB the device has; the largest term is "
            f"{budget.largest.name} ({budget.largest.bytes / GIB:.2f} GiB). Shrink it "
            f"(e.g. train.batch_size, train.seq_len, train.remat=selective|full, "
            f"train.moments_dtype=bfloat16, a larger data axis; train.microbatches=K runs "
            f"the same batch as K passes: one micro-batch's activations plus an FP32 "
            f"gradient accumulator).{allocator_share_hint(device.platform, os.environ)}"
            f"\n{budget.table()}")
    return budget


def at_micro_batch(cfg: ExperimentConfig, micro_batch: int | None) -> ExperimentConfig:
    """``cfg`` with ``micro_batch`` sequences a step (as it is for None)."""
    if micro_batch is None:
        return cfg
    return apply_overrides(cfg, [f"train.batch_size={micro_batch}"])


def compiled_peak(cfg: ExperimentConfig, micro_batch: int | None = None, *,
                  autotune: bool = True, dump_to: str | None = None) -> tuple[int, Any]:
    """XLA's own peak (arguments + temp) of the real one-device step, and its analysis;
    ``micro_batch``: the step's batch (``at_micro_batch``; with ``train.microbatches`` = k
    each pass runs a k-th of it); ``dump_to`` as in ``_memory_analysis`` (a dumped compile
    is never remembered)."""
    cfg = at_micro_batch(cfg, micro_batch)
    if dump_to is None:
        analysis = start_compile(cfg, autotune)[0].result()
    else:
        analysis = _memory_analysis(_lower_step(cfg)[0], autotune, dump_to)
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes, analysis


def check_compilable_here(mesh: MeshSpec) -> None:
    """A clear error, before any compile, where ``compiled_peak_on_mesh`` cannot run."""
    if jax.device_count() < mesh.size:
        raise ConfigError(f"--validate with --mesh {mesh}: needs {mesh.size} devices, this "
                          f"host has {jax.device_count()}")


def compiled_peak_on_mesh(cfg: ExperimentConfig, mesh: MeshSpec) -> tuple[int, Any]:
    """XLA's per-device peak (arguments + temp) of the real step on ``mesh``, sharded as
    the trainer shards it (the pipeline executor's step where ``mesh.pipe`` > 1) and
    compiled (never run) on this host's devices, and its analysis: what ``--validate``
    checks a mesh's budget against (on CPU, simulated devices do).
    ``cfg.train.batch_size`` is the global batch."""
    check_compilable_here(mesh)
    cfg = dataclasses.replace(cfg, mesh=mesh)
    device_mesh = build_mesh(mesh, jax.devices()[:mesh.size])
    graphdef, init = state_initializer(cfg)
    abstract = jax.eval_shape(init, jnp.uint32(0))
    shardings = train_state_shardings(abstract, device_mesh, make_optimizer(cfg.train),
                                      cfg.train.zero_stage)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32,
                                  sharding=batch_sharding(device_mesh))
    step = make_train_step(graphdef, cfg, state_shardings=shardings,
                           batch_sharding=batch_sharding(device_mesh),
                           loss_and_grads=pipelined(graphdef, cfg))
    with jax.set_mesh(device_mesh), expert_parallel_options(cfg.expert_parallel):
        analysis = step.lower(placed, tokens).compile(
            compiler_options=MEASURE_OPTIONS).memory_analysis()
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes, analysis

"""The training run: data, state (fresh or restored), the step loop, eval, checkpoints.

Order of checks matters: everything that can be wrong with the input (config, mesh, data,
the run dir's previous contents) is checked before anything is written, and nothing here
ever deletes a complete checkpoint (Orbax's ``max_to_keep`` only drops the oldest after a
newer one is complete).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax import profiling
from moejax.config import ConfigError
from moejax.data.corpus import resolve_data_dir
from moejax.data.pipeline import LoaderSpec, make_dataset, windows
from moejax.data.shards import read_info, unigram_entropy
from moejax.memory.budget import GIB, check_fits
from moejax.memory.ema import HostEMA, largest_snapshot_bytes
from moejax.parallel.expert import ExpertParallelOptions, expert_parallel_options
from moejax.parallel.mesh import build_mesh
from moejax.parallel.sharding import batch_sharding
from moejax.train.checkpoint import Checkpointer, check_config
from moejax.train.config import ExperimentConfig
from moejax.train.flops import mfu, peak_flops, train_flops_per_token
from moejax.train.metrics import DEVICE_LOAD, MetricsLog, progress_line
from moejax.train.optimizer import make_optimizer, schedule_change, updates_applied
from moejax.train.placement import train_state_shardings
from moejax.train.step import (TrainState, attention_implementation, layer_loop,
                               make_eval_step, make_train_step, pipelined, state_initializer)


class _Dispatched(NamedTuple):
    """A step the device has been given and the host has not read back yet."""
    step: int
    metrics: dict  # device arrays
    data_state: dict  # the loader's state before the step's batch (to replay it)


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """A ``jax.profiler`` trace of ``steps`` training steps into ``dir``, taken after the
    compiling step and one more (both unlike the rest), and accounted in the log."""

    dir: pathlib.Path
    steps: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError(f"--profile-steps {self.steps}: must be a positive integer")

    def window(self, first: int, last: int) -> range:
        """The traced steps of a run that goes from after ``first`` to ``last``."""
        start = first + 3
        if start + self.steps - 1 > last:
            raise ConfigError(
                f"--profile-steps {self.steps}: the run trains steps {first + 1}-{last}, and "
                f"tracing starts at step {start} (after the compiling step and one more); "
                "raise --steps or lower --profile-steps")
        return range(start, start + self.steps)

    def process_dir(self) -> pathlib.Path:
        """Where this process writes (one folder per process where there are several)."""
        if jax.process_count() == 1:
            return self.dir
        return self.dir / f"process_{jax.process_index()}"


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says what was kept."""


@dataclasses.dataclass
class Summary:
    """What a finished run reports (also printed as its last lines)."""

    first_step: int
    last_step: int
    losses: dict[int, float]
    eval_losses: dict[int, float]
    unigram_entropy: float
    wall_s: float
    median_step_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_memory_gib: float | None
    ema_eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)  # EMA weights
    # with an expert axis, over the median's steps: the busiest device's share of the routed
    # copies over the mean, which an expert-parallel step waits for (docs/multi_gpu_runs.md)
    median_device_load: float | None = None
    # seconds the training thread waited for the host EMA's blends (None: no EMA)
    ema_backlog_s: float | None = None


def peak_memory_gib() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def _loader(cfg: ExperimentConfig, shard_dir: pathlib.Path, split: str) -> LoaderSpec:
    return LoaderSpec(shard_dir=shard_dir, split=split, seq_len=cfg.train.seq_len,
                      global_batch=cfg.train.batch_size, seed=cfg.train.seed,
                      process_index=jax.process_index(), process_count=jax.process_count())


def _read_finished(finished: list[_Dispatched], compiling_step: int, last: float
                   ) -> tuple[list[tuple[_Dispatched, dict, float]], float]:
    """Each finished step's metrics (waiting on the device for them) with its wall time
    since the step before, and the time of the last read. Two steps read in one go (before
    an eval or a save): on an asynchronous device each wait spans one step; on a host that
    runs a step while dispatching it (XLA:CPU), each interval holds the next step's run,
    so the first of the two holds the second's and the second ~0 (a "0 ms" last step in
    every CPU run). Either way each of the two took the longer interval, unless one of
    them is the step that compiled."""
    read = []
    for done in finished:
        metrics = jax.device_get(done.metrics)
        now = time.perf_counter()
        read.append((done, metrics, now - last))
        last = now
    if len(read) == 2 and compiling_step not in (read[0][0].step, read[1][0].step):
        longer = max(read[0][2], read[1][2])
        read = [(done, metrics, longer) for done, metrics, _ in read]
    return read, last


def exchange_note(cfg: ExperimentConfig) -> str:
    """The start-up line's word on the expert exchange: its transport and token format, or
    none, saying so where an expert_parallel setting then has no effect."""
    options = cfg.expert_parallel
    if cfg.mesh.expert > 1:
        return (f"expert transport {options.resolved_transport()} (tokens travel as "
                f"{options.token_format})")
    unused = [f"{name}={getattr(options, name)!r}" for name in ("capacity_factor", "token_format")
              if getattr(options, name) != getattr(ExpertParallelOptions(), name)]
    return "expert transport none" + (
        f" ({', '.join(f'expert_parallel.{u}' for u in unused)} unused without an expert "
        "axis: every token reaches its experts on its own device)" if unused else "")


def microbatch_note(cfg: ExperimentConfig) -> str:
    """How the step splits its batch, for the start-up log line ("" in one pass)."""
    m = cfg.num_microbatches
    if cfg.mesh.pipe > 1:
        return f"; pipeline {cfg.train.pipeline_schedule} over {m} micro-batches"
    if m > 1:
        return (f"; gradients accumulated over {m} micro-batches of "
                f"{cfg.train.batch_size // m} sequences")
    return ""


def held_out_note(available: int, cfg: ExperimentConfig) -> str:
    """What each held-out evaluation reads. The loader repeats the split, so a split with
    fewer windows than the evaluation reads counts some of them twice: said at start-up."""
    reads = cfg.train.eval_batches * cfg.train.batch_size
    note = (f"held-out: {cfg.train.eval_batches} batches of {cfg.train.batch_size} "
            f"sequences every {cfg.train.eval_every} steps, from {available:,} windows")
    if available < reads:
        fits = available // cfg.train.batch_size
        note += (f"; the {reads} reads repeat some of them (" + (
            f"train.eval_batches={fits} reads each at most once)" if fits else
            "the split holds fewer windows than one batch)"))
    return note


class Trainer:
    """One run in one run dir; ``run()`` trains to ``cfg.train.steps``."""

    def __init__(self, cfg: ExperimentConfig, run_dir: pathlib.Path, *, resume: bool,
                 log=print, trace: StepTrace | None = None):
        self.cfg, self.run_dir = cfg, pathlib.Path(run_dir)
        # Multi-process runs: process 0 speaks and writes the run dir's own files.
        self.primary = jax.process_index() == 0
        self.log = log if self.primary else (lambda message: None)
        # A one-device mesh is a single-device run even where more devices exist.
        self.mesh = build_mesh(cfg.mesh, jax.devices()[:1] if cfg.mesh.size == 1 else None)
        self.shard_dir = resolve_data_dir(cfg.data.dir)
        self.data_info = read_info(self.shard_dir)
        if self.data_info.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: must be >= the "
                              f"{self.data_info.vocab_size} ids of the data's "
                              f"{self.data_info.tokenizer} tokenizer ({self.shard_dir})")
        if cfg.train.eval_every:  # the first eval reads it: fail before training, not there
            self.log(held_out_note(len(windows(_loader(cfg, self.shard_dir, "val"))), cfg))
        if trace and not resume:  # a fresh run starts at 0: refuse before Orbax's threads
            trace.window(0, cfg.train.steps)
        self.ckpt = Checkpointer(self.run_dir, cfg.checkpoint, self.log)
        self.resume_step = self.ckpt.latest_step()
        if self.resume_step is not None and not resume:
            raise ConfigError(f"run dir {self.run_dir} already holds checkpoints (latest step "
                              f"{self.resume_step}); pass --resume to continue it or choose "
                              "another --run-dir")
        self.traced = trace.window(self.resume_step or 0, cfg.train.steps) if trace else range(0)
        self.trace = trace
        # the configuration the run dir's checkpoints were written under (None: a new dir)
        self.recorded = check_config(self.run_dir, cfg.to_dict(),
                                     has_checkpoints=self.resume_step is not None,
                                     record=self.primary)

    def _report_data(self) -> float:
        info, entropy = self.data_info, unigram_entropy(self.shard_dir)
        self.log(f"data: {info.source} -> {self.shard_dir}\n"
                 f"  {info.source_bytes / 1e6:.1f} MB of text, {info.tokenizer} tokenizer "
                 f"(vocab {info.vocab_size}); train {info.tokens['train']:,} tokens in "
                 f"{info.documents['train']} documents, held-out {info.tokens['val']:,} "
                 f"tokens in {info.documents['val']} documents\n"
                 f"  unigram entropy of the train split: {entropy:.4f} nats/token")
        return entropy

    def _evaluate(self, eval_step, state: TrainState, batch_sharding) -> float:
        it = iter(make_dataset(_loader(self.cfg, self.shard_dir, "val"), shuffle=False))
        losses = [float(eval_step(state, jax.make_array_from_process_local_data(
            batch_sharding, next(it)))) for _ in range(self.cfg.train.eval_batches)]
        return float(np.mean(losses))

    def run(self) -> Summary:
        """Trains to ``train.steps``; every step is traced under the run's mesh."""
        # Before any state is allocated or the step compiled (and outside the mesh: the
        # budget traces one device's share): a step that cannot fit fails here with the
        # budget table, not with an allocator traceback. Only where the runtime reports a
        # memory limit (GPU/TPU).
        budget = check_fits(self.cfg, jax.local_devices()[0], self.log)
        if budget is not None:
            self.log(f"memory budget {budget.device_total / GIB:.2f} of "
                     f"{budget.device_memory / GIB:.2f} GiB per device")
        with jax.set_mesh(self.mesh), expert_parallel_options(self.cfg.expert_parallel):
            return self._run()

    def _run(self) -> Summary:
        cfg, tc = self.cfg, self.cfg.train
        start_wall = time.perf_counter()
        entropy = self._report_data()
        graphdef, init = state_initializer(cfg)
        abstract = jax.eval_shape(init, jnp.uint32(tc.seed))
        state_sh = train_state_shardings(abstract, self.mesh, make_optimizer(tc), tc.zero_stage)
        ema = HostEMA(tc.ema_decay, state_sh.params, tc.ema_every) if tc.ema_decay else None
        if ema:
            snapshot = largest_snapshot_bytes(abstract.params, state_sh.params, ema.every)
            self.log(f"host EMA: the parameters in {ema.every} group(s); each step copies one "
                     f"(at most {snapshot / 1e6:,.1f} MB per device) to host memory while the "
                     f"next step runs, and a host thread blends it (train.ema_every; "
                     "docs/memory.md)")
        batch_sh = batch_sharding(self.mesh)
        self.log(f"mesh {cfg.mesh} over {self.mesh.size} device(s) in {jax.process_count()} "
                 f"process(es); ZeRO-{tc.zero_stage}; {exchange_note(cfg)}; GEMMs "
                 f"{tc.precision}, attention core {attention_implementation(cfg)}, layer loop "
                 f"{layer_loop(cfg)}{microbatch_note(cfg)}")
        train_iter = iter(make_dataset(_loader(cfg, self.shard_dir, "train")))
        if self.resume_step is None:
            state = jax.jit(init, out_shardings=state_sh)(jnp.uint32(tc.seed))
            if ema:
                ema.start(state.params)
            self.log(f"fresh start in {self.run_dir} (seed {tc.seed})")
        else:
            target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                     sharding=sh),
                                  abstract, state_sh)
            state, data_state, ema_arrays = self.ckpt.restore(
                self.resume_step, target, ema.abstract(abstract.params) if ema else None)
            if ema:
                ema.load(ema_arrays)
                del ema_arrays
            train_iter.set_state(self._loader_state(data_state))
            self.log(f"resumed {self.run_dir} from step {self.resume_step}")
            # the schedule reads the optimizer's count, which skipped steps leave behind
            change = self.recorded and schedule_change(
                self.recorded["train"], tc, int(updates_applied(state.opt_state)))
            if change:
                self.log(f"resume: {change}")
        first = int(state.step)
        metrics_log = MetricsLog(self.run_dir, resume_step=first, enabled=self.primary)
        eval_step = make_eval_step(graphdef, cfg, state_shardings=state_sh,
                                   batch_sharding=batch_sh)
        flops_per_token = train_flops_per_token(cfg.model, tc.seq_len)
        peak = peak_flops(jax.devices()[0].device_kind, tc.peak_tflops)
        losses: dict[int, float] = {}
        evals: dict[int, float] = {}
        ema_evals: dict[int, float] = {}
        step_times: list[float] = []
        device_loads: list[float] = []
        train_step = make_train_step(graphdef, cfg, state_shardings=state_sh,
                                     batch_sharding=batch_sh,
                                     loss_and_grads=pipelined(graphdef, cfg), latched=True)
        halt = jnp.bool_(False)  # stays False under train.nonfinite=skip
        pending: _Dispatched | None = None
        try:
            last = time.perf_counter()
            for step in range(first + 1, tc.steps + 1):
                if self.traced and step == self.traced.start:
                    jax.profiler.start_trace(str(self.trace.process_dir()))
                data_state = train_iter.get_state()
                batch = jax.make_array_from_process_local_data(batch_sh, next(train_iter))
                state, metrics = train_step(state, batch, halt)
                if tc.nonfinite == "stop":  # a non-finite step halts every later one
                    halt = ~metrics["finite"]
                if ema:  # dispatched before the host waits on the step
                    ema.update(step, state.params, metrics["finite"])
                # The host reads a step's metrics while the device runs the next one, and
                # waits on a step at once only where it needs that step's state.
                finished = [pending] if pending else []
                pending = _Dispatched(step, metrics, data_state)
                if self._evaluates(step) or self._saves(step):
                    finished, pending = finished + [pending], None
                read, last = _read_finished(finished, first + 1, last)
                for done, metrics, step_time in read:
                    record = self._record(done.step, metrics, step_time, flops_per_token,
                                          peak, compiled=done.step == first + 1)
                    if metrics["finite"]:
                        losses[done.step] = record["loss"]
                    else:  # stop: raises; skip: the state is the last good one, step on
                        self._nonfinite(done.step, state, done.data_state, record,
                                        metrics_log, ema)
                    if done.step > first + 1 and done.step not in self.traced:
                        step_times.append(step_time)
                        if DEVICE_LOAD in record:
                            device_loads.append(record[DEVICE_LOAD])
                    current = done.step == step  # the state is this step's
                    saves, evaluates = (current and self._saves(step),
                                        current and self._evaluates(step))
                    if saves:  # first: an eval that fails loses nothing
                        self.ckpt.save(step, state, self._data_item(train_iter.get_state()),
                                       ema.arrays() if ema else None)
                    if evaluates:
                        record["eval_loss"] = evals[step] = self._evaluate(
                            eval_step, state, batch_sh)
                        if ema:  # the EMA visits the device only for the eval's duration
                            ema_params = ema.arrays(state_sh.params)
                            record["ema_eval_loss"] = ema_evals[step] = self._evaluate(
                                eval_step, state._replace(params=ema_params), batch_sh)
                            del ema_params
                    if saves or evaluates:
                        last = time.perf_counter()  # save and eval time are not step time
                    metrics_log.write(record)
                    if (done.step % tc.log_every == 0 or done.step == first + 1
                            or done.step == tc.steps):
                        self.log(progress_line(record) + (
                            f" | held-out {record['eval_loss']:.4f}" if "eval_loss" in record
                            else "") + (f" (EMA {record['ema_eval_loss']:.4f})"
                                        if "ema_eval_loss" in record else ""))
                if self.traced and step == self.traced[-1]:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    self._report_trace()
                    last = time.perf_counter()  # the trace's write-out is not step time
        finally:
            if ema:  # first: it never raises, and it stops the blending thread
                ema.close()
            metrics_log.close()
            self.ckpt.close()
        median = statistics.median(step_times) if step_times else None
        tps = tc.tokens_per_step / median if median else None
        summary = Summary(first, int(state.step), losses, evals, entropy,
                          time.perf_counter() - start_wall, median, tps,
                          mfu(tps, flops_per_token, peak, self.mesh.size) if tps else None,
                          peak_memory_gib(), ema_eval_losses=ema_evals,
                          median_device_load=(statistics.median(device_loads) if device_loads
                                              else None),
                          ema_backlog_s=ema.backlog_seconds if ema else None)
        self._report_summary(summary)
        return summary

    def _evaluates(self, step: int) -> bool:
        """Whether the held-out loss is measured after ``step``."""
        tc = self.cfg.train
        return bool(tc.eval_every) and (step % tc.eval_every == 0 or step == tc.steps)

    def _saves(self, step: int) -> bool:
        """Whether ``step``'s state is checkpointed (every ``checkpoint.every`` and the last)."""
        return step % self.cfg.checkpoint.every == 0 or step == self.cfg.train.steps

    def _record(self, step: int, metrics: dict, step_time: float, flops_per_token: float,
                peak: float | None, *, compiled: bool) -> dict[str, Any]:
        tokens_per_s = self.cfg.train.tokens_per_step / step_time
        record = {"step": step, **{k: v.item() for k, v in metrics.items()},
                  "step_time_s": step_time, "tokens_per_s": tokens_per_s,
                  "mfu": mfu(tokens_per_s, flops_per_token, peak, self.mesh.size),
                  "peak_memory_gib": peak_memory_gib()}
        if self.cfg.mesh.expert > 1:  # what the expert exchange moved
            record["expert_tokens_format"] = self.cfg.expert_parallel.token_format
        if compiled:
            record["includes_compile"] = True
        if step in self.traced:
            record["traced"] = True
        return record

    def _report_trace(self) -> None:
        """The traced steps' account, from this process's first device."""
        where = self.trace.process_dir()
        lines = profiling.account(profiling.load_kernel_events(where), len(self.traced))
        self.log(f"trace of steps {self.traced.start}-{self.traced[-1]} in {where}"
                 + ("" if lines else " (no accelerator kernels in it: XLA:CPU)"))
        for line in lines:
            self.log(line)

    def _data_item(self, loader_state: dict) -> dict:
        """A checkpoint's data item: the loader's position and the shards it counts in."""
        return {"loader": loader_state, "shards": dataclasses.asdict(self.data_info)}

    def _loader_state(self, item: dict) -> dict:
        """The loader's position in a checkpoint's data item, after checking the shards are
        the ones it counts in: ``data.dir=embedded`` names a corpus built for the running
        Python, and a shard folder can be rebuilt in place, so the same config could
        resume on another token stream. Checkpoints from before session 59 hold the
        position alone and are taken as they are."""
        if "loader" not in item:
            return item
        now = dataclasses.asdict(self.data_info)
        if item["shards"] != now:
            diffs = "; ".join(f"{key}: {item['shards'].get(key)!r} -> {now.get(key)!r}"
                              for key in sorted(now) if item["shards"].get(key) != now[key])
            raise ConfigError(f"the data in {self.shard_dir} is not what the checkpoint at "
                              f"step {self.resume_step} was trained on ({diffs}); point "
                              "data.dir at those shards or use a new --run-dir")
        return item["loader"]

    def _nonfinite(self, step: int, state: TrainState, data_state: dict, record: dict,
                   metrics_log: MetricsLog, ema: HostEMA | None = None) -> None:
        """Skip: says so (the batch is consumed; the step's record is written with the
        others). Stop: writes the record, saves the last good state (unchanged by the step)
        and raises."""
        if self.cfg.train.nonfinite == "skip":
            self.log(f"step {step}: non-finite loss ({record['total_loss']}), batch skipped")
            return
        metrics_log.write(record)
        good = step - 1
        if self.ckpt.latest_step() != good:
            self.ckpt.save(good, state._replace(step=jnp.full_like(state.step, good)),
                           self._data_item(data_state), ema.arrays() if ema else None)
        raise TrainingError(
            f"non-finite loss at step {step} (loss {record['total_loss']}, grad norm "
            f"{record['grad_norm']}); the last good state (step {good}) is checkpointed in "
            f"{self.ckpt.directory}. Resume it with a lower train.lr (--resume --set "
            f"train.lr=...), or with --set train.nonfinite=skip")

    def _report_summary(self, s: Summary) -> None:
        if not s.losses:
            self.log(f"nothing to do: the run is already at step {s.last_step} "
                     f">= --steps {self.cfg.train.steps}")
            return
        first_loss, final_loss = s.losses[min(s.losses)], s.losses[max(s.losses)]
        lines = [f"done: steps {s.first_step + 1}..{s.last_step} in {s.wall_s:.1f} s; loss "
                 f"{first_loss:.4f} -> {final_loss:.4f} (unigram entropy "
                 f"{s.unigram_entropy:.4f})"]
        if s.eval_losses:
            lines.append(f"held-out loss {s.eval_losses[max(s.eval_losses)]:.4f}")
        if s.ema_eval_losses:
            lines.append(f"EMA held-out loss {s.ema_eval_losses[max(s.ema_eval_losses)]:.4f}")
        if s.median_step_s:
            lines.append(f"median step {s.median_step_s * 1e3:.1f} ms, "
                         f"{s.tokens_per_s:,.0f} tokens/s, MFU "
                         + (f"{s.mfu:.2%}" if s.mfu is not None else "n/a (unknown peak)")
                         + (f", median device load max/mean {s.median_device_load:.2f}"
                            if s.median_device_load is not None else ""))
        if s.peak_memory_gib is not None:
            lines.append(f"peak device memory {s.peak_memory_gib:.2f} GiB")
        if s.ema_backlog_s is not None:
            lines.append(f"the steps waited {s.ema_backlog_s:.1f} s for the host EMA's blends"
                         + (" (a raised train.ema_every gives the host less a step)"
                            if s.ema_backlog_s > 0.05 * s.wall_s else ""))
        self.log("; ".join(lines))

"""The experiment configuration: model + training + data + checkpointing + mesh.

Typed frozen dataclasses validated once at construction (a bad value raises
:class:`~moejax.config.ConfigError` naming field, value and rule). Named presets bundle a
model preset with training settings; ``--set section.field=value`` overrides are parsed
against each field's declared type, so ``--set train.lr=abc`` fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from moejax.config import (ConfigError, ModelConfig, MODEL_PRESETS, check_finite, fail,
                           get_model_preset)
from moejax.memory.remat import POLICIES as REMAT_POLICIES
from moejax.model.attention import ATTENTION_IMPLEMENTATIONS
from moejax.parallel.expert import ExpertParallelOptions
from moejax.parallel.mesh import MeshSpec
from moejax.parallel.pipeline.schedule import SCHEDULES as PIPELINE_SCHEDULE_BUILDERS
from moejax.parallel.pipeline.schedule import ScheduleError, build as build_schedule
from moejax.precision import PRECISIONS

SCHEDULES = ("cosine", "wsd")
DTYPES = ("float32", "bfloat16")
NONFINITE_POLICIES = ("stop", "skip")
LAYER_LOOPS = ("auto", "scan", "unrolled")
PIPELINE_SCHEDULES = tuple(PIPELINE_SCHEDULE_BUILDERS)


def _check_positive_int(section: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            fail(f"{section}.{name}", value, "must be a positive integer")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop settings."""

    steps: int = 1000
    schedule_steps: int | None = None  # LR schedule length; None: the same as steps
    batch_size: int = 16  # global, in sequences
    seq_len: int = 128
    seed: int = 0
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final LR as a fraction of the peak
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine: warmup + cosine; wsd: warmup-constant-decay
    wsd_decay_fraction: float = 0.2  # wsd: the last fraction of schedule_steps decays
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables it
    moments_dtype: str = "float32"  # Adam moments; bfloat16 halves optimizer memory
    compute_dtype: str = "bfloat16"  # activations and matmuls; master weights stay FP32
    mtp_lambda: float = 0.3  # weight of the MTP loss
    bias_update_rate: float = 1e-3  # aux-loss-free router bias step (DeepSeek-V3's gamma)
    nonfinite: str = "stop"  # NaN/inf loss: stop (checkpoint the last good state) or skip
    log_every: int = 10
    eval_every: int = 100  # held-out loss cadence; 0 disables it
    eval_batches: int = 4
    peak_tflops: float | None = None  # per-device peak for MFU; None: guess from the device
    # 3: params, grads and optimizer state sharded over `data` (FSDP); 1: optimizer only
    zero_stage: int = 3
    remat: str = "none"  # recompute policy: none | selective | full (moejax.memory.remat)
    precision: str = "bf16"  # GEMMs of attention and MLP linears: bf16 | fp8 (moejax.precision)
    # softmax core: xla | cudnn (fused flash attention, CUDA GPUs, no pipe axis) | auto (cudnn
    # on a CUDA GPU without a pipe axis, else xla: 1.30x the BF16 step and -16% memory on the
    # small preset, H100; under a pipeline XLA:GPU segfaults compiling it)
    attention: str = "auto"
    # block stacks under autodiff: scan (one compiled layer) | unrolled (one per layer: no
    # residual-stack copies; BF16 small preset on an H100: 0.87x the step time, -6% memory,
    # a longer compile; on pipe=2 stages 0.91x-0.94x) | auto (unrolled on a GPU, else scan)
    layer_loop: str = "auto"
    ema_decay: float | None = None  # host-memory EMA of the weights (moejax.memory.ema)
    # k: the parameters form k groups and each step sends one to the host, where a thread
    # blends it with ema_decay**k, so each weight blends every k steps. The device holds a
    # k-th of the parameters while it leaves; 8 keeps `small` at 0.13 of a copy and its
    # host blend under its steps on an H100, batch 4 (+2.8%) to 64 (moejax.memory.ema)
    ema_every: int = 8
    pipeline_schedule: str = "1f1b"  # --mesh pipe=P > 1: gpipe | 1f1b | dualpipe | dualpipev
    # micro-batches a step's batch runs as: the pipeline's with pipe=P > 1 (None: 2P); else
    # gradient accumulation over that many (None: 1, the batch in one pass)
    microbatches: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("train", self, ("steps", "batch_size", "seq_len", "log_every",
                                            "eval_batches", "ema_every"))
        if self.schedule_steps is not None:
            _check_positive_int("train", self, ("schedule_steps",))
        for name in ("warmup_steps", "eval_every", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(f"train.{name}", value, "must be a non-negative integer")
        if self.seed >= 2**32:  # the step's RNG key and the data order take a uint32
            fail("train.seed", self.seed, f"must be < 2**32 = {2**32}")
        if self.warmup_steps >= self.total_schedule_steps:
            length = ("train.schedule_steps" if self.schedule_steps is not None
                      else "train.steps, as train.schedule_steps is unset")
            fail("train.warmup_steps", self.warmup_steps,
                 f"must be < the schedule length {self.total_schedule_steps} ({length}); "
                 "lower it, or for a run shorter than its schedule set train.schedule_steps")
        check_finite("train.lr", self.lr, 0.0, strict=True)
        if not 0 <= self.min_lr_ratio <= 1:
            fail("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
        if not 0 < self.wsd_decay_fraction <= 1:
            fail("train.wsd_decay_fraction", self.wsd_decay_fraction, "must be in (0, 1]")
        for name in ("eps", "weight_decay", "grad_clip", "mtp_lambda", "bias_update_rate"):
            check_finite(f"train.{name}", getattr(self, name), 0.0, strict=False)
        if self.peak_tflops is not None:
            check_finite("train.peak_tflops", self.peak_tflops, 0.0, strict=True)
        for name, allowed in (("schedule", SCHEDULES), ("moments_dtype", DTYPES),
                              ("compute_dtype", DTYPES), ("nonfinite", NONFINITE_POLICIES),
                              ("remat", REMAT_POLICIES), ("precision", PRECISIONS),
                              ("attention", ("auto", *ATTENTION_IMPLEMENTATIONS)),
                              ("layer_loop", LAYER_LOOPS)):
            if getattr(self, name) not in allowed:
                fail(f"train.{name}", getattr(self, name), f"must be one of {list(allowed)}")
        if self.zero_stage not in (1, 3):
            fail("train.zero_stage", self.zero_stage, "must be 1 or 3")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            fail("train.ema_decay", self.ema_decay, "must be in (0, 1), or None for no EMA")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            fail("train.pipeline_schedule", self.pipeline_schedule,
                 f"must be one of {list(PIPELINE_SCHEDULES)}")
        if self.microbatches is not None:
            _check_positive_int("train", self, ("microbatches",))

    def microbatches_on(self, pipe: int) -> int:
        """Micro-batches per step on ``pipe`` pipeline ranks (train.microbatches; default 2P
        pipelined, 1 without a pipeline)."""
        return self.microbatches or (2 * pipe if pipe > 1 else 1)

    def batch_shards(self, mesh: MeshSpec) -> int:
        """How many pieces a step's batch is cut into on ``mesh``: one per data x expert
        device and micro-batch."""
        return mesh.data * mesh.expert * self.microbatches_on(mesh.pipe)

    @property
    def total_schedule_steps(self) -> int:
        return self.schedule_steps or self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from: ``embedded`` (stdlib corpus) or a shard folder."""

    dir: str = "embedded"

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            fail("data.dir", self.dir, "must be 'embedded' or a shard folder path")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing cadence."""

    every: int = 100  # save every N steps (and at the end)
    keep: int = 3  # keep the last K
    async_save: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("checkpoint", self, ("every", "keep"))


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything a training run depends on; ``to_dict`` is what a run dir records."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshSpec = MeshSpec()
    expert_parallel: ExpertParallelOptions = ExpertParallelOptions()

    def __post_init__(self) -> None:
        depth = self.model.num_nextn_predict_layers
        if self.train.seq_len <= depth:
            fail("train.seq_len", self.train.seq_len,
                  f"must exceed num_nextn_predict_layers={depth} (MTP needs targets)")
        if self.train.seq_len > self.model.max_position_embeddings:
            fail("train.seq_len", self.train.seq_len,
                  f"must be <= model.max_position_embeddings="
                  f"{self.model.max_position_embeddings}")
        if self.mesh.tensor != 1:
            fail("mesh.tensor", self.mesh.tensor,
                  "experiments.train has no tensor parallelism yet; use 1")
        if self.mesh.pipe > 1:
            self._check_pipeline()
        if self.model.num_moe_layers and self.model.n_routed_experts % self.mesh.expert:
            fail("mesh.expert", self.mesh.expert, f"must divide model.n_routed_experts="
                                                  f"{self.model.n_routed_experts}")
        if self.train.batch_size % self.train.batch_shards(self.mesh):
            fail("train.batch_size", self.train.batch_size,
                  f"must divide over the data x expert mesh axes "
                  f"({self.mesh.data} x {self.mesh.expert})"
                  + (f" x {self.num_microbatches} micro-batches (train.microbatches)"
                     if self.num_microbatches > 1 else ""))

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step: the pipeline's (default 2P), or those the gradients are
        accumulated over without a pipe axis (default 1)."""
        return self.train.microbatches_on(self.mesh.pipe)

    def _check_pipeline(self) -> None:
        """The schedule accepts (P, M), and every stage gets at least one layer."""
        try:
            schedule = build_schedule(self.train.pipeline_schedule, self.mesh.pipe,
                                      self.num_microbatches)
        except ScheduleError as e:
            # the field the user sets for the schedule parameter that broke a rule
            field, value = {"num_ranks": ("mesh.pipe", self.mesh.pipe),
                            "name": ("train.pipeline_schedule", self.train.pipeline_schedule),
                            }.get(e.parameter, ("train.microbatches", self.num_microbatches))
            default = (" (the default: 2 x pipe)" if field == "train.microbatches"
                       and self.train.microbatches is None else "")
            fail(field, value, f"--mesh pipe={self.mesh.pipe} with train.pipeline_schedule="
                               f"{self.train.pipeline_schedule!r}{default}: {e}")
        if schedule.num_stages > self.model.num_hidden_layers:
            fail("model.num_hidden_layers", self.model.num_hidden_layers,
                 f"must be >= the {schedule.num_stages} stages of "
                 f"{self.train.pipeline_schedule} on pipe={self.mesh.pipe}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig,
                             "checkpoint": CheckpointConfig, "mesh": MeshSpec,
                             "expert_parallel": ExpertParallelOptions}

TRAIN_PRESETS: dict[str, ExperimentConfig] = {
    # A few minutes on a laptop CPU: loss falls well below the corpus' unigram entropy.
    "tiny": ExperimentConfig(
        model=MODEL_PRESETS["tiny"],
        train=TrainConfig(steps=200, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=20,
                          compute_dtype="float32",  # XLA:CPU emulates BF16 matmuls: ~2x slower
                          bias_update_rate=1e-2,  # balance visibly within a short run
                          eval_every=50, log_every=10),
        checkpoint=CheckpointConfig(every=50)),
    # The first GPU baseline: one H100, byte-level embedded corpus. The router bias keeps
    # DeepSeek-V3's rate: 1e-2 balanced the experts sooner but cost 3-9% of held-out loss
    # at step 200 (docs/performance.md, Expert parallelism, session 40). AdamW's moments
    # are BF16, as DeepSeek-V3 keeps them: on one H100 the step took 123.5 ms instead of
    # 128.5 and 32.7 GiB instead of 39.4; two seeds' held-out loss at step 200 moved
    # -1.4% and +0.6% against FP32 moments' (whose seeds part by 0.6%): no sign either
    # way (docs/performance.md, FP8 training, session 47).
    "small": ExperimentConfig(
        model=MODEL_PRESETS["small"],
        train=TrainConfig(steps=200, batch_size=16, seq_len=1024, lr=1e-3, warmup_steps=20,
                          moments_dtype="bfloat16", eval_every=100, log_every=10),
        checkpoint=CheckpointConfig(every=1000)),
}


def get_experiment_preset(name: str) -> ExperimentConfig:
    """A training preset, or any model preset with default training settings."""
    if name in TRAIN_PRESETS:
        return TRAIN_PRESETS[name]
    if name in MODEL_PRESETS:
        return ExperimentConfig(model=get_model_preset(name))
    known = sorted(set(TRAIN_PRESETS) | set(MODEL_PRESETS))
    raise ConfigError(f"unknown preset {name!r}; known: {known}")


def _coerce(key: str, text: str, kind: Any) -> Any:
    """Parses ``text`` as a value of the annotated type ``kind``."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() in ("none", "null"):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, text, inner)
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
        return json.loads(text)
    except ValueError:
        name = getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{key}={text!r}: expected a value of type {name}") from None


def apply_overrides(config: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """Applies ``section.field=value`` strings; the result is validated as a whole."""
    return dataclasses.replace(config, **overridden_sections(config, overrides))


def overridden_sections(config: ExperimentConfig, overrides: list[str]) -> dict[str, Any]:
    """The sections of ``config`` that ``overrides`` change, with the changes, each section
    validated on its own (not yet against the others: what a caller reads to derive one
    more override, as ``moejax.budget`` derives the batch from a per-device micro-batch)."""
    changes: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE, "
                              f"e.g. train.lr=3e-4 (sections: {sorted(SECTIONS)})")
        if section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; "
                              f"known: {sorted(SECTIONS)}")
        hints = typing.get_type_hints(SECTIONS[section])
        fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if name not in fields:
            raise ConfigError(f"--set {item!r}: unknown field {section}.{name}; "
                              f"known: {fields}")
        changes.setdefault(section, {})[name] = _coerce(key, text.strip(), hints[name])
    return {s: _replaced(s, getattr(config, s), c) for s, c in changes.items()}


def _replaced(section: str, value: Any, changes: dict[str, Any]) -> Any:
    """``value`` (one section) with ``changes``, its validation errors named as the CLI
    names the field: ModelConfig says ``n_group=3`` (Hugging Face's names, for a
    ``config.json``), which here reads ``model.n_group=3``."""
    try:
        return dataclasses.replace(value, **changes)
    except ConfigError as error:
        if str(error).startswith(f"{section}."):
            raise
        raise ConfigError(f"{section}.{error}") from None


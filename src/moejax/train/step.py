"""The train state and the pure train / eval steps.

``train_step(state, tokens) -> (state, metrics)`` is one pure function, jitted with the
state and batch shardings passed in, so a mesh only changes the shardings, not the step.
A step whose loss or gradient norm is not finite leaves parameters, optimizer state,
router biases and RNG exactly as they were (in-graph select) and only counts the batch;
the host decides to stop or go on.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from pallas_kernels.mosaic_common import cuda_compute_capability

from moejax.config import fail
from moejax.model import DeepseekV3, RouterBias
from moejax.model.routing import update_router_bias
from moejax.parallel.pipeline.executor import PipelineExecutor
from moejax.parallel.pipeline.schedule import build as build_schedule
from moejax.parallel.pipeline.storage import logical_stacks, pad_stacks
from moejax.parallel.sharding import split_microbatches
from moejax.precision import Precision
from moejax.train.accumulate import accumulated
from moejax.train.config import ExperimentConfig
from moejax.train.metrics import DEVICE_LOAD
from moejax.train.optimizer import learning_rate, make_optimizer, updates_applied


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: batches consumed so far
    params: nnx.State  # FP32 master weights (nnx.Param), layer stacks padded for the pipe
    biases: nnx.State  # aux-loss-free router biases (RouterBias), not trained by gradients
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data, split once per step


def attention_implementation(cfg: ExperimentConfig, pipe: int | None = None) -> str:
    """``train.attention`` resolved for this process: "auto" is cuDNN's fused attention on a
    CUDA GPU of compute capability >= 9.0 (Hopper and later: cuDNN's flash kernels take
    head dims up to 256 there, 128 before, and MLA's padded q/k/v width is 192 on
    DeepSeek-V3) with a 16-bit compute dtype (its only inputs) and no pipeline axis, and
    XLA's composition elsewhere. "cudnn" off a GPU, in float32 or with a pipeline axis is
    refused: XLA:GPU (jax 0.11.2, H100) segfaults compiling the pipeline executor's step
    with cuDNN attention in it, for every schedule, in BF16 and FP8, while the same model
    compiles with XLA's attention (docs/performance.md, "cuDNN attention under a
    pipeline", session 42). ``pipe``: the pipeline stages to resolve for (default the
    config's mesh; the memory budget compiles one device's share of a pipelined step)."""
    train, pipe = cfg.train, pipe or cfg.mesh.pipe
    choice, sixteen_bit = train.attention, jnp.dtype(train.compute_dtype).itemsize == 2
    if choice == "cudnn" and jax.default_backend() != "gpu":
        fail("train.attention", "cudnn", f"needs a CUDA GPU; this process runs on "
             f"{jax.default_backend()}: use 'xla' or 'auto'")
    if choice == "cudnn" and not sixteen_bit:
        fail("train.attention", "cudnn", f"takes bfloat16 or float16 inputs, and "
             f"train.compute_dtype is {train.compute_dtype}: use 'xla' or 'auto'")
    if choice == "cudnn" and pipe > 1:
        fail("train.attention", "cudnn", f"cannot run under a pipeline (mesh pipe={pipe}): "
             f"XLA:GPU segfaults compiling the pipelined step with it; use 'xla' or 'auto'")
    if choice == "auto":
        capability = cuda_compute_capability()
        return ("cudnn" if sixteen_bit and pipe == 1 and capability is not None
                and capability >= 9.0 else "xla")
    return choice


def layer_loop(cfg: ExperimentConfig) -> str:
    """``train.layer_loop`` resolved for this process: "auto" is "unrolled" on a GPU (the
    scanned loop's residual-stack copies cost 13% of the BF16 `small` step there,
    docs/performance.md, session 27; under ``pipe=2`` unrolled stages were 1.09x (1F1B) and
    1.07x (DualPipe) the scanned step, with no more memory, session 43) and "scan"
    elsewhere, where compile time matters more."""
    if cfg.train.layer_loop == "auto":
        return "unrolled" if jax.default_backend() == "gpu" else "scan"
    return cfg.train.layer_loop


def build_model(cfg: ExperimentConfig, key: jax.Array) -> DeepseekV3:
    return DeepseekV3(cfg.model, rngs=nnx.Rngs(params=key),
                      dtype=jnp.dtype(cfg.train.compute_dtype), param_dtype=jnp.float32,
                      remat=cfg.train.remat, precision=Precision(cfg.train.precision),
                      attention=attention_implementation(cfg),
                      unroll_layers=layer_loop(cfg) == "unrolled")


def state_initializer(cfg: ExperimentConfig, pipe: int | None = None
                      ) -> tuple[nnx.GraphDef, Callable[[jax.Array], TrainState]]:
    """The model's graph and a pure ``init(seed) -> TrainState`` (jit or eval_shape it).
    The layer stacks are stored padded to a multiple of ``pipe`` rows (default
    ``cfg.mesh.pipe``; ``storage.pad_stacks``); the model's values do not depend on it."""
    pipe = pipe or cfg.mesh.pipe
    tx = make_optimizer(cfg.train)

    def init(seed: jax.Array) -> TrainState:
        params_key, rng = jax.random.split(jax.random.key(seed))
        _, params, biases = nnx.split(build_model(cfg, params_key), nnx.Param, RouterBias)
        params = pad_stacks(params, cfg.model, pipe)
        return TrainState(jnp.zeros([], jnp.int32), params, biases, tx.init(params),
                          jax.random.key_data(rng))

    graphdef = nnx.split(nnx.eval_shape(lambda: build_model(cfg, jax.random.key(0))),
                         nnx.Param, RouterBias)[0]
    return graphdef, init


def _max_over_mean(counts: jax.Array) -> jax.Array:
    return counts.max(-1) / jnp.maximum(counts.mean(-1), 1e-9)


def load_balance(counts: jax.Array, expert_devices: int = 1) -> dict[str, jax.Array]:
    """Max over mean tokens per expert (L, E): per MoE layer, then averaged and worst over
    layers. With the experts split over ``expert_devices`` (E/ep consecutive experts on
    each), also max over mean tokens per device, averaged over layers. Every exchange
    waits for the busiest device, so that ratio, not the per-expert one, is what an
    expert-parallel step pays for: on 4 x H100, dropping 9.4 ms of exchange kernels from a
    `small` step moved the same time into the exchanges' barrier waits (session 39)."""
    counts = counts.astype(jnp.float32)
    if counts.shape[0] == 0:
        # No MoE layer (an all-dense model, or the memory budget's dense-only probe):
        # nothing is routed, so read it as one evenly loaded layer.
        counts = jnp.ones((1, counts.shape[-1]), jnp.float32)
    ratio = _max_over_mean(counts)
    balance = {"expert_load_max_over_mean": ratio.mean(), "expert_load_worst": ratio.max()}
    if expert_devices > 1:
        per_device = counts.reshape(*counts.shape[:-1], expert_devices, -1).sum(-1)
        balance[DEVICE_LOAD] = _max_over_mean(per_device).mean()
    return balance


# (params, biases, tokens) -> ((total, (main, mtp, out)), grads); ``out`` needs the
# ModelLosses fields expert_counts, aux_loss, dropped_tokens and cross_node_tokens.
LossAndGrads = Callable[[nnx.State, nnx.State, jax.Array], tuple[tuple[jax.Array, tuple], Any]]


def whole_batch(graphdef: nnx.GraphDef, cfg: ExperimentConfig) -> LossAndGrads:
    """The loss (next-token + weighted MTP + aux) and its gradients over the whole batch, in
    one pass or, with ``train.microbatches`` = k > 1, as the mean of k micro-batches'
    (``accumulate``)."""

    def loss_and_grads(params: nnx.State, biases: nnx.State, tokens: jax.Array):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]

        def loss_fn(params: nnx.State):
            out = nnx.merge(graphdef, logical_stacks(params, cfg.model), biases).losses(
                inputs, labels)
            total = out.main + cfg.train.mtp_lambda * out.mtp + out.aux_loss
            return total, (out.main, out.mtp, out)

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    return accumulated(loss_and_grads, cfg.num_microbatches)


def pipelined(graphdef: nnx.GraphDef, cfg: ExperimentConfig) -> LossAndGrads | None:
    """The pipeline executor's forward/backward under ``--mesh pipe=P>1``, else None (the
    whole-batch step)."""
    if cfg.mesh.pipe == 1:
        return None
    schedule = build_schedule(cfg.train.pipeline_schedule, cfg.mesh.pipe, cfg.num_microbatches)
    return PipelineExecutor(schedule, graphdef, cfg.model, jnp.dtype(cfg.train.compute_dtype),
                            cfg.train.mtp_lambda, zero_stage=cfg.train.zero_stage).loss_and_grads


def make_train_step(graphdef: nnx.GraphDef, cfg: ExperimentConfig, *,
                    state_shardings: Any = None,
                    batch_sharding: Any = None,
                    loss_and_grads: LossAndGrads | None = None,
                    latched: bool = False) -> Callable[..., tuple[TrainState, dict]]:
    """The jitted ``(state, tokens (B, S+1)) -> (state, metrics)``; donates the old state.

    ``loss_and_grads`` replaces the whole-batch forward/backward (the pipeline executor
    passes its own); the optimizer update and metrics are the same either way. Without a
    pipe axis, ``train.microbatches`` = k > 1 accumulates the gradients of k micro-batches
    (``whole_batch``).

    ``latched``: the step is ``(state, tokens, halt) -> (state, metrics)``, where ``halt``
    (a bool scalar on the device: the previous step's ``~finite``) turns it into a no-op
    that leaves the state exactly as it was, step count included, and reports itself not
    finite. A host that stops at the first non-finite step can then dispatch the next step
    before reading this one's metrics (``Trainer``) and still find the last good state.
    """
    tc = cfg.train
    tx, schedule = make_optimizer(tc), learning_rate(tc)
    loss_and_grads = loss_and_grads or whole_batch(graphdef, cfg)

    def train_step(state: TrainState, tokens: jax.Array,
                   halt: jax.Array | None = None) -> tuple[TrainState, dict]:
        (total, (main, mtp, out)), grads = loss_and_grads(state.params, state.biases, tokens)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        biases = jax.tree.map(
            lambda b: update_router_bias(b, out.expert_counts, tc.bias_update_rate),
            state.biases)
        rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
        finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
        live = jnp.bool_(True) if halt is None else ~halt
        finite = finite & live
        candidate = TrainState(state.step + 1, optax.apply_updates(state.params, updates),
                               biases, opt_state, jax.random.key_data(rng))
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), candidate, state)
        # A non-finite step consumes its batch; a halted one leaves even the count.
        new = new._replace(step=state.step + live.astype(state.step.dtype))
        metrics = {"loss": main, "mtp_loss": mtp, "aux_loss": out.aux_loss,
                   "total_loss": total, "grad_norm": grad_norm,
                   "lr": schedule(updates_applied(state.opt_state)),
                   "finite": finite, "dropped_tokens": out.dropped_tokens,
                   "cross_node_tokens": out.cross_node_tokens,
                   **load_balance(out.expert_counts, cfg.mesh.expert)}
        return new, metrics

    in_shardings = (state_shardings, batch_sharding) + ((None,) if latched else ())
    return jax.jit(train_step, in_shardings=in_shardings,
                   out_shardings=(state_shardings, None), donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef, cfg: ExperimentConfig, *,
                   state_shardings: Any = None,
                   batch_sharding: Any = None) -> Callable[[TrainState, jax.Array], jax.Array]:
    """The jitted held-out loss ``(state, tokens) -> main next-token loss``, over the
    step's micro-batches in turn (``train.microbatches``; each the same size, so the mean
    of their losses is the batch's): a batch that trains only as micro-batches may not fit
    one forward pass either."""
    parts = cfg.num_microbatches

    def eval_step(state: TrainState, tokens: jax.Array) -> jax.Array:
        params = logical_stacks(state.params, cfg.model)

        def main_loss(chunk: jax.Array) -> jax.Array:
            model = nnx.merge(graphdef, params, state.biases)
            return model.losses(chunk[:, :-1], chunk[:, 1:]).main

        if parts == 1:
            return main_loss(tokens)
        return jax.lax.map(main_loss, split_microbatches(tokens, parts)).mean()

    return jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding))

"""One compiled train step checked against the model run by hand on the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.train.config import apply_overrides, get_experiment_preset
from moejax.train.metrics import progress_line
from moejax.train.step import (load_balance, make_eval_step, make_train_step,
                              state_initializer)


@pytest.fixture(scope="module")
def setup():
    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=4",
        "train.warmup_steps=0", "train.mtp_lambda=0.5", "train.bias_update_rate=0.25"])
    graphdef, init = state_initializer(cfg)
    return cfg, graphdef, init, make_train_step(graphdef, cfg)


def _log_softmax_ce(logits, labels):
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    return -np.take_along_axis(np.asarray(logp), labels[..., None], -1).mean()


def test_step_losses_bias_update_and_nonfinite_rollback(setup):
    cfg, graphdef, init, train_step = setup
    seed = np.random.SeedSequence().entropy % 2**31
    state = jax.jit(init)(jnp.uint32(seed))
    tokens = jax.random.randint(jax.random.key(seed), (4, 17), 1, 256, jnp.int32)
    model = nnx.merge(graphdef, state.params, state.biases)
    out = model.forward(tokens[:, :-1])
    labels = np.asarray(tokens[:, 1:])
    main = _log_softmax_ce(out.logits, labels)
    mtp = _log_softmax_ce(out.mtp_logits[0], labels[:, 1:])
    bias0 = np.asarray(state.biases["router_bias"][...])
    counts = np.asarray(out.expert_counts, np.float64)
    params0 = jax.tree.map(np.asarray, state.params)

    state, m = train_step(state, tokens)
    assert int(state.step) == 1 and bool(m["finite"])
    np.testing.assert_allclose(m["loss"], main, rtol=2e-5)
    np.testing.assert_allclose(m["mtp_loss"], mtp, rtol=2e-5)
    np.testing.assert_allclose(m["total_loss"], main + 0.5 * mtp + float(out.aux_loss), rtol=2e-5)
    # Aux-loss-free balancing: each row moves by rate * sign(mean load - load).
    expected_bias = bias0 + 0.25 * np.sign(counts.mean(-1, keepdims=True) - counts)
    np.testing.assert_allclose(state.biases["router_bias"][...], expected_bias, atol=1e-7)
    ratio = counts.max(-1) / counts.mean(-1)
    np.testing.assert_allclose(m["expert_load_max_over_mean"], ratio.mean(), rtol=1e-5)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), params0, state.params)
    assert all(jax.tree.leaves(moved))

    # A NaN in the weights: the step reports it and leaves every tensor as it was.
    poisoned = state._replace(params=jax.tree.map(
        lambda p: p.at[(0,) * p.ndim].set(jnp.nan), state.params))
    before = jax.tree.map(np.asarray, poisoned)
    after, m = train_step(poisoned, tokens)
    assert not bool(m["finite"]) and int(after.step) == 2
    same = jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True),
                        before._replace(step=None), after._replace(step=None))
    assert all(jax.tree.leaves(same))


def test_load_balance_per_expert_and_per_expert_device():
    """Per expert (L, E) and, with the experts split over devices, per device: the
    consecutive E/ep experts each device holds, summed, max over mean per layer."""
    counts = np.random.default_rng(0).integers(0, 50, (3, 16)).astype(np.float64)
    m = load_balance(jnp.asarray(counts, jnp.int32), expert_devices=4)
    per_expert = counts.max(-1) / counts.mean(-1)
    np.testing.assert_allclose(m["expert_load_max_over_mean"], per_expert.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["expert_load_worst"], per_expert.max(), rtol=1e-6)
    per_device = np.stack([counts[:, d * 4:(d + 1) * 4].sum(-1) for d in range(4)], -1)
    np.testing.assert_allclose(m["expert_device_load_max_over_mean"],
                               (per_device.max(-1) / per_device.mean(-1)).mean(), rtol=1e-6)
    assert "expert_device_load_max_over_mean" not in load_balance(jnp.asarray(counts))
    line = progress_line({"step": 1, "loss": 1.0, "mtp_loss": 1.0, "grad_norm": 1.0, "lr": 1e-3,
                          "tokens_per_s": 1.0, "step_time_s": 0.1, "mfu": None,
                          **{k: float(v) for k, v in m.items()}})
    assert f"device load max/mean {float(m['expert_device_load_max_over_mean']):.2f}" in line


def test_a_model_without_moe_layers_steps_and_reads_as_balanced():
    """The memory budget's probe of a one-MoE-layer model has no MoE layer (its shallow
    copy), as has an all-dense model: the step's load metrics read 1, not a reduction
    over nothing (the budget crashed on the GPU, where training runs it first)."""
    ones = load_balance(jnp.zeros((0, 16), jnp.int32), expert_devices=4)
    assert {k: float(v) for k, v in ones.items()} == {
        "expert_load_max_over_mean": 1.0, "expert_load_worst": 1.0,
        "expert_device_load_max_over_mean": 1.0}
    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=1", "model.first_k_dense_replace=1", "train.seq_len=8",
        "train.batch_size=2"])
    graphdef, init = state_initializer(cfg)
    state = jax.eval_shape(init, jnp.uint32(0))
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    _, metrics = jax.eval_shape(make_train_step(graphdef, cfg), state, tokens)
    assert metrics["expert_load_max_over_mean"].shape == ()


def test_eval_over_microbatches_is_the_one_pass_loss(setup):
    """With train.microbatches=2 the held-out loss runs as two forward passes; their mean
    is the batch's loss (float32 tolerance) on fresh random weights and tokens."""
    cfg, graphdef, init, _ = setup
    seed = np.random.SeedSequence().entropy % 2**31
    state = jax.jit(init)(jnp.uint32(seed))
    tokens = jax.random.randint(jax.random.key(seed), (4, 17), 1, 256, jnp.int32)
    one_pass = make_eval_step(graphdef, cfg)(state, tokens)
    halves = make_eval_step(graphdef, apply_overrides(cfg, ["train.microbatches=2"]))(
        state, tokens)
    np.testing.assert_allclose(halves, one_pass, rtol=2e-6)
    labels = np.asarray(tokens[:, 1:])
    model = nnx.merge(graphdef, state.params, state.biases)
    np.testing.assert_allclose(one_pass, _log_softmax_ce(model(tokens[:, :-1]), labels),
                               rtol=2e-5)

"""Host-memory EMA: the recurrence against its closed form, checkpoint restore into host
memory, training with EMA eval and resume, and (GPU) no device-memory growth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.memory.ema import HOST_MEMORY, HostEMA
from moejax.train.checkpoint import Checkpointer
from moejax.train.config import apply_overrides, get_experiment_preset


def _data_mesh() -> jax.sharding.Mesh:
    """A ``data`` axis over two devices (8 simulated on the CPU), or over the one device a
    one-GPU machine has: the host copy keeps whatever sharding the parameters have."""
    devices = jax.devices()[:2]
    return jax.make_mesh((len(devices),), ("data",), devices=devices)


@pytest.mark.parametrize("every", [1, 2])
def test_ema_matches_closed_form_and_lives_in_host_memory(every):
    rng = np.random.default_rng()
    decay, steps = 0.8, 6
    mesh = _data_mesh()
    shardings = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P())}
    params = [{"w": rng.standard_normal((4, 3)), "b": rng.standard_normal((5,))}
              for _ in range(steps + 1)]
    put = lambda p: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(jnp.asarray(x, jnp.float32), s), p, shardings)
    ema = HostEMA(decay, shardings, every)
    state = ema.init(put(params[0]))
    finite = [True, True, False, False, True, True]  # 3 and 4 skipped; 4 is due either way
    for t in range(1, steps + 1):
        if ema.due(t):
            state = ema.update(state, put(params[t]), finite[t - 1])
    assert ema.on_host
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(state))
    assert state["w"].sharding.spec == P("data", None)
    # Closed form over the applied steps, with d = decay**every a blend:
    # d^n p_0 + (1 - d) sum_k d^(n-k) p_k.
    applied = [t for t in range(1, steps + 1) if t % every == 0 and finite[t - 1]]
    assert len(applied) == {1: 4, 2: 2}[every]
    n, d = len(applied), decay ** every
    for name in ("w", "b"):
        expected = d ** n * params[0][name] + (1 - d) * sum(
            d ** (n - 1 - i) * params[t][name] for i, t in enumerate(applied))
        np.testing.assert_allclose(np.asarray(state[name]), expected, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("override", ["train.ema_decay=1.5", "train.ema_every=0"])
def test_ema_settings_are_validated(override):
    with pytest.raises(ValueError, match=override):
        apply_overrides(get_experiment_preset("tiny"), [override])


def test_checkpoint_restores_the_ema_into_host_memory(tmp_path):
    mesh = _data_mesh()
    shardings = {"w": NamedSharding(mesh, P("data", None))}
    ema = HostEMA(0.9, shardings)
    saved = ema.init({"w": jax.device_put(
        jnp.asarray(np.random.default_rng().standard_normal((4, 3)), jnp.float32),
        shardings["w"])})
    cfg = get_experiment_preset("tiny").checkpoint
    ckpt = Checkpointer(tmp_path, dataclasses.replace(cfg, async_save=False))
    state = {"step": jnp.int32(7)}
    ckpt.save(7, state, {"position": 3}, saved)
    ckpt.close()
    ckpt = Checkpointer(tmp_path, cfg)
    abstract_state = {"step": jax.ShapeDtypeStruct((), jnp.int32)}
    _, data, restored = ckpt.restore(7, abstract_state, ema.abstract(saved))
    ckpt.close()
    assert data == {"position": 3}
    assert restored["w"].sharding.memory_kind == HOST_MEMORY
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(saved["w"]))


def test_training_with_ema_evaluates_and_resumes(tmp_path):
    from moejax.train.loop import Trainer  # needs grain, which the GPU image lacks

    def run(steps, resume):
        cfg = apply_overrides(get_experiment_preset("tiny"), [
            "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=4",
            "train.warmup_steps=1", "train.schedule_steps=3", "train.eval_every=2",
            "train.eval_batches=1", "train.ema_decay=0.5", "checkpoint.every=2",
            f"train.steps={steps}"])
        return Trainer(cfg, tmp_path, resume=resume, log=lambda _: None).run()

    first = run(2, resume=False)
    resumed = run(3, resume=True)  # restores state and EMA from step 2
    assert set(first.ema_eval_losses) == {2} and set(resumed.ema_eval_losses) == {3}
    for summary, step in ((first, 2), (resumed, 3)):
        assert np.isfinite(summary.ema_eval_losses[step])
        # A decay-0.5 average of distinct weights is not the weights themselves.
        assert summary.ema_eval_losses[step] != summary.eval_losses[step]


def test_trainer_blends_the_ema_only_on_due_steps(tmp_path, monkeypatch):
    """``train.ema_every=2`` over 5 steps: blends after steps 2 and 4, and nowhere else."""
    from moejax.train.loop import Trainer  # needs grain, which the GPU image lacks
    from moejax.train.step import state_initializer

    blends = []
    update = HostEMA.update
    monkeypatch.setattr(HostEMA, "update", lambda *args: blends.append(1) or update(*args))
    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=4",
        "train.warmup_steps=1", "train.steps=5", "train.eval_every=0", "train.ema_decay=0.5",
        "train.ema_every=2"])
    logged = []
    Trainer(cfg, tmp_path, resume=False, log=logged.append).run()
    assert len(blends) == 2
    # the run names what an update moves: the whole FP32 parameter set on one device
    _, init = state_initializer(cfg)
    copy = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(init, jnp.uint32(0)).params))
    assert (f"host EMA: each update moves {copy / 1e6:,.1f} MB per device each way"
            in "\n".join(logged)), logged


@pytest.mark.gpu
def test_gpu_ema_adds_no_parameter_copy_to_device_memory():
    """`small` on one GPU: steps without the EMA, then with it; device memory (between steps
    and at peak) must not grow by anything near a parameter copy. Prints the numbers."""
    import statistics
    import time

    from moejax.train.step import make_train_step, state_initializer

    cfg = apply_overrides(get_experiment_preset("small"), ["train.batch_size=4"])
    device = jax.local_devices()[0]
    graphdef, init = state_initializer(cfg)
    state = jax.jit(init)(jnp.uint32(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    step = make_train_step(graphdef, cfg)
    tokens = jax.random.randint(jax.random.key(0), (4, cfg.train.seq_len + 1), 0, 256)
    shardings = jax.tree.map(lambda x: x.sharding, state.params)

    def run(steps, ema=None, ema_state=None):
        nonlocal state
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, tokens)
            if ema:
                ema_state = ema.update(ema_state, state.params, metrics["finite"])
            jax.block_until_ready((metrics, ema_state))
            times.append(time.perf_counter() - start)
        stats = device.memory_stats()
        return statistics.median(times[1:]), stats["bytes_in_use"], stats["peak_bytes_in_use"]

    run(2)  # compile
    plain = run(6)
    ema = HostEMA(0.999, shardings)
    with_ema = run(6, ema, ema.init(state.params))
    print(f"\nparams {param_bytes / 2**30:.2f} GiB; EMA on host: {ema.on_host}\n"
          f"without EMA: step {plain[0] * 1e3:.1f} ms, in use {plain[1] / 2**30:.2f} GiB, "
          f"peak {plain[2] / 2**30:.2f} GiB\n"
          f"with EMA:    step {with_ema[0] * 1e3:.1f} ms, in use {with_ema[1] / 2**30:.2f} GiB, "
          f"peak {with_ema[2] / 2**30:.2f} GiB")
    assert ema.on_host
    assert with_ema[1] - plain[1] < 0.1 * param_bytes
    assert with_ema[2] - plain[2] < 0.1 * param_bytes

"""Host-memory EMA: the recurrence against its closed form per snapshot group, the groups'
cover and balance, errors from the blending thread, checkpoint restore into host memory,
training with EMA eval and resume onto another mesh, and (GPU) device memory growing by
one group's copy at most."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.memory.ema import HOST_MEMORY, HostEMA, largest_snapshot_bytes, snapshot_groups
from moejax.train.checkpoint import Checkpointer
from moejax.train.config import apply_overrides, get_experiment_preset


def _data_mesh() -> jax.sharding.Mesh:
    """A ``data`` axis over two devices (8 simulated on the CPU), or over the one device a
    one-GPU machine has: the host copy keeps whatever sharding the parameters have."""
    devices = jax.devices()[:2]
    return jax.make_mesh((len(devices),), ("data",), devices=devices)


def _params_and_shardings(rng, mesh):
    """A data-split matrix (its axis 0 sharded: never cut), a replicated vector, a stacked
    (6, 2, 3) leaf (cut into row pieces) and a scalar."""
    shardings = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P()),
                 "stack": NamedSharding(mesh, P(None, None, "data")),
                 "scale": NamedSharding(mesh, P())}
    shapes = {"w": (8, 3), "b": (5,), "stack": (6, 2, 4), "scale": ()}
    draw = lambda: {k: rng.standard_normal(v) for k, v in shapes.items()}  # noqa: E731
    put = lambda p: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(jnp.asarray(x, jnp.float32), s), p, shardings)
    return draw, put, shardings


@pytest.mark.parametrize("every", [1, 3])
def test_ema_matches_closed_form_per_group_and_lives_in_host_memory(every):
    rng = np.random.default_rng()
    decay, steps = 0.8, 7
    draw, put, shardings = _params_and_shardings(rng, _data_mesh())
    params = [draw() for _ in range(steps + 1)]
    finite = [True, True, False, False, True, True, True]  # steps 3 and 4 skipped
    with HostEMA(decay, shardings, every) as ema:
        ema.start(put(params[0]))
        for t in range(1, steps + 1):
            ema.update(t, put(params[t]), finite[t - 1])
        state = ema.arrays()
        on_device = ema.arrays(shardings)
        groups = ema.groups
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(state))
    assert state["w"].sharding.spec == P("data", None)
    assert on_device["stack"].sharding == shardings["stack"]
    names = sorted(shardings)  # the flattened leaf order
    pieces = [p for g in groups for p in g]
    assert len(groups) == every and any(p.rows for p in pieces) == (every > 1)
    # large enough to be cut, but its axis 0 is sharded: a row piece would cut shards
    assert all(p.rows is None for p in pieces if names[p.leaf] == "w")
    d = decay ** every
    for g, group in enumerate(groups):
        # Closed form over the steps that blended this group:
        # d^n p_0 + (1 - d) sum_k d^(n-1-k) p_k.
        applied = [t for t in range(1, steps + 1) if (t - 1) % every == g and finite[t - 1]]
        for piece in group:
            name = names[piece.leaf]
            rows = slice(*piece.rows) if piece.rows else slice(None)
            pick = lambda p: np.asarray(p[name])[rows] if p[name].ndim else p[name]  # noqa: E731
            n = len(applied)
            expected = d ** n * pick(params[0]) + (1 - d) * sum(
                d ** (n - 1 - i) * pick(params[t]) for i, t in enumerate(applied))
            got = np.asarray(state[name])[rows] if state[name].ndim else np.asarray(state[name])
            np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-7)
            np.testing.assert_array_equal(np.asarray(on_device[name]), np.asarray(state[name]))


def test_snapshot_groups_cover_every_row_once_and_balance_bytes():
    """`small`'s parameter shapes in 8 groups: the stacked expert weights are cut along
    their layers, every row lands in one group, and the largest group stays near an
    eighth of the bytes."""
    from moejax.train.step import state_initializer

    cfg = get_experiment_preset("small")
    abstract = jax.eval_shape(state_initializer(cfg)[1], jnp.uint32(0)).params
    device = NamedSharding(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), P())
    shardings = jax.tree.map(lambda _: device, abstract)
    leaves = jax.tree.leaves(abstract)
    groups = snapshot_groups(abstract, shardings, 8)
    covered = [np.zeros(x.shape[0] if x.ndim else 1, int) for x in leaves]
    for piece in (p for g in groups for p in g):
        covered[piece.leaf][slice(*piece.rows) if piece.rows else slice(None)] += 1
    assert all((c == 1).all() for c in covered)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    largest = largest_snapshot_bytes(abstract, shardings, 8)
    assert total / 8 <= largest < 0.14 * total


def test_a_failed_blend_is_raised_on_the_training_thread(monkeypatch):
    from moejax.memory import ema as ema_module

    def broken(*args):
        raise FloatingPointError("disk full")

    monkeypatch.setattr(ema_module, "_blend_into", broken)
    draw, put, shardings = _params_and_shardings(np.random.default_rng(), _data_mesh())
    with HostEMA(0.9, shardings) as ema:
        ema.start(put(draw()))
        ema.update(1, put(draw()))
        with pytest.raises(RuntimeError, match="host EMA: a blend failed") as failure:
            ema.wait()
        assert isinstance(failure.value.__cause__, FloatingPointError)
        with pytest.raises(RuntimeError, match="a blend failed"):
            ema.update(2, put(draw()))


@pytest.mark.parametrize("override", ["train.ema_decay=1.5", "train.ema_every=0"])
def test_ema_settings_are_validated(override):
    with pytest.raises(ValueError, match=override):
        apply_overrides(get_experiment_preset("tiny"), [override])


def test_a_slow_host_shows_as_backlog(monkeypatch):
    """A blend slower than the steps fills the queue (two groups): the next update waits,
    and `backlog_seconds` counts it; blends that keep up leave it near zero."""
    import time

    from moejax.memory import ema as ema_module

    draw, put, shardings = _params_and_shardings(np.random.default_rng(), _data_mesh())
    params = [put(draw()) for _ in range(5)]
    with HostEMA(0.9, shardings, 1) as ema:
        ema.start(params[0])
        for t in range(1, 3):
            ema.update(t, params[t])
            ema.wait()
        assert ema.backlog_seconds < 0.1
        blend = ema_module._blend_into
        monkeypatch.setattr(ema_module, "_blend_into",
                            lambda *args: time.sleep(0.1) or blend(*args))
        for t in range(1, 5):  # one blending, two queued: the fourth waits
            ema.update(t, params[t])
        # a group is six shard blends (0.6 s here): the fourth update waits for most of one
        assert ema.backlog_seconds > 0.2


def test_arrays_are_copies_and_a_closed_ema_refuses_updates():
    draw, put, shardings = _params_and_shardings(np.random.default_rng(), _data_mesh())
    ema = HostEMA(0.5, shardings, 2)
    with pytest.raises(RuntimeError, match="before start"):
        ema.update(1, put(draw()))
    with ema:
        ema.start(put(draw()))
        before = ema.arrays(shardings)  # XLA:CPU may alias host buffers in device memory
        kept = {name: np.array(x) for name, x in before.items()}
        ema.update(1, put(draw()))
        ema.update(2, put(draw()))
        after = ema.arrays()
    for name in shardings:  # both groups blended since, and `before` did not follow
        np.testing.assert_array_equal(np.asarray(before[name]), kept[name])
        assert not np.array_equal(np.asarray(after[name]), kept[name])
    ema.close()  # again: a no-op
    with pytest.raises(RuntimeError, match="after close"):
        ema.update(3, put(draw()))


def test_checkpoint_restores_the_ema_into_host_memory(tmp_path):
    draw, put, shardings = _params_and_shardings(np.random.default_rng(), _data_mesh())
    cfg = get_experiment_preset("tiny").checkpoint
    with HostEMA(0.9, shardings, 3) as ema:
        ema.start(put(draw()))
        ema.update(1, put(draw()))
        saved = ema.arrays()
    ckpt = Checkpointer(tmp_path, dataclasses.replace(cfg, async_save=False))
    state = {"step": jnp.int32(7)}
    ckpt.save(7, state, {"position": 3}, saved)
    ckpt.close()
    ckpt = Checkpointer(tmp_path, cfg)
    abstract_state = {"step": jax.ShapeDtypeStruct((), jnp.int32)}
    with HostEMA(0.9, shardings, 2) as ema:  # a resume may regroup (train.ema_every)
        _, data, restored = ckpt.restore(7, abstract_state, ema.abstract(saved))
        ckpt.close()
        assert restored["w"].sharding.memory_kind == HOST_MEMORY
        ema.load(restored)
        again = ema.arrays()
    assert data == {"position": 3}
    for name in shardings:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(saved[name]))


def test_training_with_ema_evaluates_and_resumes(tmp_path):
    from moejax.train.loop import Trainer  # needs grain, which the GPU image lacks

    def run(steps, resume, *layout):
        cfg = apply_overrides(get_experiment_preset("tiny"), [
            "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=8",
            "train.warmup_steps=1", "train.schedule_steps=3", "train.eval_every=2",
            "train.eval_batches=1", "train.ema_decay=0.5", "checkpoint.every=2",
            f"train.steps={steps}", *layout])
        return Trainer(cfg, tmp_path, resume=resume, log=lambda _: None).run()

    first = run(2, False, "train.ema_every=2")
    # restores state and EMA from step 2 onto data=2 x expert=4 with ZeRO-3, in 3 groups
    resumed = run(3, True, "mesh.data=2", "mesh.expert=4", "train.zero_stage=3",
                  "train.ema_every=3")
    assert set(first.ema_eval_losses) == {2} and set(resumed.ema_eval_losses) == {3}
    for summary, step in ((first, 2), (resumed, 3)):
        assert np.isfinite(summary.ema_eval_losses[step])
        # A decay-0.5 average of distinct weights is not the weights themselves.
        assert summary.ema_eval_losses[step] != summary.eval_losses[step]


def test_trainer_sends_one_group_a_step(tmp_path, monkeypatch):
    """``train.ema_every=2`` over 5 steps: the trainer hands every step to the EMA, which
    blends groups 0, 1, 0, 1, 0; the log names the largest group's bytes."""
    from moejax.train.loop import Trainer  # needs grain, which the GPU image lacks
    from moejax.train.step import state_initializer

    blended = []
    blend = HostEMA._blend
    monkeypatch.setattr(HostEMA, "_blend", lambda self, group, *rest: blended.append(
        self.groups.index(group)) or blend(self, group, *rest))
    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=4",
        "train.warmup_steps=1", "train.steps=5", "train.eval_every=0", "train.ema_decay=0.5",
        "train.ema_every=2"])
    logged = []
    Trainer(cfg, tmp_path, resume=False, log=logged.append).run()
    assert blended == [0, 1, 0, 1, 0]
    assert "s for the host EMA's blends" in logged[-1], logged[-1]
    abstract = jax.eval_shape(state_initializer(cfg)[1], jnp.uint32(0)).params
    device = NamedSharding(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), P())
    largest = largest_snapshot_bytes(abstract, jax.tree.map(lambda _: device, abstract), 2)
    assert (f"host EMA: the parameters in 2 group(s); each step copies one (at most "
            f"{largest / 1e6:,.1f} MB per device)" in "\n".join(logged)), logged


@pytest.mark.gpu
def test_gpu_ema_adds_only_its_snapshot_to_device_memory():
    """`small` on one GPU: steps without the EMA, then with it (8 groups); device memory
    (between steps and at peak) may grow by the largest snapshot group, never by anything
    near a parameter copy. Prints step times and memory."""
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

    def run(steps, ema=None):
        nonlocal state
        start = time.perf_counter()
        for t in range(1, steps + 1):
            state, metrics = step(state, tokens)
            if ema:
                ema.update(t, state.params, metrics["finite"])
        jax.block_until_ready(metrics)
        seconds = (time.perf_counter() - start) / steps
        if ema:
            ema.wait()  # the last group's device copy is freed once it reached the host
        stats = device.memory_stats()
        return seconds, stats["bytes_in_use"], stats["peak_bytes_in_use"]

    run(2)  # compile
    plain = run(16)
    with HostEMA(0.999, shardings, 8) as ema:
        ema.start(state.params)
        run(8, ema)  # compile each group's snapshot program (one per group, on first use)
        with_ema = run(16, ema)
    snapshot = largest_snapshot_bytes(state.params, shardings, 8)
    print(f"\nparams {param_bytes / 2**30:.2f} GiB; largest snapshot group "
          f"{snapshot / 2**30:.2f} GiB\n"
          f"without EMA: step {plain[0] * 1e3:.1f} ms, in use {plain[1] / 2**30:.2f} GiB, "
          f"peak {plain[2] / 2**30:.2f} GiB\n"
          f"with EMA:    step {with_ema[0] * 1e3:.1f} ms, in use {with_ema[1] / 2**30:.2f} GiB, "
          f"peak {with_ema[2] / 2**30:.2f} GiB")
    assert snapshot < 0.14 * param_bytes
    assert with_ema[1] - plain[1] < 0.02 * param_bytes  # nothing stays on the device
    assert with_ema[2] - plain[2] < snapshot + 0.02 * param_bytes

"""One compiled train step per mesh layout equals the single-device step.

Covers the layouts the end-to-end runs (data=2,expert=4 and expert=8 with ZeRO-3; ZeRO-1
after a restore onto data=2,expert=4) do not: pure data parallelism over 8 devices, and
data=4,expert=2; and gradient accumulation (train.microbatches), on one device and on
data=2,expert=2, against the batch in one pass. Two steps from one fresh random
init and batch: the logged loss, gradient norm and aux loss agree to float32 tolerance,
and the first step's parameter update agrees in norm (Adam's first update is nearly
sign(g) * lr, so single elements with |g| ~ 0 may differ; the whole update may not). The
second step's update is held to 10% of its norm: a routing near-tie may send a token
elsewhere there, while lost optimizer moments move it by about 80% (session 49).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.parallel.expert import expert_parallel_options
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.parallel.sharding import batch_sharding
from moejax.train.config import apply_overrides, get_experiment_preset
from moejax.train.optimizer import make_optimizer
from moejax.train.placement import train_state_shardings
from moejax.train.step import make_train_step, state_initializer

SEED = int(np.random.SeedSequence().entropy % 2**31)
COMPARED = ("loss", "mtp_loss", "aux_loss", "grad_norm")
COUNTED = ("expert_load_max_over_mean",)  # from the integer expert counts


@pytest.fixture(scope="module")
def cfg():
    return apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=2", "train.seq_len=16", "train.batch_size=8",
        "train.warmup_steps=0"])


@pytest.fixture(scope="module")
def batches(cfg):
    key = jax.random.key(SEED)
    return [jax.random.randint(k, (8, 17), 1, cfg.model.vocab_size, jnp.int32)
            for k in jax.random.split(key, 2)]


def _two_steps(cfg, batches, mesh_spec: MeshSpec, zero_stage: int, microbatches: int = 1):
    cfg = apply_overrides(cfg, [f"train.zero_stage={zero_stage}",
                                f"train.microbatches={microbatches}"])
    mesh = build_mesh(mesh_spec, jax.devices()[:mesh_spec.size])
    graphdef, init = state_initializer(cfg)
    with jax.set_mesh(mesh), expert_parallel_options(cfg.expert_parallel):
        abstract = jax.eval_shape(init, jnp.uint32(SEED))
        shardings = train_state_shardings(abstract, mesh, make_optimizer(cfg.train), zero_stage)
        state = jax.jit(init, out_shardings=shardings)(jnp.uint32(SEED))
        step = make_train_step(graphdef, cfg, state_shardings=shardings,
                               batch_sharding=batch_sharding(mesh))
        history, updates = [], []
        for tokens in batches:
            before = jax.tree.map(np.asarray, state.params)
            state, metrics = step(state, tokens)
            history.append({**{k: float(metrics[k]) for k in COMPARED + COUNTED},
                            "router_bias": np.asarray(state.biases["router_bias"][...])})
            updates.append(jax.tree.map(lambda new, old: np.asarray(new) - old, state.params,
                                        before))
    return history, updates


@pytest.fixture(scope="module")
def reference(cfg, batches):
    return _two_steps(cfg, batches, MeshSpec(), zero_stage=3)


@pytest.mark.parametrize("spec,zero_stage,microbatches", [
    (MeshSpec(data=8), 3, 1), (MeshSpec(data=4, expert=2), 3, 1), (MeshSpec(), 3, 2),
    (MeshSpec(data=2, expert=2), 3, 2)],
    ids=["data8-zero3", "data4-expert2-zero3", "accumulate2", "data2-expert2-accumulate2"])
def test_layout_step_equals_one_device(cfg, batches, reference, spec, zero_stage,
                                       microbatches):
    history, updates = _two_steps(cfg, batches, spec, zero_stage, microbatches)
    ref_history, ref_updates = reference
    for step, (got, want) in enumerate(zip(history, ref_history)):
        # step 0 sees the same parameters: float32 tolerance. Step 1 sees parameters after
        # one Adam update, which is ~sign(g) * lr per element, so elements with |g| near
        # the reduction-order noise of the sharded gradient sums may move the other way
        # (random seeds gave 8e-5 relative on the loss and 6.1e-4 on the gradient norm):
        # a looser bound there.
        rel = 2e-5 if step == 0 else 2e-3
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-7), (step, key, SEED)
        if step == 0:  # the same parameters route alike: the same counts, summed, move
            # the router bias as the one-pass step's do
            for key in COUNTED:
                assert got[key] == pytest.approx(want[key], rel=1e-6), (key, SEED)
            np.testing.assert_array_equal(got["router_bias"], want["router_bias"])
    for step, (got, want) in enumerate(zip(updates, ref_updates)):
        got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
        diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got_leaves, want_leaves)))
        norm = np.sqrt(sum(np.sum(b ** 2) for b in want_leaves))
        # Step 0's update: the same parameters and routing, so only elements with |g| at
        # the reduction-order noise may move the other way. Step 1 starts from those
        # parameters, and a token whose top-k choice sits on a near-tie can follow the
        # noise to another expert: on one CI seed every layout's two-step update differed
        # from the one-pass step's by 2.9% of its norm (session 49). So step 1 fails only
        # on a gross difference, as lost or mis-sharded optimizer moments would make.
        assert diff <= (1e-3 if step == 0 else 1e-1) * norm, (step, diff, norm, SEED)

"""Schedules and the AdamW chain against hand-written references."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.train.config import TrainConfig
from moejax.train.optimizer import learning_rate, make_optimizer, schedule_change


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lr = learning_rate(cfg)
    assert float(lr(0)) == pytest.approx(1e-4)  # first update already moves
    assert float(lr(9)) == pytest.approx(1e-3)
    mid = 10 + 45  # update n uses the value at n + 1
    cos = 0.5 * (1 + math.cos(math.pi * 45 / 90))
    assert float(lr(mid - 1)) == pytest.approx(1e-4 + (1e-3 - 1e-4) * cos, rel=1e-5)
    assert float(lr(99)) == pytest.approx(1e-4, rel=1e-5)


def test_wsd_schedule_is_flat_then_decays_over_the_last_fraction():
    cfg = TrainConfig(steps=100, lr=2e-3, warmup_steps=10, schedule="wsd",
                      wsd_decay_fraction=0.2, min_lr_ratio=0.0)
    lr = [float(learning_rate(cfg)(n)) for n in range(100)]
    assert lr[4] == pytest.approx(1e-3)
    assert all(v == pytest.approx(2e-3) for v in lr[9:80])
    assert lr[85] < lr[80] < 2e-3 and lr[99] == pytest.approx(0.0, abs=1e-9)



@pytest.mark.parametrize("warmup, fraction", [(10, 1.0), (90, 0.2)])
def test_wsd_ends_on_the_final_lr_when_warmup_leaves_less_than_the_decay(warmup, fraction):
    """The decay is cut to the steps warmup leaves: it ran past the schedule (the last
    update at 1.22e-4 or 5.5e-4 where the floor is 1e-4)."""
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=warmup, schedule="wsd",
                      wsd_decay_fraction=fraction, min_lr_ratio=0.1)
    lr = learning_rate(cfg)
    assert float(lr(warmup - 1)) == pytest.approx(1e-3)
    assert float(lr(99)) == pytest.approx(1e-4, rel=1e-5)


def test_adamw_matches_a_reference_and_bf16_moments_stay_bf16():
    key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
    # "ln" is a stacked (layers, h) norm scale: 2-D, yet must not be decayed.
    params = {"w": jax.random.normal(key1, (8, 4)), "scale": jnp.ones((4,)),
              "ln": {"input_layernorm": 1 + jax.random.normal(key3, (3, 4))}}
    grads = {"w": 5 * jax.random.normal(key2, (8, 4)), "scale": jnp.full((4,), 0.5),
             "ln": {"input_layernorm": jnp.full((3, 4), -0.2)}}
    cfg = TrainConfig(steps=10, lr=1e-2, warmup_steps=0, weight_decay=0.1, grad_clip=1.0)
    tx = make_optimizer(cfg)
    updates, _ = tx.update(grads, tx.init(params), params)
    # Reference, first step: clip to norm 1, Adam (m/sqrt(v) = sign), decay on matrices only.
    norm = optax.tree.norm(grads)
    clipped = jax.tree.map(lambda g: g / max(1.0, float(norm)), grads)
    lr0 = float(learning_rate(cfg)(0))
    for get, decay in ((lambda t: t["w"], 0.1), (lambda t: t["scale"], 0.0),
                       (lambda t: t["ln"]["input_layernorm"], 0.0)):
        adam = get(clipped) / (jnp.abs(get(clipped)) + cfg.eps)
        np.testing.assert_allclose(get(updates), -lr0 * (adam + decay * get(params)),
                                   rtol=1e-5)
    half = make_optimizer(TrainConfig(steps=10, warmup_steps=0, moments_dtype="bfloat16"))
    state = half.init(params)
    _, state = half.update(grads, state, params)
    adam_state = state[1]
    moments = jax.tree.leaves((adam_state.mu, adam_state.nu))
    assert {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}


def test_a_resume_that_stretches_the_schedule_names_the_lr_it_moves_to():
    """``--resume --steps 400`` after 200 steps with ``train.schedule_steps`` unset stretches
    the cosine under the run: the LR of update 201 rises from the floor. The note says so
    and how to keep the old schedule; with the length unchanged it says nothing."""
    run = TrainConfig(steps=200, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    recorded = {"steps": 200, "schedule_steps": None}
    longer = dataclasses.replace(run, steps=400)
    note = schedule_change(recorded, longer, 200)
    new_lr = float(learning_rate(longer)(200))
    assert new_lr > 5e-4  # mid-cosine of 400, far above the 200-step run's 1e-4 floor
    assert note == (f"the LR schedule now spans 400 steps (it spanned 200): update 201 runs "
                    f"at LR {new_lr:.6g} (the old schedule's: 0.0001); "
                    "--set train.schedule_steps=200 keeps the old length")
    assert schedule_change(recorded, dataclasses.replace(longer, schedule_steps=200), 200) is None
    assert schedule_change({"steps": 100, "schedule_steps": 400}, longer, 100) is None

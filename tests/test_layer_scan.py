"""layer_scan means lax.scan: values and gradients equal, on fresh random inputs, for every
remat policy; its backward keeps the weights and layer-invariant values unstacked."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from moejax.memory.remat import POLICIES, recomputes, with_policy
from moejax.model import layer_scan as ls

LAYERS, BATCH, WIDTH = 5, 4, 16


def _step(h, x, consts):
    """A layer with a weight, an integer and a float output per layer, and a residual that
    only the constants decide (sin's derivative of the constant)."""
    w, b = x
    scale = jnp.sin(consts)
    y = jnp.tanh(jnp.dot(h, w, precision=jax.lax.Precision.HIGHEST) + b) * scale + h
    return y, (jnp.sum(y ** 2), jnp.argmax(y[0]).astype(jnp.int32))


def _inputs(seed: int):
    k = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k[0], (BATCH, WIDTH)),
            jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) / 4,
            jax.random.normal(k[2], (LAYERS, WIDTH)),
            jax.random.normal(k[3], (WIDTH,)))


def _loss_and_grads(scan, step, seed):
    def loss(h0, w, b, c):
        h, (sq, idx) = scan(step, h0, (w, b), c)
        return jnp.sum(h ** 3) + jnp.sum(sq * jnp.arange(LAYERS)), idx

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *_inputs(seed))


def _lax_scan(step, carry, xs, consts):
    return jax.lax.scan(lambda c, x: step(c, x, consts), carry, xs)


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_layer_scan_matches_lax_scan(policy, unroll):
    step = with_policy(_step, policy)
    # As run_stack calls it: unrolled, the backward is fenced where the policy recomputes.
    scan = functools.partial(ls.layer_scan, unroll=unroll, fence_recompute=recomputes(policy))
    got = _loss_and_grads(scan, step, seed=len(policy) + unroll)
    want = _loss_and_grads(_lax_scan, step, seed=len(policy) + unroll)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.any(np.asarray(jax.tree.leaves(got[1])[-1]) != 0)  # the constants' gradient


def test_backward_keeps_the_weights_and_invariants_unstacked():
    h0, w, b, c = _inputs(7)
    (_, _), res = ls._scan_fwd(_step, h0, (w, b), c, False, True)
    stacked = {tuple(s.shape) for s in res.stacks}
    assert all(s[0] == LAYERS for s in stacked)
    assert w.shape not in stacked and b.shape not in stacked  # read from xs, not copied
    # sin(consts) and its derivative: one copy each, not one per layer.
    assert res.once and all(o.size == WIDTH for o in res.once)
    assert {kind for kind, _ in res.plan.sources} >= {"stack", "x", "once"}


def test_unrolled_backward_keeps_each_layers_residuals_apart():
    """With ``unroll`` a residual is a tuple of per-layer arrays (no stack to copy into),
    the values of the stacked layout's slots, and the program holds no
    dynamic-update-slice of a residual stack."""
    h0, w, b, c = _inputs(8)
    _, stacked = ls._scan_fwd(_step, h0, (w, b), c, False, True)
    _, apart = ls._scan_fwd(_step, h0, (w, b), c, True, True)
    assert len(apart.stacks) == len(stacked.stacks)
    for layers, stack in zip(apart.stacks, stacked.stacks):
        assert isinstance(layers, tuple) and len(layers) == LAYERS
        np.testing.assert_allclose(np.stack(layers), stack, rtol=1e-5, atol=1e-6)

    def forward(unroll):
        fwd = lambda h0, w: ls._scan_fwd(_step, h0, (w, b), c, unroll, True)  # noqa: E731
        return str(jax.make_jaxpr(fwd)(h0, w))

    residual_stack_write = f"f32[{LAYERS},{BATCH},{WIDTH}]"
    assert "dynamic_update_slice" in forward(False) and residual_stack_write in forward(False)
    assert residual_stack_write not in forward(True)


def _barrier_outputs(jaxpr) -> list[list[tuple[int, ...]]]:
    """The output shapes of every optimization barrier in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            found.append([tuple(v.aval.shape) for v in eqn.outvars])
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += _barrier_outputs(sub)
    return found


@pytest.mark.parametrize("fence", [False, True])
def test_unrolled_backward_hands_on_the_carry_with_the_weight_gradients(fence):
    """Unrolled, each layer's backward releases the carry's cotangent only together with
    its weight gradients, so the next layer cannot start before they are computed."""
    h0, w, b, c = _inputs(9)
    scan = functools.partial(ls.layer_scan, unroll=True, fence_recompute=fence)
    loss = lambda h0, w, b, c: jnp.sum(scan(_step, h0, (w, b), c)[0] ** 2)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(h0, w, b, c).jaxpr
    handing_on = [shapes for shapes in _barrier_outputs(jaxpr)
                  if {(BATCH, WIDTH), (WIDTH, WIDTH), (WIDTH,)} <= set(shapes)]
    assert len(handing_on) == LAYERS


def test_layer_scan_rejects_ragged_layer_axes():
    h0, w, b, c = _inputs(0)
    with pytest.raises(ValueError, match="common leading length"):
        ls.layer_scan(_step, h0, (w, b[:2]), c)
    with pytest.raises(ValueError, match="at least one layer"):
        ls.layer_scan(_step, h0, (w[:0], b[:0]), c)


@pytest.mark.gpu
def test_residual_stacks_are_not_zero_filled_on_the_gpu():
    """On a GPU the stacks are XLA AllocateBuffer outputs: no zero broadcast of a stack's
    shape in the compiled step (lax.scan's residuals have one each)."""
    h0, w, b, c = _inputs(1)

    def grads(scan):
        loss = lambda h0, w: jnp.sum(scan(_step, h0, (w, b), c)[0] ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h0, w).compile().as_text()

    broadcast_to_stack = re.compile(  # a broadcast whose result has a residual stack's shape
        re.escape(f"f32[{LAYERS},{BATCH},{WIDTH}]") + r"\{[^}]*\} broadcast\(")
    zero_fills = lambda hlo: len(broadcast_to_stack.findall(hlo))  # noqa: E731
    assert zero_fills(grads(_lax_scan)) > 0
    assert zero_fills(grads(ls.layer_scan)) == 0

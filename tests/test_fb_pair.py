"""The F&B pair of expert-parallel MoE blocks against the model's own blocks.

Oracle: ``run_stack`` over the model's MoE blocks under the same mesh (the expert-parallel
layer of ``moejax.parallel.expert``), its outputs and ``jax.vjp``, on random hidden
states, biases and cotangents. The pair runs a 2-block forward of micro-batch A with a
1-block backward of micro-batch B (a different block), in each order, on
8 simulated devices (data=2, expert=4).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import get_model_preset
from moejax.model import DeepseekV3
from moejax.model.rope import rope_tables
from moejax.model.transformer import run_stack
from moejax.parallel.expert import ExpertParallelOptions, expert_parallel_options
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.parallel.pipeline.fb_pair import ORDERS, Stack, run_pair

BATCH, SEQ = 8, 8
MESH = MeshSpec(data=2, expert=4)
# Two devices a node, so some copies cross nodes and the count is not trivially 0.
OPTIONS = ExpertParallelOptions(devices_per_node=2)


class Inputs(NamedTuple):
    config: Any
    graphdef: nnx.GraphDef
    stack: Stack  # A's stack: blocks 0 and 1
    one: Stack  # B's stack: block 1
    h_a: jax.Array
    h_b: jax.Array
    d_h: jax.Array
    d_balance: jax.Array


def _inputs() -> Inputs:
    config = dataclasses.replace(get_model_preset("tiny"), num_hidden_layers=3)  # 2 MoE blocks
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model.moe_blocks)
    keys = jax.random.split(jax.random.key(1), 5)
    biases = 0.05 * jax.random.normal(keys[0], (2, config.n_routed_experts))
    one = Stack(jax.tree.map(lambda a: a[1:], params), biases[1:])
    h_a, h_b, d_h = (jax.random.normal(k, (BATCH, SEQ, config.hidden_size)) for k in keys[1:4])
    return Inputs(config, graphdef, Stack(params, biases), one, h_a, h_b, d_h,
                  jax.random.uniform(keys[4], (1,)))


def _references(i: Inputs):
    """A's forward through the model's blocks (the expert-parallel layer), and B's VJP."""
    def reference(stack, h):
        cos, sin = rope_tables(i.config, jnp.arange(SEQ)[None, :])
        out = run_stack(nnx.merge(i.graphdef, stack.params), h, cos, sin, stack.biases, "none",
                        False)
        return (out.h, out.stats.balance_loss), out.stats

    (ref_h, _), ref_stats = jax.jit(reference)(i.stack, i.h_a)
    ref_d_params, ref_d_h = jax.jit(lambda s, h: jax.vjp(
        lambda p, x: reference(s._replace(params=p), x)[0], s.params, h)[1](
            (i.d_h, i.d_balance)))(i.one, i.h_b)
    return ref_h, ref_stats, ref_d_h, ref_d_params


@pytest.fixture(scope="module")
def setup():
    i = _inputs()
    config, graphdef, stack, one, h_a, h_b, d_h, d_balance = i
    mesh = build_mesh(MESH)
    with jax.set_mesh(mesh), expert_parallel_options(OPTIONS):
        saved = jax.jit(lambda s, h: run_pair(graphdef, config, forward=(s, h))[0].saved)(
            one, h_b)
        ref_h, ref_stats, ref_d_h, ref_d_params = _references(i)

        def pair(order):
            fn = jax.jit(lambda *args: run_pair(graphdef, config, forward=args[:2],
                                                backward=args[2:], order=order))
            args = (stack, h_a, one, saved, d_h, d_balance)
            compiled = fn.lower(*args).compile()
            return compiled(*args), compiled.as_text()

        runs = {order: pair(order) for order in ORDERS}

        @jax.jit
        def with_pullbacks(stack, h_a, one, h_b, d_h, d_balance):
            """B's forward keeping pullbacks, then the pair, in one trace (as the executor)."""
            kept = run_pair(graphdef, config, forward=(one, h_b), keep="pullbacks")[0].saved
            return run_pair(graphdef, config, forward=(stack, h_a),
                            backward=(one, kept, d_h, d_balance))

        runs["pullbacks"] = (with_pullbacks(stack, h_a, one, h_b, d_h, d_balance), None)
    return ref_h, ref_stats, ref_d_h, ref_d_params, runs


def _close(actual, expected, rtol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if not jnp.issubdtype(e.dtype, jnp.floating):
            np.testing.assert_array_equal(a, e)
            continue
        scale = float(jnp.max(jnp.abs(e))) + 1e-12
        assert float(jnp.max(jnp.abs(a - e))) <= rtol * scale


@pytest.mark.parametrize("order", [*ORDERS, "pullbacks"])
def test_pair_equals_the_model_blocks(setup, order):
    ref_h, ref_stats, ref_d_h, ref_d_params, runs = setup
    (f, b), _ = runs[order]
    _close(f.h, ref_h, 1e-5)
    np.testing.assert_array_equal(f.counts, ref_stats.counts)
    np.testing.assert_allclose(f.balance, ref_stats.balance_loss, rtol=1e-5)
    assert int(f.dropped) == 0
    assert int(f.cross_node) == int(ref_stats.cross_node.sum()) > 0
    _close(b.d_h, ref_d_h, 1e-5)
    _close(b.d_params, ref_d_params, 1e-4)


def test_orders_agree_and_recompute_no_exchange(setup):
    """Same numbers in every order; each chunk's exchanges appear once in the program: the
    forward's four all_to_alls (rows, expert ids and router weights out, rows back) per
    block, and the backward's three (rows back, rows and router weights' gradient out) per
    block, none re-run by the pieces' remat."""
    *_, runs = setup
    sequential, _ = runs["sequential"]
    for order in ORDERS:
        result, text = runs[order]
        _close(result, sequential, 1e-6)
        assert text.count(" all-to-all(") == 4 * 2 + 3 * 1


def test_fp8_tokens_pair_equals_the_model_blocks_with_fp8_tokens():
    """token_format=fp8: the dispatch piece sends FP8 rows with 1x128 scales, as the
    model's expert-parallel layer does (which quantizes the same rows in its fused
    dispatch), and gradients come back straight-through in the compute dtype."""
    i = _inputs()
    options = ExpertParallelOptions(token_format="fp8", devices_per_node=2)
    with jax.set_mesh(build_mesh(MESH)), expert_parallel_options(options):
        ref_h, ref_stats, ref_d_h, ref_d_params = _references(i)

        @jax.jit
        def pair(stack, one, h_a, h_b, d_h, d_balance):
            saved = run_pair(i.graphdef, i.config, forward=(one, h_b))[0].saved
            return run_pair(i.graphdef, i.config, forward=(stack, h_a),
                            backward=(one, saved, d_h, d_balance))

        f, b = pair(i.stack, i.one, i.h_a, i.h_b, i.d_h, i.d_balance)
    _close(f.h, ref_h, 1e-5)
    np.testing.assert_array_equal(f.counts, ref_stats.counts)
    _close(b.d_h, ref_d_h, 1e-5)
    _close(b.d_params, ref_d_params, 1e-4)
    with jax.set_mesh(build_mesh(MESH)):  # and the FP8 rows really differ from exact ones
        exact_h, *_ = _references(i)
    assert float(jnp.max(jnp.abs(ref_h - exact_h))) > 1e-4

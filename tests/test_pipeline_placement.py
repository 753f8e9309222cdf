"""Stage-local parameters: which layer rows each pipe rank holds, and the fetch that brings
them from the split storage (values forward, gradients summed back where stored)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.config import get_model_preset
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.parallel.pipeline import SCHEDULES, build
from moejax.parallel.pipeline.placement import PIPE_AXIS, ParamPlacement
from moejax.parallel.pipeline.stages import StagePlan


def _placement(name: str, ranks: int, layers: int) -> tuple[StagePlan, ParamPlacement]:
    config = dataclasses.replace(get_model_preset("tiny"), num_hidden_layers=layers)
    schedule = build(name, ranks, 2 * ranks)
    plan = StagePlan.split(config, schedule.num_stages)
    return plan, ParamPlacement.build(plan, schedule)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("ranks,layers", [(2, 9), (4, 9), (4, 13)])
def test_each_rank_holds_exactly_its_stages_rows(name, ranks, layers):
    plan, placement = _placement(name, ranks, layers)
    schedule = build(name, ranks, 2 * ranks)
    for r in range(ranks):
        stages = {s for leg in schedule.placement for s, (rank, _) in enumerate(leg)
                  if rank == r}
        for stack, i in (("dense_blocks", 0), ("moe_blocks", 1)):
            held = placement.stacks[stack].held[r]
            for s in stages:  # a stage's rows sit contiguously at its local offset
                count = plan.shape(s)[2 + i]
                start = placement.offsets[r, s, i]
                assert held[start:start + count] == tuple(
                    range(plan.offsets(s)[i], plan.offsets(s)[i] + count))
            assert len(held) == sum(plan.shape(s)[2 + i] for s in stages)
    assert placement.copies() == (2.0 if name == "dualpipe" else 1.0)


@pytest.mark.parametrize("name,ranks", [("1f1b", 4), ("dualpipe", 4), ("dualpipev", 2),
                                        ("dualpipev", 4)])
def test_fetch_moves_rows_and_sums_gradients_back(name, ranks):
    """Rows carry their own index; the fetch's VJP of random cotangents equals, per stored
    row, the sum of the cotangents of every rank's copies of it (numpy oracle)."""
    _, placement = _placement(name, ranks, 10)  # 9 MoE blocks, stored padded
    stack = placement.stacks["moe_blocks"]
    assert stack.length == (10 if ranks == 2 else 12)
    mesh = build_mesh(MeshSpec(pipe=ranks), jax.devices()[:ranks])
    stored = jnp.arange(stack.length, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))
    cotangent = jax.random.normal(jax.random.key(0), (ranks, stack.local_length, 3))

    def body(block, ct):
        rank = jax.lax.axis_index(PIPE_AXIS)
        local, vjp = jax.vjp(lambda b: stack.fetch(b, rank), block)
        return local[None], vjp(ct[0])[0]

    local, grads = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(PIPE_AXIS), P(PIPE_AXIS)),
                                         out_specs=(P(PIPE_AXIS), P(PIPE_AXIS))))(
        jax.device_put(stored, NamedSharding(mesh, P(PIPE_AXIS))), cotangent)
    expected = np.zeros((stack.length, 3), np.float32)
    for r, rows in enumerate(stack.held):
        np.testing.assert_array_equal(np.asarray(local)[r, :len(rows), 0], rows)
        for pos, row in enumerate(rows):
            expected[row] += np.asarray(cotangent)[r, pos]
    np.testing.assert_allclose(grads, expected, rtol=1e-6)


def _avals(jaxpr: jex_core.Jaxpr):
    """Every value's abstract array in ``jaxpr`` and the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


def test_fetch_gradient_keeps_no_ids_of_the_held_rows():
    """The fetch's places are unique (padding lands past the held rows, dropped), so JAX
    differentiates its scatter as a plain scatter. Otherwise the VJP scatters integer ids
    of every update and keeps id and mask arrays of the held rows' shape until the step
    ends: on a DualPipe rank, which holds every layer, that raised XLA's peak of the
    `small` step on 2 x H100 from 15.17 to 20.57 GiB (session 44)."""
    _, placement = _placement("dualpipe", 2, 10)
    stack = placement.stacks["moe_blocks"]
    mesh = build_mesh(MeshSpec(pipe=2), jax.devices()[:2])
    held = (stack.local_length, 3)

    def body(block, ct):
        local, vjp = jax.vjp(lambda b: stack.fetch(b, jax.lax.axis_index(PIPE_AXIS)), block)
        return local, vjp(ct)[0]

    jaxpr = jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=(P(PIPE_AXIS), P(PIPE_AXIS)),
                                         out_specs=(P(PIPE_AXIS), P(PIPE_AXIS))))(
        jnp.zeros((stack.length, 3)), jnp.zeros((2 * held[0], 3)))
    shapes = [(a.shape, a.dtype) for a in _avals(jaxpr.jaxpr) if hasattr(a, "dtype")]
    assert (held, jnp.dtype(jnp.float32)) in shapes  # the walk sees the fetched rows
    assert not [s for s, dtype in shapes if len(s) == 2 and s[0] >= held[0] and s[1] == 3
                and not jnp.issubdtype(dtype, jnp.floating)], shapes


def test_storage_pads_stacks_to_the_pipe_and_cuts_them_back():
    """Padded storage round-trips the model's tree; the executor refuses an unpadded stack,
    naming it, instead of storing or splitting it wrongly."""
    from flax import nnx

    from moejax.model import DeepseekV3, RouterBias
    from moejax.parallel.pipeline.storage import logical_stacks, pad_stacks

    config = dataclasses.replace(get_model_preset("tiny"), num_hidden_layers=10)
    _, params, _ = nnx.split(DeepseekV3(config, rngs=nnx.Rngs(0)), nnx.Param, RouterBias)
    stored = pad_stacks(params, config, 4)
    assert stored["moe_blocks"]["mlp"]["gate_proj"][...].shape[0] == 12
    assert stored["dense_blocks"]["mlp"]["gate_proj"]["kernel"][...].shape[0] == 4
    assert float(jnp.abs(stored["moe_blocks"]["mlp"]["gate_proj"][...][9:]).max()) == 0.0
    assert stored["embed_tokens"][...].shape == params["embed_tokens"][...].shape
    jax.tree.map(np.testing.assert_array_equal, logical_stacks(stored, config), params)
    _, placement = _placement("1f1b", 4, 10)
    placement.check_stored(stored)
    with pytest.raises(ValueError, match=r"dense_blocks\..* 1 layer rows.*pipe=4 wants 4"):
        placement.check_stored(params)

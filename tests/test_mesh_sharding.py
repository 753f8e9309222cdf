"""Mesh parsing/building and the logical-axis sharding rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax.config import ConfigError, get_model_preset
from moejax.model import DeepseekV3
from moejax.parallel.mesh import AXES, MeshSpec, build_mesh, expert_axis_nodes
from moejax.parallel.sharding import (batch_sharding, manual_batch_axes, param_logical_axes,
                                      per_device, state_shardings, traced_batch_axes)


def test_parse_and_build():
    spec = MeshSpec.parse("data=2, expert=4")
    assert spec.shape == (1, 2, 4, 1) and str(spec) == "pipe=1,data=2,expert=4,tensor=1"
    mesh = build_mesh(spec)
    assert mesh.axis_names == AXES and dict(mesh.shape)["expert"] == 4
    # innermost axis varies fastest: consecutive device ids along expert
    assert [d.id for d in mesh.devices[0, 0, :, 0]] == [0, 1, 2, 3]
    assert expert_axis_nodes(mesh) == (0, 0, 0, 0)


@pytest.mark.parametrize("text,needle", [
    ("data=2,expert=2", "multiply to 4, but there are 8 devices"),
    ("data=2,cores=4", "'cores=4' must be AXIS=N"),
    ("data=two", "data='two' is not an integer"),
    ("data=0,expert=8", "data=0: must be a positive integer"),
    ("data=2,data=4", "axis 'data' given twice"),
])
def test_bad_mesh_specs_are_named(text, needle):
    with pytest.raises(ConfigError, match=needle):
        build_mesh(MeshSpec.parse(text))


def test_every_parameter_has_a_rule_and_experts_shard_over_expert():
    config = get_model_preset("tiny").replace(num_hidden_layers=2)
    model = nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0)))
    for path, value in nnx.to_flat_state(nnx.state(model)):
        assert len(param_logical_axes(path, value.ndim)) == value.ndim
    mesh = build_mesh(MeshSpec(data=2, expert=4))
    shardings = state_shardings(nnx.state(model), mesh, zero=3)
    assert shardings.moe_blocks.mlp.gate_proj.spec == P(None, "expert", "data", None)
    assert shardings.embed_tokens.spec == P(None, "data")
    assert shardings.router_bias.spec == P(None, None)
    zero1 = state_shardings(nnx.state(model), mesh, zero=1)
    assert zero1.moe_blocks.mlp.gate_proj.spec == P(None, "expert", None, None)
    assert zero1.embed_tokens.spec == P(None, None)


def test_indivisible_dims_stay_whole():
    config = get_model_preset("tiny").replace(num_hidden_layers=2, hidden_size=132,
                                              vocab_size=259)
    model = nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0)))
    shardings = state_shardings(nnx.state(model), build_mesh(MeshSpec(data=8)), zero=3)
    assert shardings.embed_tokens.spec == P(None, None)  # 132 % 8 != 0


def test_sharded_params_give_the_same_logits():
    config = get_model_preset("tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(0), (8, 8), 0, config.vocab_size)
    forward = nnx.jit(lambda m, x: m(x))
    ref = forward(model, ids)
    mesh = build_mesh(MeshSpec(data=2, expert=4))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh))
    with jax.set_mesh(mesh):
        got = forward(nnx.merge(graphdef, state), ids)
    assert jnp.allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_cudnn_attention_gets_q_k_v_in_one_sharding(monkeypatch):
    """cuDNN's partitioner refuses q, k and v in different shardings ("Query, key and value
    should have same sharding", 4 x H200 with data=4 and ZeRO-3, session 37); the model
    pins all three to the batch sharding before the core. XLA:CPU stands in for cuDNN:
    the core here records the shardings the partitioner chose, then runs XLA's."""
    real_core = jax.nn.dot_product_attention
    seen = []

    def core(q, k, v, *, implementation, **kw):
        assert implementation == "cudnn"
        for name, x in zip("qkv", (q, k, v)):
            jax.debug.inspect_array_sharding(
                x, callback=lambda s, name=name: seen.append((name, s.spec)))
        return real_core(q, k, v, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", core)
    config = get_model_preset("tiny").replace(num_hidden_layers=2, first_k_dense_replace=2)
    model = DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.float32, attention="cudnn")
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, config.vocab_size)
    mesh = build_mesh(MeshSpec(data=8))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, zero=3))
    ids = jax.device_put(ids, batch_sharding(mesh))
    with jax.set_mesh(mesh):
        jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, ids).compile()
    assert seen, "the core was not traced"
    by_call = [seen[i:i + 3] for i in range(0, len(seen), 3)]
    batch_over_data = lambda spec: len(spec) > 0 and spec[0] in ("data", ("data",))  # noqa: E731
    for call in by_call:
        assert [n for n, _ in call] == ["q", "k", "v"]
        assert all(batch_over_data(spec) and not any(spec[1:]) for _, spec in call), call


def test_per_device_runs_the_body_as_is_inside_a_manual_shard_map():
    """Outside, ``per_device`` is a shard_map over the batch axes; inside a shard_map
    already manual over them it is the body itself (its psum then sums the same devices);
    manual over only some of them is refused by name."""
    mesh = build_mesh(MeshSpec(data=2, expert=4))
    x = jax.random.normal(jax.random.key(0), (8, 3))
    axes = ("data", "expert")
    seen = {}

    def total(v):  # decided where it is traced, as the model's layers call it
        return per_device(lambda v: jax.lax.psum(v, axes), axes, P(axes), P())(v)

    def outer(v):
        seen["manual"], seen["traced"] = manual_batch_axes(), traced_batch_axes()
        return total(v)

    with jax.set_mesh(mesh):
        assert traced_batch_axes() == axes and manual_batch_axes() == ()
        direct = jax.jit(total)(x)
        nested = jax.jit(jax.shard_map(outer, in_specs=P(axes), out_specs=P()))(x)
        partial = jax.shard_map(total, in_specs=P("data"), out_specs=P("data"),
                                axis_names={"data"}, check_vma=False)
        with pytest.raises(ValueError, match=r"only \('data',\) are manual here"):
            jax.jit(partial).trace(x)
    assert seen == {"manual": axes, "traced": ()}
    np.testing.assert_allclose(direct, x.sum(0, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(nested, direct, rtol=1e-6)

"""Recompute policies change memory, never numbers: loss and gradients bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, get_model_preset
from moejax.model import DeepseekV3

CONFIG = get_model_preset("tiny").replace(num_hidden_layers=3)


def _loss_and_grads(remat):
    model = DeepseekV3(CONFIG, rngs=nnx.Rngs(4), dtype=jnp.float32, remat=remat)
    ids = jax.random.randint(jax.random.key(5), (2, 16), 0, CONFIG.vocab_size)

    def loss(m):
        out = m.forward(ids)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1)) + out.aux_loss

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    return value, nnx.to_flat_state(grads)


def _saved_residual_bytes(remat):
    model = DeepseekV3(CONFIG, rngs=nnx.Rngs(4), dtype=jnp.float32, remat=remat)
    ids = jnp.zeros((2, 64), jnp.int32)
    graphdef, params = nnx.split(model)
    f = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids))  # noqa: E731
    residuals = jax.vjp(f, params)[1]
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals)
               if hasattr(x, "dtype"))


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_remat_is_bitwise_identical_to_none(remat):
    ref_value, ref_grads = _loss_and_grads("none")
    value, grads = _loss_and_grads(remat)
    assert np.asarray(value).tobytes() == np.asarray(ref_value).tobytes()
    for (path, a), (_, b) in zip(grads, ref_grads):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_policies_keep_less():
    none, selective, full = (_saved_residual_bytes(p) for p in ("none", "selective", "full"))
    assert full < selective < none


def test_unknown_policy_is_named():
    with pytest.raises(ConfigError, match="remat='some'"):
        DeepseekV3(CONFIG, rngs=nnx.Rngs(0), remat="some")

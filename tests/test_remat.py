"""Recompute policies change memory, never numbers: loss and gradients bitwise equal."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' data

from hlo_text import model_loops

from moejax.config import ConfigError, get_model_preset
from moejax.memory.remat import NORM_OUTPUT, POLICIES, recomputable, with_policy
from moejax.model import DeepseekV3
from moejax.model.routing import router_logits
from moejax.precision import Precision

CONFIG = get_model_preset("tiny").replace(num_hidden_layers=3)
# The suite compiles with XLA:CPU's older fusion emitters where jax has the switch
# (conftest). Under them a recompute can fuse into another reduction order (1-ulp
# gradients, session 45); the bitwise claim holds under XLA's default emitters, so the
# bitwise test compiles with those.
DEFAULT_EMITTERS = ({"xla_cpu_use_fusion_emitters": True}
                    if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
                    else {})


def _compiled_loss_and_grads(remat, unroll=False, options=None):
    """The jitted loss-and-gradients of the model under ``remat``, compiled (with XLA
    ``options``), and its input."""
    model = DeepseekV3(CONFIG, rngs=nnx.Rngs(4), dtype=jnp.float32, remat=remat,
                       unroll_layers=unroll)
    ids = jax.random.randint(jax.random.key(5), (2, 16), 0, CONFIG.vocab_size)
    graphdef, params = nnx.split(model)

    def loss(p):
        out = nnx.merge(graphdef, p).forward(ids)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1)) + out.aux_loss

    return jax.jit(jax.value_and_grad(loss)).lower(params).compile(options), params


def _loss_and_grads(remat, unroll=False, options=None):
    compiled, params = _compiled_loss_and_grads(remat, unroll, options)
    value, grads = compiled(params)
    return value, nnx.to_flat_state(grads)


def _saved_residuals(remat, precision=Precision.BF16) -> list[jax.Array]:
    model = DeepseekV3(CONFIG, rngs=nnx.Rngs(4), dtype=jnp.float32, remat=remat,
                       precision=precision)
    ids = jnp.zeros((2, 64), jnp.int32)
    graphdef, params = nnx.split(model)
    f = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids))  # noqa: E731
    return [x for x in jax.tree.leaves(jax.vjp(f, params)[1]) if hasattr(x, "dtype")]


def _saved_residual_bytes(remat):
    return sum(x.size * x.dtype.itemsize for x in _saved_residuals(remat))


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP8])
def test_selective_regathers_the_dispatched_copies(precision):
    """The T*k expert-sorted token copies (16-bit, or FP8 bits with scales) are kept under
    ``none`` and not under selective, which keeps the tokens and the order instead. The
    expert outputs, of the same shape, are kept under neither: the experts weight their
    rows, so un-sorting only sums them, which needs nothing of them in backward."""
    copies = 2 * 64 * CONFIG.num_experts_per_tok
    def kept(remat):
        return [x.shape for x in _saved_residuals(remat, precision)
                if x.shape[-2:] == (copies, CONFIG.hidden_size)]
    assert len(kept("none")) == 1 and len(kept("selective")) == 0


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_remat_is_bitwise_identical_to_none(remat):
    ref_value, ref_grads = _loss_and_grads("none", options=DEFAULT_EMITTERS)
    value, grads = _loss_and_grads(remat, options=DEFAULT_EMITTERS)
    assert np.asarray(value).tobytes() == np.asarray(ref_value).tobytes()
    for (path, a), (_, b) in zip(grads, ref_grads):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_unrolled_layers_recompute_and_match_the_scanned_step():
    """Unrolled, all layers' forward and backward are one program (no loop runs a matmul), where
    XLA's CSE would merge a recompute into the forward it replays (``with_policy`` leaves
    ``prevent_cse`` off). ``layer_scan`` fences each layer's backward, so the optimized
    program still re-gathers the dispatched token copies under selective and full (more
    gathers than under none; without the fence, as many), and loss and gradients match the
    scanned step's."""
    scanned, params = _compiled_loss_and_grads("none")
    assert model_loops(scanned.as_text())
    ref_value, ref_grads = scanned(params)
    ref_grads = nnx.to_flat_state(ref_grads)
    gathers = {}
    for remat in POLICIES:
        compiled, params = _compiled_loss_and_grads(remat, unroll=True)
        hlo = compiled.as_text()
        assert not model_loops(hlo)
        gathers[remat] = hlo.count(" gather(")
        value, grads = compiled(params)
        np.testing.assert_allclose(np.asarray(value), np.asarray(ref_value), rtol=1e-6)
        for (path, a), (_, b) in zip(nnx.to_flat_state(grads), ref_grads):
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-5,
                                       atol=1e-6, err_msg=str(path))
    assert gathers["selective"] > gathers["none"] and gathers["full"] > gathers["none"]


def test_policies_keep_less():
    """Selective keeps at least the blocks' RMSNorm outputs and SwiGLU products fewer than
    none (f32 here); full keeps less still."""
    none, selective, full = (_saved_residual_bytes(p) for p in ("none", "selective", "full"))
    c, tokens, f32 = CONFIG, 2 * 64, 4
    dense, moe = c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace
    norms = 2 * c.num_hidden_layers * tokens * c.hidden_size
    swiglu = (dense * tokens * c.intermediate_size
              + moe * tokens * c.moe_intermediate_size * (c.num_experts_per_tok
                                                           + c.n_shared_experts))
    assert none - selective >= (norms + swiglu) * f32
    assert full < selective


def test_recomputable_op_is_recomputed_under_selective_only():
    """A value made by a ``recomputable`` op is not kept by ``selective`` (its input is), is
    kept under ``none``, and its gradients are those of the plain function."""
    def cheap(x):  # stands for a norm: the value selective should not keep
        return jnp.tanh(x) * 3.0

    def block(x, w, op):
        y = op(x)
        return jnp.sum(jnp.sin(y @ w))  # sin's VJP needs y @ w; the matmul's needs y

    x, w = jax.random.normal(jax.random.key(0), (8, 16)), jax.random.normal(
        jax.random.key(1), (16, 16))
    op = recomputable(cheap, NORM_OUTPUT)
    want = jax.grad(lambda x, w: block(x, w, cheap), (0, 1))(x, w)
    for policy in ("none", "selective"):
        got = jax.grad(with_policy(lambda x, w: block(x, w, op), policy), (0, 1))(x, w)
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)

    def kept(policy):
        f = with_policy(lambda x, w: block(x, w, op), policy)
        return [str(src) for _, src in saved_residuals(f, x, w)]

    assert any("custom_vjp_call" in src for src in kept("none"))
    assert not any("custom_vjp_call" in src for src in kept("selective"))


def test_router_logits_keep_the_16_bit_input():
    """Gradients equal autodiff of the FP32 product; backward keeps x in BF16, not its FP32
    upcast."""
    x = jax.random.normal(jax.random.key(2), (2, 8, 32)).astype(jnp.bfloat16)
    router = jax.random.normal(jax.random.key(3), (32, 16))
    g = jax.random.normal(jax.random.key(4), (2, 8, 16))

    def reference(x, r):
        return jnp.dot(x.astype(jnp.float32), r, precision=jax.lax.Precision.HIGHEST)

    got, pullback = jax.vjp(router_logits, x, router)
    want, ref_pullback = jax.vjp(reference, x, router)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(pullback(g), ref_pullback(g)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-6)
    kept = [(aval.shape, aval.dtype)
            for aval, _ in saved_residuals(lambda x: router_logits(x, router), x)]
    assert (x.shape, jnp.float32) not in kept and (x.shape, jnp.bfloat16) in kept


def test_unknown_policy_is_named():
    with pytest.raises(ConfigError, match="remat='some'"):
        DeepseekV3(CONFIG, rngs=nnx.Rngs(0), remat="some")

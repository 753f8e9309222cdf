"""The fused, chunked head + cross-entropy against float64 and against the unfused head."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hlo_text import loop_bodies

from moejax.config import get_model_preset
from moejax.model import DeepseekV3
from moejax.model.head_loss import head_cross_entropy, logsumexp_one_pass
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.precision import dense_matmul


def _problem(batch, seq, hidden, vocab, dtype):
    keys = jax.random.split(jax.random.key(np.random.SeedSequence().entropy % 2**31), 3)
    h = jax.random.normal(keys[0], (batch, seq, hidden), jnp.float32).astype(dtype)
    kernel = jax.random.normal(keys[1], (hidden, vocab), jnp.float32) / np.sqrt(hidden) * 4
    labels = jax.random.randint(keys[2], (batch, seq), 0, vocab)
    return h, kernel, labels


def _float64_reference(h, kernel, labels):
    """Loss, dh and dW of the mean cross-entropy, in numpy float64."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(kernel, np.float64)
    labels = np.asarray(labels)
    logits = h64 @ w64
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, labels[..., None], -1).mean()
    dlogits = np.exp(logp)
    np.put_along_axis(dlogits, labels[..., None],
                      np.take_along_axis(dlogits, labels[..., None], -1) - 1, -1)
    dlogits /= labels.size
    return loss, dlogits @ w64.T, np.einsum("bsh,bsv->hv", h64, dlogits)


@pytest.mark.parametrize("batch,seq,chunk", [(2, 37, 16), (3, 5, 1), (1, 8, 1024)])
def test_loss_and_gradients_match_float64(batch, seq, chunk):
    """Chunks that cut the sequence unevenly (padding), one position per chunk, one chunk."""
    h, kernel, labels = _problem(batch, seq, 32, 300, jnp.float32)
    with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
        loss, (dh, dw) = jax.jit(jax.value_and_grad(
            lambda h, k: 0.7 * head_cross_entropy(h, k, labels, chunk), argnums=(0, 1)))(
                h, kernel)
        plain = jax.jit(head_cross_entropy, static_argnums=3)(h, kernel, labels, chunk)
    ref_loss, ref_dh, ref_dw = _float64_reference(h, kernel, labels)
    np.testing.assert_allclose(loss, 0.7 * ref_loss, rtol=1e-5)
    np.testing.assert_allclose(dh, 0.7 * ref_dh, rtol=1e-4, atol=1e-6 * np.abs(ref_dh).max())
    np.testing.assert_allclose(dw, 0.7 * ref_dw, rtol=1e-4, atol=1e-6 * np.abs(ref_dw).max())
    # Without differentiation the loss-only scan gives the same value.
    np.testing.assert_allclose(plain, ref_loss, rtol=1e-5)


@pytest.mark.parametrize("layout", ["data=4", "data=2,expert=2"])
def test_split_batch_scans_per_device_and_reduces_once(layout):
    """A batch split over ``data`` (and ``expert``), the kernel split over ``data`` as
    ZeRO-3 splits it: loss and gradients still match float64, and no collective sits in
    the chunk loop (the partitioner had gathered the kernel and reduce-scattered dW in
    every chunk)."""
    h, kernel, labels = _problem(8, 24, 32, 300, jnp.float32)
    mesh = build_mesh(MeshSpec.parse(layout), jax.devices()[:4])
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    batch_axes = ("data", "expert") if "expert" in layout else ("data",)
    h, labels = put(h, batch_axes), put(labels, batch_axes)
    kernel = put(kernel, "data", None)
    grad = jax.jit(jax.value_and_grad(lambda h, k: 0.7 * head_cross_entropy(h, k, labels, 16),
                                      argnums=(0, 1)))
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        loss, (dh, dw) = grad(h, kernel)
        hlo = grad.lower(h, kernel).compile().as_text()
    ref_loss, ref_dh, ref_dw = _float64_reference(h, kernel, labels)
    np.testing.assert_allclose(loss, 0.7 * ref_loss, rtol=1e-5)
    np.testing.assert_allclose(dh, 0.7 * ref_dh, rtol=1e-4, atol=1e-6 * np.abs(ref_dh).max())
    np.testing.assert_allclose(dw, 0.7 * ref_dw, rtol=1e-4, atol=1e-6 * np.abs(ref_dw).max())
    bodies = loop_bodies(hlo)
    assert bodies, "the chunk loop is gone from the compiled step"
    for body in bodies:
        assert not re.search(r"all-gather|reduce-scatter|all-reduce|all-to-all", body), body


def test_bf16_matches_the_unfused_head():
    """In BF16 the fused op rounds the logits' gradient where the unfused head's VJP does,
    so both agree to BF16 rounding; the float64 answer is within BF16's error of both."""
    h, kernel, labels = _problem(4, 64, 64, 512, jnp.bfloat16)

    def unfused(h, k):
        logits = dense_matmul(h, k, jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1).mean()

    grads = jax.jit(jax.value_and_grad(lambda h, k: head_cross_entropy(h, k, labels, 96),
                                       argnums=(0, 1)))
    (loss, (dh, dw)), (ref_loss, (ref_dh, ref_dw)) = grads(h, kernel), \
        jax.jit(jax.value_and_grad(unfused, argnums=(0, 1)))(h, kernel)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_backward_keeps_no_logits():
    """What the VJP keeps is dh and dW (FP32), not tokens x vocab; the unfused head keeps
    at least the FP32 logits."""
    batch, seq, hidden, vocab = 2, 64, 16, 4096
    h, kernel, labels = _problem(batch, seq, hidden, vocab, jnp.bfloat16)
    kept = lambda f: sum(x.nbytes for x in jax.tree.leaves(jax.vjp(f, h, kernel)[1])  # noqa
                         if hasattr(x, "nbytes"))
    fused = kept(lambda h, k: head_cross_entropy(h, k, labels, 32))
    assert fused <= 4 * (batch * seq * hidden + hidden * vocab) + 2 * h.nbytes
    unfused = kept(lambda h, k: jax.nn.logsumexp(dense_matmul(h, k, jnp.float32)).sum())
    assert unfused >= 4 * batch * seq * vocab


def test_one_pass_logsumexp_matches_float64_and_reads_its_input_once():
    """Rows of logits over a wide range, one with a -inf entry, one all equal, one all
    -inf: within FP32 rounding of float64; the compiled op is one reduction."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((4, 6, 1000)) * rng.uniform(0.1, 40, (4, 6, 1))).astype(np.float32)
    x[0, 0, 3] = -np.inf
    x[1, 1] = 7.25
    x[2, 2] = -np.inf
    got = np.asarray(jax.jit(logsumexp_one_pass)(x))
    x64 = x.astype(np.float64)
    top = x64.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        want = (np.log(np.exp(x64 - top).sum(-1)) + top[..., 0])
    assert got[2, 2] == -np.inf
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-7, atol=2e-6)
    assert got[1, 1] == pytest.approx(7.25 + np.log(1000), rel=1e-7)
    hlo = jax.jit(logsumexp_one_pass).lower(x).compile().as_text()
    assert len(re.findall(r"\breduce\(", hlo)) == 1, hlo


def test_bad_shapes_are_named():
    h, kernel, labels = _problem(2, 8, 16, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"labels \(2, 7\)"):
        head_cross_entropy(h, kernel, labels[:, 1:])


def test_model_losses_equal_the_logits_path():
    """``DeepseekV3.losses`` (fused heads, MTP included) against cross-entropy of the
    ``forward`` logits in float64, and their parameter gradients against the unfused path."""
    config = get_model_preset("tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, rngs=nnx.Rngs(3), dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(np.random.SeedSequence().entropy % 2**31),
                                (2, 17), 0, config.vocab_size)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    graphdef, params = nnx.split(model)

    def ce(logits, labels):
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1).mean()

    def fused(p):
        out = nnx.merge(graphdef, p).losses(inputs, labels)
        return out.main + 0.3 * out.mtp, (out.main, out.mtp)

    def unfused(p):
        out = nnx.merge(graphdef, p).forward(inputs)
        main, mtp = ce(out.logits, labels), ce(out.mtp_logits[0], labels[:, 1:])
        return main + 0.3 * mtp, (main, mtp)

    with jax.default_matmul_precision("highest"):  # not TF32 on a GPU
        (_, (main, mtp)), grads = jax.jit(jax.value_and_grad(fused, has_aux=True))(params)
        (_, (ref_main, ref_mtp)), ref_grads = jax.jit(
            jax.value_and_grad(unfused, has_aux=True))(params)
        out = model.forward(inputs)
    for got, logits, y in ((main, out.logits, labels), (mtp, out.mtp_logits[0], labels[:, 1:])):
        logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
        np.testing.assert_allclose(got, -np.take_along_axis(np.asarray(logp), y[..., None],
                                                            -1).mean(), rtol=2e-5)
    np.testing.assert_allclose((main, mtp), (ref_main, ref_mtp), rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-3,
                                   atol=1e-5 * float(np.abs(b[...]).max()) + 1e-12,
                                   err_msg=str(path))

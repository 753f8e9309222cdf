"""``train.accumulate.accumulated`` against a hand computation: which rows each micro-batch
gets, and how the micro-batches' results are combined (the whole model under it is
checked against the one-pass step in ``test_train_layouts.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.train.accumulate import accumulated


def _fake_loss_and_grads(params, biases, chunk):
    """Results that depend on which rows a micro-batch holds, in the LossAndGrads shape:
    ((total, (main, mtp, out)), grads), with integer "counts" in ``out``."""
    rows = chunk.astype(jnp.float32).sum(-1)
    main = rows.max()  # not additive: a different grouping of rows gives another mean
    counts = jnp.bincount(chunk.reshape(-1), length=8).astype(jnp.int32)
    out = {"counts": counts, "aux": rows.min()}
    grads = {"w": params["w"] * rows.sum() + biases}
    return (main + 1.0, (main, -main, out)), grads


def test_rows_split_strided_floats_averaged_integers_summed():
    k, batch = 3, 6
    tokens = jax.random.randint(jax.random.key(np.random.SeedSequence().entropy % 2**31),
                                (batch, 5), 0, 8, jnp.int32)
    params = {"w": jax.random.normal(jax.random.key(1), (4,), jnp.float32)}
    biases = jnp.float32(0.5)

    (total, (main, mtp, out)), grads = jax.jit(accumulated(_fake_loss_and_grads, k))(
        params, biases, tokens)

    t = np.asarray(tokens)
    pieces = [t[i::k] for i in range(k)]  # micro-batch i: rows i, i + k, ...
    maxima = [p.sum(-1).max() for p in pieces]
    np.testing.assert_allclose(main, np.mean(maxima), rtol=1e-6)
    np.testing.assert_allclose(total, np.mean(maxima) + 1.0, rtol=1e-6)
    np.testing.assert_allclose(mtp, -np.mean(maxima), rtol=1e-6)
    np.testing.assert_allclose(out["aux"], np.mean([p.sum(-1).min() for p in pieces]),
                               rtol=1e-6)
    assert out["counts"].dtype == jnp.int32
    np.testing.assert_array_equal(out["counts"], np.bincount(t.reshape(-1), minlength=8))
    expected_w = np.mean([np.asarray(params["w"]) * p.sum() + 0.5 for p in pieces], axis=0)
    np.testing.assert_allclose(grads["w"], expected_w, rtol=1e-6)


def test_one_microbatch_is_the_function_itself():
    assert accumulated(_fake_loss_and_grads, 1) is _fake_loss_and_grads

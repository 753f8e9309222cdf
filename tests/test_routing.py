"""Routing, dispatch and the MoE layer against independent NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import get_model_preset
from moejax.model.dispatch import dispatch, sorted_weights, sum_copies
from moejax.model.moe import MoE
from moejax.model.routing import route, sequence_balance_loss, update_router_bias

CONFIG = get_model_preset("tiny")  # 16 experts, 4 groups, top-2 groups, k=4


def _logits(seed: int, tokens: int = 512) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (tokens, CONFIG.n_routed_experts))


def test_bias_changes_selection_but_not_weights():
    logits = _logits(0)
    bias = 0.5 * jax.random.normal(jax.random.key(1), (CONFIG.n_routed_experts,))
    plain, biased = route(logits, jnp.zeros_like(bias), CONFIG), route(logits, bias, CONFIG)
    assert not np.array_equal(np.sort(plain.experts, 1), np.sort(biased.experts, 1))
    # Weights come from the unbiased sigmoid scores of whatever was chosen.
    scores = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    picked = np.take_along_axis(scores, np.asarray(biased.experts), 1)
    expected = picked / picked.sum(1, keepdims=True) * CONFIG.routed_scaling_factor
    np.testing.assert_allclose(biased.weights, expected, rtol=1e-5)


def test_group_limit_respected_and_best_groups_chosen():
    logits, bias = _logits(2), 0.2 * jax.random.normal(jax.random.key(3), (16,))
    r = route(logits, bias, CONFIG)
    per_group = CONFIG.n_routed_experts // CONFIG.n_group
    groups = np.asarray(r.experts) // per_group
    choice = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64))) + np.asarray(bias)
    top2 = np.sort(choice.reshape(len(choice), CONFIG.n_group, per_group), -1)[..., -2:].sum(-1)
    best = np.argsort(-top2, 1)[:, :CONFIG.topk_group]
    for token in range(len(groups)):
        assert set(groups[token]) <= set(best[token])
        # inside the allowed groups the k best biased scores win
        allowed = np.concatenate([np.arange(g * per_group, (g + 1) * per_group)
                                  for g in best[token]])
        want = allowed[np.argsort(-choice[token, allowed])[:CONFIG.num_experts_per_tok]]
        assert set(want) == set(np.asarray(r.experts[token]))


@pytest.mark.parametrize("k,experts", [(1, 4), (4, 16), (8, 8)])
def test_dispatch_combine_lose_no_token(k, experts):
    rng = np.random.default_rng(k)
    tokens = 37
    x = jnp.asarray(rng.normal(size=(tokens, 8)), jnp.float32)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    ids[:5] = np.arange(k)  # several tokens on the same experts; some experts may be empty
    sent = dispatch(x, jnp.asarray(ids), experts)
    assert int(sent.group_sizes.sum()) == tokens * k
    assert sorted(np.asarray(sent.order).tolist()) == list(range(tokens * k))
    flat_ids = ids.reshape(-1)[np.asarray(sent.order)]
    assert np.all(np.diff(flat_ids) >= 0)  # sorted by expert
    np.testing.assert_array_equal(np.bincount(ids.reshape(-1), minlength=experts),
                                  sent.group_sizes)
    weights = jnp.asarray(rng.normal(size=(tokens, k)), jnp.float32)
    rows = sent.tokens * 2.0 * sorted_weights(weights, sent.order)[:, None]  # as experts weight
    out = sum_copies(rows, sent.order, k)
    np.testing.assert_allclose(out, 2.0 * x * weights.sum(1, keepdims=True), rtol=1e-5,
                               atol=1e-6)


def test_all_tokens_to_one_expert():
    x = jax.random.normal(jax.random.key(0), (10, 4))
    ids = jnp.full((10, 1), 3, jnp.int32)
    sent = dispatch(x, ids, 8)
    assert sent.group_sizes.tolist() == [0, 0, 0, 10, 0, 0, 0, 0]
    np.testing.assert_allclose(sum_copies(sent.tokens, sent.order, 1), x)


def _np_silu(v):
    return v / (1.0 + np.exp(-v))


def test_moe_layer_matches_per_token_reference():
    moe = MoE(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(5), (2, 9, CONFIG.hidden_size))
    bias = 0.1 * jax.random.normal(jax.random.key(6), (CONFIG.n_routed_experts,))
    out = moe(x, bias)
    flat = np.asarray(x, np.float64).reshape(-1, CONFIG.hidden_size)
    r = route(jnp.asarray(flat @ np.asarray(moe.router[...], np.float64), jnp.float32), bias,
              CONFIG)
    g, u, d = (np.asarray(w[...], np.float64) for w in (moe.gate_proj, moe.up_proj,
                                                         moe.down_proj))
    expected = np.zeros_like(flat)
    for t in range(len(flat)):
        for e, w in zip(np.asarray(r.experts[t]), np.asarray(r.weights[t], np.float64)):
            expected[t] += w * (_np_silu(flat[t] @ g[e]) * (flat[t] @ u[e])) @ d[e]
    sh = moe.shared_experts
    shared = (_np_silu(flat @ np.asarray(sh.gate_proj.kernel[...], np.float64))
              * (flat @ np.asarray(sh.up_proj.kernel[...], np.float64))) @ np.asarray(
                  sh.down_proj.kernel[...], np.float64)
    got = np.asarray(out.y, np.float64).reshape(flat.shape)
    assert np.linalg.norm(got - expected - shared) / np.linalg.norm(expected + shared) < 1e-5
    np.testing.assert_array_equal(out.stats.counts, np.bincount(np.asarray(r.experts).ravel(),
                                                          minlength=CONFIG.n_routed_experts))


def test_sequence_balance_loss_matches_formula():
    batch, seq = 3, 11
    logits = _logits(7, batch * seq)
    r = route(logits, jnp.zeros(16), CONFIG)
    got = float(sequence_balance_loss(r.scores, r.experts, batch, CONFIG))
    s = np.asarray(r.scores, np.float64).reshape(batch, seq, -1)
    ids = np.asarray(r.experts).reshape(batch, seq, -1)
    E, k = CONFIG.n_routed_experts, CONFIG.num_experts_per_tok
    total = 0.0
    for b in range(batch):
        f = np.bincount(ids[b].ravel(), minlength=E) * E / (k * seq)
        p = (s[b] / s[b].sum(-1, keepdims=True)).mean(0)
        total += (f * p).sum()
    assert got == pytest.approx(total / batch, rel=1e-5)


def test_bias_update_moves_toward_balance():
    counts = jnp.array([[10, 0, 5, 5], [1, 1, 1, 9]])
    bias = update_router_bias(jnp.zeros((2, 4)), counts, 0.01)
    np.testing.assert_allclose(bias, [[-0.01, 0.01, 0.0, 0.0], [0.01, 0.01, 0.01, -0.01]])

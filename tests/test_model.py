"""Model structure: MTP shares embedding and head, stacked layers, dtypes, config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, get_model_preset
from moejax.model import DeepseekV3, RouterBias
from moejax.model.layers import rms_norm

TINY = get_model_preset("tiny").replace(num_hidden_layers=3, num_nextn_predict_layers=2,
                                        vocab_size=263)


@pytest.fixture(scope="module")
def model():
    return DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)


def test_mtp_shares_one_embedding_and_one_head(model):
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    vocab_sized = [path for path, v in params if TINY.vocab_size in v.shape]
    assert sorted(vocab_sized) == [("embed_tokens",), ("lm_head", "kernel")]
    mtp_paths = [path for path, _ in params if path[0] == "mtp"]
    assert mtp_paths and not any("embed" in str(p) or "lm_head" in str(p) for p in mtp_paths)


def test_mtp_uses_the_shared_embedding_and_head(model, ids):
    """Zeroing the head's gradient path: d(mtp logits)/d(lm_head, embedding) is non-zero."""
    def mtp_loss(m):
        return sum(jnp.sum(x ** 2) for x in m.forward(ids).mtp_logits)

    grads = nnx.jit(nnx.grad(mtp_loss))(model)
    assert float(jnp.abs(grads.lm_head.kernel[...]).max()) > 0
    # Only the tokens that MTP embeds (input positions >= 1) get embedding gradient from it.
    assert float(jnp.abs(grads.embed_tokens[...][ids[:, 1:].ravel()]).max()) > 0


def test_mtp_reads_the_states_the_head_reads(ids):
    """Depth 1 takes the main model's final-normed state and depth 2 depth 1's normed
    output (Megatron-Core's MTP; how vLLM and SGLang serve DeepSeek-V3's MTP weights). A
    per-channel change of a norm's weight therefore moves the next depth's logits; fed
    the states before those norms (as before), MTP's own hnorm would cancel it."""
    def mtp_logits(m):
        return [np.asarray(x) for x in nnx.jit(lambda m, x: m.forward(x))(m, ids).mtp_logits]

    def scaled(path: str):
        m = DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32)
        norm = m.norm if path == "main" else m.mtp[0].norm
        gains = jax.random.uniform(jax.random.key(5), norm.weight.shape, minval=0.5, maxval=2)
        norm.weight[...] = norm.weight[...] * gains
        return mtp_logits(m)

    base = mtp_logits(DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32))
    main_scaled, depth1_scaled = scaled("main"), scaled("depth1")
    assert all(np.abs(a - b).max() > 1e-3 for a, b in zip(base, main_scaled))
    assert np.abs(base[1] - depth1_scaled[1]).max() > 1e-3


def test_output_shapes_and_counts(model, ids):
    out = nnx.jit(lambda m, x: m.forward(x))(model, ids)
    batch, seq = ids.shape
    assert out.logits.shape == (batch, seq, TINY.vocab_size) and out.logits.dtype == jnp.float32
    assert [x.shape for x in out.mtp_logits] == [(batch, seq - d, TINY.vocab_size)
                                                 for d in (1, 2)]
    rows = TINY.num_moe_layers + TINY.num_nextn_predict_layers
    assert out.expert_counts.shape == (rows, TINY.n_routed_experts)
    k = TINY.num_experts_per_tok
    expected_tokens = [batch * seq * k] * TINY.num_moe_layers + [batch * (seq - d) * k
                                                                 for d in (1, 2)]
    assert out.expert_counts.sum(1).tolist() == expected_tokens
    assert float(out.aux_loss) > 0


def test_layers_are_stacked_for_scan(model):
    kernel = model.moe_blocks.self_attn.o_proj.kernel
    assert kernel.shape[0] == TINY.num_moe_layers
    assert model.dense_blocks.mlp.gate_proj.kernel.shape[0] == TINY.first_k_dense_replace
    assert nnx.state(model, RouterBias).router_bias.shape == (
        TINY.num_moe_layers + TINY.num_nextn_predict_layers, TINY.n_routed_experts)


def test_bf16_compute_keeps_fp32_params_and_tracks_fp32(ids):
    bf16 = DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    fp32 = DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32)
    dtypes = {v.dtype for _, v in nnx.to_flat_state(nnx.state(bf16, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}
    logits = nnx.jit(lambda m, x: m(x))
    a, b = np.asarray(logits(bf16, ids)), np.asarray(logits(fp32, ids))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-2


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_within_bf16_error(ids):
    """``attention="cudnn"`` (fused flash attention, MLA's unequal q/k and v head dims
    padded to one) against the float32 XLA model: logits and input-embedding gradients no
    further off than the bf16 XLA model's."""
    def run(dtype, attention):
        model = DeepseekV3(TINY, rngs=nnx.Rngs(0), dtype=dtype, attention=attention)
        loss = lambda m: m(ids).astype(jnp.float32).mean()  # noqa: E731
        logits = nnx.jit(lambda m: m(ids))(model)
        grads = nnx.jit(nnx.grad(loss))(model)
        return np.asarray(logits, np.float32), np.asarray(grads.embed_tokens[...])

    reference, xla, cudnn = (run(jnp.float32, "xla"), run(jnp.bfloat16, "xla"),
                             run(jnp.bfloat16, "cudnn"))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    for got_xla, got_cudnn, want in zip(xla, cudnn, reference):
        assert rel(got_cudnn, want) <= max(2 * rel(got_xla, want), 1e-2)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_rms_norm_backward_matches_autodiff_of_the_formula(dtype, tol):
    """The hand-written backward (it keeps only x) against JAX's autodiff of the plain FP32
    formula on the same inputs: leading batch dims, a weight that is not all ones, and a
    large eps so that its place in the formula matters."""
    ks = jax.random.split(jax.random.key(3), 3)
    x = (jax.random.normal(ks[0], (2, 3, 48)) * 0.2).astype(dtype)
    w = 1 + jax.random.normal(ks[1], (48,))
    g = jax.random.normal(ks[2], (2, 3, 48), dtype)
    eps = 1e-2

    def formula(x, w):
        x = x.astype(jnp.float32)
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)

    got = jax.vjp(lambda x, w: rms_norm(x, w, eps), x, w)[1](g)
    want = jax.vjp(formula, x, w)[1](g.astype(jnp.float32))
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)


def test_rejects_bad_input_ids(model):
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        model.forward(jnp.zeros((4,), jnp.int32))


BASE = get_model_preset("tiny")


@pytest.mark.parametrize("changes,field,rule", [
    (dict(n_routed_experts=15), "n_routed_experts=15", "divisible by n_group=4"),
    (dict(topk_group=5), "topk_group=5", "<= n_group=4"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9", "the 8 experts"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim=15", "even"),
    (dict(hidden_size=0), "hidden_size=0", "positive integer"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace=9", "num_hidden_layers=4"),
    (dict(q_lora_rank=-1), "q_lora_rank=-1", "positive integer or None"),
    (dict(n_group=16, topk_group=1, num_experts_per_tok=1), "n_group=16", ">= 2 experts"),
    # NaN passes a plain `<= 0` check; a config.json's None or "2.5" raised a bare TypeError
    (dict(aux_loss_alpha=float("nan")), "aux_loss_alpha=nan", "finite number >= 0"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor=inf", "finite number > 0"),
    (dict(rms_norm_eps=None), "rms_norm_eps=None", "finite number > 0"),
    (dict(rope_theta="1e4"), "rope_theta='1e4'", "finite number > 0"),
    (dict(norm_topk_prob="no"), "norm_topk_prob='no'", "true or false"),
])
def test_config_validation_names_field_value_rule(changes, field, rule):
    with pytest.raises(ConfigError) as err:
        BASE.replace(**changes)
    assert field in str(err.value) and rule in str(err.value)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="hidden_sise"):
        ModelConfig.from_dict({**BASE.to_dict(), "hidden_sise": 3})
    assert ModelConfig.from_dict(BASE.to_dict()) == BASE

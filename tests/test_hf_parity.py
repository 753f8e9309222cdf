"""moejax vs Hugging Face transformers' DeepseekV3ForCausalLM on the same random weights."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moejax.interop import hf  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
            first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            rms_norm_eps=1e-6)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
            original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=1.0)

CASES = {
    "q_lora+groups": dict(q_lora_rank=32, n_group=4, topk_group=2),
    "no_q_lora": dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False),
    "yarn+groups": dict(q_lora_rank=32, n_group=4, topk_group=2, rope_parameters=YARN),
    "yarn_mscale+no_interleave": dict(
        q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False,
        rope_parameters=dict(YARN, mscale=0.9, mscale_all_dim=0.7)),
    # HF (and DeepSeek's reference) norm the q and kv latents with eps 1e-6 whatever
    # rms_norm_eps says; a large eps shows which norms take it
    "large_eps": dict(q_lora_rank=32, n_group=1, topk_group=1, rms_norm_eps=0.1),
}


def _random_hf_model(case: dict, seed: int):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**BASE, **case})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for layer in model.model.layers[BASE["first_k_dense_replace"]:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.3 * torch.randn_like(bias))
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name):
    seed = sorted(CASES).index(name)
    hf_model = _random_hf_model(CASES[name], seed)
    hf_model.save_pretrained(tmp_path)
    ids = np.random.default_rng(seed).integers(0, BASE["vocab_size"], (2, 40))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.double().numpy()

    model = hf.load(tmp_path, dtype=jnp.float32)
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)),
                     np.float64)
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert got.shape == expected.shape
    assert rel < 2e-5, f"relative error {rel:.2e}"


def test_group_limit_active_in_parity_config():
    """The grouped cases must actually restrict choices, else they test nothing extra."""
    from moejax.model.routing import route

    config = hf.config_from_hf({**BASE, **CASES["q_lora+groups"]})
    logits = jax.random.normal(jax.random.key(0), (256, config.n_routed_experts))
    free = route(logits, jnp.zeros(config.n_routed_experts), config.replace(n_group=1,
                                                                            topk_group=1))
    limited = route(logits, jnp.zeros(config.n_routed_experts), config)
    assert not np.array_equal(np.sort(free.experts, 1), np.sort(limited.experts, 1))


def test_save_roundtrip_through_transformers(tmp_path):
    """moejax -> save -> transformers loads it -> same logits as moejax."""
    hf_model = _random_hf_model(CASES["yarn+groups"], 7)
    hf_model.save_pretrained(tmp_path / "a")
    model = hf.load(tmp_path / "a", dtype=jnp.float32)
    hf.save(model, tmp_path / "b")
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "b").eval()
    ids = np.random.default_rng(7).integers(0, BASE["vocab_size"], (1, 24))
    with torch.no_grad():
        expected = reloaded(torch.tensor(ids)).logits.double().numpy()
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float64)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-5


def test_mismatched_checkpoint_names_tensor_and_shapes(tmp_path):
    hf_model = _random_hf_model(CASES["no_q_lora"], 3)
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["moe_intermediate_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.CheckpointMismatch,
                       match=r"'model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight' has shape "
                             r"\((64, 24|24, 64)\), the config needs \((64, 32|32, 64)\)"):
        hf.load(tmp_path, dtype=jnp.float32)

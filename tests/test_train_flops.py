"""The model-FLOPs formula against the real model's parameter shapes."""

import jax
import pytest
from flax import nnx

from moejax.config import MODEL_PRESETS
from moejax.model import DeepseekV3
from moejax.train.flops import forward_flops_per_token, mfu, peak_flops

ROUTED = ("gate_proj", "up_proj", "down_proj")


def _active_matmul_weights(config) -> float:
    """Weights a token multiplies by: every matrix, routed experts scaled by k / E."""
    model = nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0)))
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if "embed_tokens" in keys or any("norm" in k for k in keys):
            continue  # lookups and norm scales are not matmuls
        routed = keys[-2] in ROUTED and keys[-3] == "mlp"  # (.., E, in, out) expert stacks
        total += leaf.size * (config.num_experts_per_tok / config.n_routed_experts
                              if routed else 1)
    return total


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_forward_flops_count_only_active_experts(name):
    c = MODEL_PRESETS[name]
    # Without attention (seq -> 0): 2 FLOPs per active weight, plus the shared output head
    # applied once more per MTP depth (one weight, used 1 + D times).
    expected = 2 * _active_matmul_weights(c) + 2 * c.num_nextn_predict_layers * (
        c.hidden_size * c.vocab_size)
    assert forward_flops_per_token(c, 0) == pytest.approx(expected, rel=1e-12)
    # Causal attention: QK^T and AV against on average S/2 positions, in every layer.
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    per_position = 2 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * layers
    assert (forward_flops_per_token(c, 512) - forward_flops_per_token(c, 0)
            == pytest.approx(per_position * 256, rel=1e-12))


def test_mfu_uses_the_device_peak_or_none():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cpu") is None and peak_flops("cpu", 2.0) == 2e12
    assert mfu(1000.0, 1e9, 1e13, 2) == pytest.approx(0.05)
    assert mfu(1000.0, 1e9, None, 1) is None

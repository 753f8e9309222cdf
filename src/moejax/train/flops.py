"""Model FLOPs per token and MFU, counting only the experts a token is routed to.

Forward FLOPs per token = 2 x (weights of every matmul the token passes through)
+ causal attention. Per decoder layer:

- MLA: q (h*q_lora + q_lora*n*(d_nope+d_rope), or h*n*(d_nope+d_rope) without a
  q LoRA), kv_a h*(kv_lora + d_rope), kv_b kv_lora*n*(d_nope+d_v), o n*d_v*h;
- attention core: QK^T and AV over on average S/2 earlier positions (causal):
  2 * (S/2) * n * ((d_nope+d_rope) + d_v);
- dense MLP 3*h*i, or MoE router h*E + (top-k + shared) * 3*h*i_moe (active experts only).

Plus the output head h*V, and per MTP depth a projection 2h*h, one more layer (MoE if the
model has MoE layers) and the head again. Embedding lookups, norms, softmax and routing
arithmetic are not counted. Training = 3 x forward (backward costs two forwards); remat
recomputation is not counted (MFU, not hardware FLOPs utilisation).
"""

from __future__ import annotations

from moejax.config import ModelConfig

# Dense BF16 tensor-core peaks (no sparsity), FLOP/s per device, matched on device_kind.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
                   "TPU v5p": 459e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v6": 918e12}


def _attention_weights(c: ModelConfig) -> int:
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    heads = c.num_attention_heads
    q = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * heads * qk if c.q_lora_rank
         else c.hidden_size * heads * qk)
    kv_a = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
    kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv_a + kv_b + heads * c.v_head_dim * c.hidden_size


def _attention_core(c: ModelConfig, seq_len: int) -> float:
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    return 2 * (seq_len / 2) * c.num_attention_heads * (qk + c.v_head_dim)


def _mlp_weights(c: ModelConfig, moe: bool) -> int:
    if not moe:
        return 3 * c.hidden_size * c.intermediate_size
    active = c.num_experts_per_tok + c.n_shared_experts
    return (c.hidden_size * c.n_routed_experts
            + active * 3 * c.hidden_size * c.moe_intermediate_size)


def forward_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Forward model FLOPs for one token of a length-``seq_len`` causal sequence."""
    def layer(moe: bool) -> float:
        return 2 * (_attention_weights(c) + _mlp_weights(c, moe)) + _attention_core(c, seq_len)

    head = 2 * c.hidden_size * c.vocab_size
    total = (c.first_k_dense_replace * layer(False) + c.num_moe_layers * layer(True) + head)
    mtp = 2 * 2 * c.hidden_size * c.hidden_size + layer(c.num_moe_layers > 0) + head
    return total + c.num_nextn_predict_layers * mtp


def train_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(c, seq_len)


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Per-device peak FLOP/s: the override, else a known device's BF16 peak, else None."""
    if override_tflops is not None:
        return override_tflops * 1e12
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_per_device: float | None,
        devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the device's peak is unknown."""
    if peak_per_device is None:
        return None
    return tokens_per_s * flops_per_token / (peak_per_device * devices)

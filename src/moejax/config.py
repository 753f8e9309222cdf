"""Typed, validated model configuration and named presets.

Field names follow Hugging Face's ``DeepseekV3Config`` so a checkpoint's ``config.json``
maps onto :class:`ModelConfig` one to one. Every config is validated once, at
construction: a bad value raises :class:`ConfigError` naming the field, the value and
the rule, so nothing downstream has to re-check.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NoReturn


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names field, value and rule."""


def fail(field: str, value: Any, rule: str) -> NoReturn:
    """Raises the one ConfigError shape every config uses: field, value, rule."""
    raise ConfigError(f"{field}={value!r}: {rule}")


def check_finite(field: str, value: Any, low: float, *, strict: bool) -> None:
    """``value`` must be a finite real number above ``low`` (``strict``) or at least ``low``.
    Why a helper: NaN passes a plain ``value <= 0`` check (a NaN loss weight then makes every
    step non-finite, a run that never trains), and a string or None from a config.json
    raised a TypeError that named no field."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and (value > low if strict else value >= low)):
        fail(field, value, f"must be a finite number {'>' if strict else '>='} {low:g}")


def check_bool(field: str, value: Any) -> None:
    """A flag must be a bool: the string "no" from a config.json is truthy."""
    if not isinstance(value, bool):
        fail(field, value, "must be true or false")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension as DeepSeek-V2/V3 configure it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    type: str = "yarn"

    def __post_init__(self) -> None:
        if self.type != "yarn":
            fail("rope_scaling.type", self.type, "only 'yarn' is supported")
        check_finite("rope_scaling.factor", self.factor, 1.0, strict=False)
        for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            check_finite(f"rope_scaling.{name}", getattr(self, name), 0.0, strict=False)
        if self.original_max_position_embeddings <= 0:
            fail("rope_scaling.original_max_position_embeddings",
                  self.original_max_position_embeddings, "must be > 0")
        if self.beta_fast <= self.beta_slow:
            fail("rope_scaling.beta_fast", self.beta_fast,
                  f"must exceed beta_slow={self.beta_slow}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-style MoE transformer (MLA attention, DeepSeekMoE, MTP)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int  # width of each routed / shared expert
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: plain Q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True  # DeepSeek checkpoints store rope dims interleaved
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Weight of DeepSeek-V3's sequence-wise balance loss; 0 disables it.
    aux_loss_alpha: float = 0.0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                    "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, value, "must be a positive integer")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(name, value, "must be a non-negative integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank <= 0):
            fail("q_lora_rank", self.q_lora_rank, "must be a positive integer or None")
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
        if self.first_k_dense_replace > self.num_hidden_layers:
            fail("first_k_dense_replace", self.first_k_dense_replace,
                  f"must be <= num_hidden_layers={self.num_hidden_layers}")
        if self.n_routed_experts % self.n_group:
            fail("n_routed_experts", self.n_routed_experts,
                  f"must be divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            fail("topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            fail("n_group", self.n_group,
                  "each group needs >= 2 experts (groups are ranked by their top-2 scores)")
        reachable = self.topk_group * per_group
        if self.num_experts_per_tok > reachable:
            fail("num_experts_per_tok", self.num_experts_per_tok,
                  f"must be <= the {reachable} experts that topk_group={self.topk_group} "
                  f"groups of {per_group} can hold")
        for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            check_finite(name, getattr(self, name), 0.0, strict=True)
        for name in ("aux_loss_alpha", "initializer_range"):
            check_finite(name, getattr(self, name), 0.0, strict=False)
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            check_bool(name, getattr(self, name))
        if isinstance(self.rope_scaling, Mapping):  # accept the JSON form
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a dict, rejecting unknown keys by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The released model's RoPE (HF config.json): YaRN from its context extension. DeepSeek-V3
# pre-trained at 4K tokens without it (technical report, section 4.3), so a from-scratch run
# that follows the paper would train with rope_scaling None first.
_DEEPSEEK_YARN = RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)

MODEL_PRESETS: dict[str, ModelConfig] = {
    # Trains on one CPU in minutes; 16 experts so `--mesh expert=8` has work per device.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1,
        max_position_embeddings=1024, aux_loss_alpha=1e-4),
    # ~1.9B total / ~0.3B active parameters: trains on one 80 GB GPU.
    "small": ModelConfig(
        vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=704,
        num_hidden_layers=12, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1,
        max_position_embeddings=4096, aux_loss_alpha=1e-4),
    # Real shapes (routing is V3's sigmoid scheme; V2-Lite itself used softmax).
    "deepseek-v2-lite": ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 mscale=0.707, mscale_all_dim=0.707)),
    "deepseek-v3": ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=3, num_nextn_predict_layers=1,
        max_position_embeddings=163840, rope_scaling=_DEEPSEEK_YARN, aux_loss_alpha=1e-4),
}


def get_model_preset(name: str) -> ModelConfig:
    """The named preset, or a ConfigError listing the known names."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None

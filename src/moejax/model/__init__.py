"""Flax NNX modules of the DeepSeek-V3-style model."""

from moejax.model.transformer import DeepseekV3, ModelLosses, ModelOutput, RouterBias

__all__ = ["DeepseekV3", "ModelLosses", "ModelOutput", "RouterBias"]

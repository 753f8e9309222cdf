"""How the train state stores the stacked layers under a pipeline: padded to a multiple of
``pipe`` rows, so every stack splits over ``pipe`` in equal blocks whatever its depth.

Without padding, a stack that ``pipe`` does not divide would be stored whole on every
rank (DeepSeek-V3's 58 MoE layers on ``pipe=16``: all 58 a rank instead of 4). The padding
rows are never fetched by the executor (``placement``), so their gradients are zero and
AdamW leaves them as they are; :func:`logical_stacks` cuts them off wherever the whole
model runs (the unpipelined step, eval). The model's own values do not depend on ``pipe``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.parallel.sharding import STACKED


def map_leaves(state: nnx.State, fn: Callable[[tuple, Any], Any]) -> nnx.State:
    """``state`` with every leaf's value replaced by ``fn(path, value)``."""
    return nnx.from_flat_state([(path, v.replace(fn(path, v[...])))
                                for path, v in nnx.to_flat_state(state)])


def stack_lengths(config: ModelConfig) -> dict[str, int]:
    """Layers in each stacked-layer array of the model."""
    dense = config.first_k_dense_replace
    return {"dense_blocks": dense, "moe_blocks": config.num_hidden_layers - dense}


def stored_length(length: int, ranks: int) -> int:
    """Rows a stack of ``length`` layers is stored with over ``ranks`` pipe ranks."""
    return -(-length // ranks) * ranks


def _resize_stacks(params: nnx.State, rows: Callable[[str], int]) -> nnx.State:
    def resize(path: tuple, value: jax.Array) -> jax.Array:
        if not path or path[0] not in STACKED:
            return value
        extra = rows(path[0]) - value.shape[0]
        if extra <= 0:
            return value[:value.shape[0] + extra]
        return jnp.pad(value, [(0, extra)] + [(0, 0)] * (value.ndim - 1))
    return map_leaves(params, resize)


def pad_stacks(params: nnx.State, config: ModelConfig, ranks: int) -> nnx.State:
    """``params`` (the model's tree) as stored over ``ranks`` pipe ranks: each stack
    zero-padded to :func:`stored_length` rows."""
    lengths = stack_lengths(config)
    return _resize_stacks(params, lambda name: stored_length(lengths[name], ranks))


def logical_stacks(params: nnx.State, config: ModelConfig) -> nnx.State:
    """The model's own tree from stored (possibly padded) parameters or gradients."""
    return _resize_stacks(params, stack_lengths(config).__getitem__)

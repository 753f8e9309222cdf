"""Named recompute policies for the decoder blocks, in one place.

The model tags the activations that are cheap to recompute and large to keep with
``checkpoint_name``; a policy decides per block what backward may keep:

- ``none``: keep everything (no ``jax.checkpoint``).
- ``selective``: recompute RMSNorm outputs, the MLA up-projections (q_b_proj, kv_b_proj)
  and the SwiGLU products; keep the rest (matmul outputs that are expensive to redo).
- ``full``: keep only each block's input; recompute the whole block in backward.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name

NORM_OUTPUT = "norm_output"
MLA_UP_PROJECTION = "mla_up_projection"
SWIGLU_OUTPUT = "swiglu_output"
RECOMPUTED_BY_SELECTIVE = (NORM_OUTPUT, MLA_UP_PROJECTION, SWIGLU_OUTPUT)
POLICIES = ("none", "selective", "full")

F = TypeVar("F", bound=Callable)


def tag(x: jax.Array, name: str) -> jax.Array:
    """Marks ``x`` as the named activation (a no-op outside ``jax.checkpoint``)."""
    return checkpoint_name(x, name)


def with_policy(fn: F, policy: str) -> F:
    """``fn`` (one block's forward) under the named recompute policy."""
    if policy == "none":
        return fn
    if policy == "selective":
        saveable = jax.checkpoint_policies.save_anything_except_these_names(
            *RECOMPUTED_BY_SELECTIVE)
    elif policy == "full":
        saveable = jax.checkpoint_policies.nothing_saveable
    else:
        raise ValueError(f"remat policy {policy!r}: must be one of {POLICIES}")
    return jax.checkpoint(fn, policy=saveable)

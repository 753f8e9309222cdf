"""Weights passed as parts joined along their last (output) axis.

Why: a SwiGLU's gate and up projections read the same input. Run as one GEMM of twice the
width, the input is read once, and backward's dgrad is one GEMM over the joined contraction
instead of two GEMMs and a sum (docs/performance.md, session 30). Each part stays its own
parameter (checkpoints, sharding rules and interop see gate and up), and the ops that take
parts join them where they cast or quantize the weights anyway, so the joined FP32 copy is
never written, nor kept for backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Weights = jax.Array | tuple[jax.Array, ...]  # one array, or parts joined along the last axis


def parts(w: Weights) -> tuple[jax.Array, ...]:
    """The parts of ``w`` (one part for a plain array), checked to agree on all but the
    last axis and on dtype."""
    pieces = w if isinstance(w, tuple) else (w,)
    if not pieces:
        raise ValueError("joined weights need at least one part")
    first = pieces[0]
    for piece in pieces[1:]:
        if piece.shape[:-1] != first.shape[:-1] or piece.dtype != first.dtype:
            raise ValueError(f"joined weight parts must agree on all but the last axis and on "
                             f"dtype; got {[(p.shape, str(p.dtype)) for p in pieces]}")
    return pieces


def joined_shape(w: Weights) -> tuple[int, ...]:
    """The shape of the joined weights."""
    pieces = parts(w)
    return (*pieces[0].shape[:-1], sum(p.shape[-1] for p in pieces))


def join(w: Weights, dtype=None) -> jax.Array:
    """The parts concatenated along the last axis, cast to ``dtype`` (default: theirs);
    XLA fuses the cast and the concatenation into one pass."""
    pieces = parts(w)
    pieces = pieces if dtype is None else tuple(p.astype(dtype) for p in pieces)
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def split_like(dw: jax.Array, w: Weights) -> Weights:
    """The joined gradient ``dw`` cut back into ``w``'s parts (``w``'s structure)."""
    if not isinstance(w, tuple):
        return dw
    bounds, total = [], 0
    for piece in w[:-1]:
        total += piece.shape[-1]
        bounds.append(total)
    return tuple(jnp.split(dw, bounds, axis=-1))


def halves(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(gate, up): the two halves of a SwiGLU's joined (..., 2I) projection."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"a joined gate/up projection has an even last axis; got shape "
                         f"{gate_up.shape}")
    return gate_up[..., :width // 2], gate_up[..., width // 2:]

"""Named recompute policies for the decoder blocks, in one place.

- ``none``: keep everything (a ``jax.checkpoint`` that saves everything: the pullback is
  then built the way the other policies' are, which keeps their gradients bitwise equal to
  ``none``'s when ``layer_scan`` differentiates one block with ``jax.vjp``).
- ``selective``: recompute RMSNorm outputs, the MLA up-projections (q, k, v rebuilt from
  the latents), the SwiGLU products and the expert-sorted token copies (and their FP8
  copy) on one device; keep the rest (matmul outputs that are expensive to redo, the
  attention core's own residuals, tokens received over an expert-parallel exchange).
- ``full``: keep only each block's input; recompute the whole block in backward.

How ``selective`` finds what to recompute: a remat policy is asked, equation by equation,
whether an output may be kept, so naming a value alone is not enough: the equation that
produced it would still be kept, and it holds the same bytes (and jax 0.10's
``save_anything_except_these_names`` ignores its names altogether). So each recomputed
value is the whole output of one opaque custom-VJP op whose primal body ends by tagging it
(``tag`` inside the body); the policy recognises that op by the tags on its body's outputs
and keeps neither it nor the tag. The op's inputs are what backward keeps instead (and
what the op's own VJP needed anyway).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name
from pallas_kernels.varying import mark_varying, varying_union

NORM_OUTPUT = "norm_output"
MLA_UP_PROJECTION = "mla_up_projection"
SWIGLU_OUTPUT = "swiglu_output"
DISPATCHED_TOKENS = "dispatched_tokens"
RECOMPUTED_BY_SELECTIVE = frozenset((NORM_OUTPUT, MLA_UP_PROJECTION, SWIGLU_OUTPUT,
                                     DISPATCHED_TOKENS))
POLICIES = ("none", "selective", "full")

F = TypeVar("F", bound=Callable)


def tag(x: jax.Array, name: str) -> jax.Array:
    """Marks ``x`` as the named activation (a no-op outside ``jax.checkpoint``). Inside a
    custom-VJP op's primal body, on its outputs, it makes the op recomputable."""
    return checkpoint_name(x, name)


def _tag_of(eqn: Any) -> str | None:
    return eqn.params.get("name") if eqn.primitive.name == "name" else None


def _body_output_tags(params: dict) -> set[str | None]:
    """The tags on a custom-VJP op's primal outputs (``None`` for an untagged output)."""
    body = params.get("call_jaxpr")
    if body is None:
        return {None}
    body = getattr(body, "jaxpr", body)
    tags = {id(v): _tag_of(e) for e in body.eqns for v in e.outvars}
    return {tags.get(id(v)) for v in body.outvars}


def _selective(prim: Any, *_: Any, **params: Any) -> bool:
    """Saveable unless it is a recomputed name or the opaque op that produced one."""
    if prim.name == "name":
        return params["name"] not in RECOMPUTED_BY_SELECTIVE
    if prim.name == "custom_vjp_call":
        return not _body_output_tags(params) <= RECOMPUTED_BY_SELECTIVE
    return True


def recomputable(fn: F, name: str) -> F:
    """``fn`` (arrays in, a pytree of arrays out) as one op whose outputs ``selective``
    recomputes. Backward keeps ``fn``'s inputs and differentiates ``fn`` afresh from them;
    XLA drops the forward values that the pullback does not use, so under a policy that
    keeps everything (``none``) this costs nothing over differentiating ``fn`` directly. ``fn`` must
    not close over traced values: pass them as arguments. Under shard_map every argument is
    first typed as varying over the axes any of them varies over (a custom VJP's cotangents
    must keep their arguments' types; autodiff then sums the per-device ones).
    """

    @jax.custom_vjp
    def op(*args):
        return jax.tree.map(lambda y: tag(y, name), fn(*args))

    def op_fwd(*args):
        return op(*args), args

    def op_bwd(args, g):
        return jax.vjp(fn, *args)[1](g)

    op.defvjp(op_fwd, op_bwd)

    def call(*args):
        axes = varying_union(args)
        return op(*jax.tree.map(lambda a: mark_varying(a, axes), args))

    return call  # type: ignore[return-value]


def recomputes(policy: str) -> bool:
    """Whether ``policy`` asks backward to recompute forward values rather than keep them
    (every policy but ``none``): where it does, an unrolled ``layer_scan`` must fence the
    recompute from XLA's CSE."""
    return policy != "none"


def with_policy(fn: F, policy: str) -> F:
    """``fn`` (one block's forward) under the named recompute policy. ``prevent_cse`` is
    off: ``layer_scan`` runs the forward and its recompute in separate loops, where XLA
    cannot merge them. Elsewhere, where a recompute could be merged into the forward it
    replays, this wrapper would lose its saving."""
    if policy == "none":
        saveable = jax.checkpoint_policies.everything_saveable
    elif policy == "selective":
        saveable = _selective
    elif policy == "full":
        saveable = jax.checkpoint_policies.nothing_saveable
    else:
        raise ValueError(f"remat policy {policy!r}: must be one of {POLICIES}")
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)

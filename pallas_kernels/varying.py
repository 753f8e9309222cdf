"""Varying manual axes (shard_map's per-device types): reading them and adding to them,
on both jax versions this project runs on."""

from __future__ import annotations

import jax


def varying_axes(x: jax.Array | jax.ShapeDtypeStruct) -> frozenset[str]:
    """The manual mesh axes ``x`` (an array or ``jax.eval_shape``'s struct) varies over
    (inside shard_map; empty outside)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(
        getattr(aval, "vma", ()))


def varying_union(tree) -> tuple[str, ...]:
    """The manual axes any leaf of ``tree`` varies over, sorted."""
    return tuple(sorted(frozenset().union(*map(varying_axes, jax.tree.leaves(tree)))))


def mark_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (those it already varies over are skipped).
    Autodiff transposes this into a sum over the added axes."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # jax >= 0.10
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)

"""Logical-axis sharding rules: one table from parameter names to logical axes, one from
logical axes to mesh axes.

Parameters are named by what their dims mean ('embed', 'expert', 'mlp', ...); the rules
say which mesh axis (if any) each meaning is split over. ZeRO-3 splits parameters and
optimizer state over ``data`` (XLA gathers each layer's weights inside the scan when it
needs them); ZeRO-1 keeps parameters replicated over ``data`` and splits only the optimizer
state. Experts are split over ``expert`` either way. The stacked layer axis is split over
``pipe`` (``parallel.pipeline.placement`` fetches each rank's stage rows in the step).
A dim that the mesh axis does not divide stays whole rather than failing.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Literal

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from moejax.config import ConfigError

# Parameter path (dotted, without the stacked-layer axis) -> logical axes of its dims.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens$", ("vocab", "embed")),
    (r"lm_head\.kernel$", ("embed", "vocab")),
    (r"router_bias$", (None, None)),
    (r"mlp\.router$", ("embed", None)),
    (r"mlp\.(gate|up)_proj$", ("expert", "embed", "mlp")),
    (r"mlp\.down_proj$", ("expert", "mlp", "embed")),
    (r"(gate|up)_proj\.kernel$", ("embed", "mlp")),
    (r"down_proj\.kernel$", ("mlp", "embed")),
    (r"(q_b_proj|kv_b_proj)\.kernel$", (None, "heads")),
    (r"o_proj\.kernel$", ("heads", "embed")),
    (r"(q_proj|q_a_proj|kv_a_proj_with_mqa)\.kernel$", ("embed", None)),
    (r"eh_proj\.kernel$", (None, "embed")),
    (r"weight$", (None,)),  # norms
)

STACKED = ("dense_blocks", "moe_blocks")  # top-level attributes with a leading layer axis
BATCH = ("data", "expert")  # dense activations: batch over data x expert
PIPE_AXIS = "pipe"  # the pipeline's ranks

ZeroStage = Literal[1, 3]


def logical_to_mesh(zero: ZeroStage) -> dict[str, str | None]:
    """Where each logical axis goes: the rules table for parameters."""
    return {
        "embed": "data" if zero == 3 else None,
        "expert": "expert",
        "vocab": "tensor",
        "mlp": "tensor",
        "heads": "tensor",
        "layers": "pipe",  # stored in blocks; the pipeline executor fetches its stages' rows
    }


def param_logical_axes(path: tuple[Any, ...], ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at ``path`` (an nnx state path)."""
    dotted = ".".join(str(p) for p in path)
    stacked = path[0] in STACKED
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, dotted):
            axes = (("layers",) + axes) if stacked else axes
            if len(axes) != ndim:
                raise ValueError(f"sharding rule {pattern!r} gives {len(axes)} axes for "
                                 f"{dotted!r}, which has {ndim} dims")
            return axes
    raise ValueError(f"no sharding rule matches parameter {dotted!r}; add one to PARAM_AXES")


def _spec(shape: tuple[int, ...], axes: tuple[str | None, ...], rules: dict[str, str | None],
          mesh: Mesh | AbstractMesh) -> P:
    sizes = dict(mesh.shape)
    out = []
    for dim, axis in zip(shape, axes):
        mesh_axis = rules.get(axis) if axis else None
        ok = mesh_axis is not None and sizes.get(mesh_axis, 1) > 1 and dim % sizes[mesh_axis] == 0
        out.append(mesh_axis if ok else None)
    return P(*out)


def param_specs(state: nnx.State, mesh: Mesh | AbstractMesh, zero: ZeroStage = 3
                ) -> nnx.State:
    """The state's own tree with the PartitionSpec of every array (the rules' layout)."""
    rules = logical_to_mesh(zero)
    return nnx.from_flat_state([
        (path, variable.replace(_spec(variable.shape, param_logical_axes(path, variable.ndim),
                                      rules, mesh)))
        for path, variable in nnx.to_flat_state(state)])


def state_shardings(state: nnx.State, mesh: Mesh, zero: ZeroStage = 3) -> nnx.State:
    """The state's own tree with a NamedSharding in place of every array (for jit/device_put)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(state, mesh, zero),
                        is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches: the batch dim over data x expert."""
    return NamedSharding(mesh, P(BATCH))


def split_microbatches(tokens: jax.Array, num_microbatches: int) -> jax.Array:
    """(B, S+1) -> (M, B/M, S+1), micro-batch i = rows i, i+M, ...: applied to a batch split
    over devices (``batch_sharding``), every micro-batch takes an equal share of each
    device's rows, so splitting moves no tokens (the pipeline executor's micro-batches,
    gradient accumulation's and the micro-batched eval's)."""
    batch = tokens.shape[0]
    return tokens.reshape(batch // num_microbatches, num_microbatches, -1).swapaxes(0, 1)


def traced_batch_axes() -> tuple[str, ...]:
    """The batch axes (data, expert) of the mesh being traced under that split the batch
    here: present, larger than one, and not already manual (inside a ``shard_map`` over
    them, each device holds its own slice and there is nothing left to split)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    sizes = dict(mesh.shape)
    return tuple(a for a in BATCH if sizes.get(a, 1) > 1 and a not in mesh.manual_axes)


def mesh_batch_axes() -> tuple[str, ...]:
    """The batch axes (data, expert) the mesh being traced under has, size one included."""
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(a for a in BATCH if a in mesh.axis_names)


def manual_batch_axes() -> tuple[str, ...]:
    """The batch axes of the mesh that an enclosing ``shard_map`` (the pipeline
    executor's) is already manual over, size one included: values here are one device's
    rows, typed as varying over these, and a mean over the batch is a ``pmean`` over
    them."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return tuple(a for a in mesh_batch_axes() if a in manual)


def per_device(body: Callable, axes: tuple[str, ...], in_specs: Any, out_specs: Any
               ) -> Callable:
    """``body`` as a ``shard_map`` over the mesh, or ``body`` itself where the trace is
    already manual over ``axes`` (an enclosing ``shard_map`` has split the values, and
    every collective inside ``body`` means the same there). Why: the MoE layers run per
    device either way, whether or not their caller is."""
    manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)
    inside = [a for a in axes if a in manual]
    if inside and len(inside) < len(axes):
        raise ValueError(f"per_device over {axes}: only {tuple(inside)} are manual here; "
                         "run it inside a shard_map over all of them or none")
    if inside:
        return body
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs)


def check_batch_divides(batch: int, axes: tuple[str, ...]) -> int:
    """How many shards ``batch`` rows split into over the mesh ``axes``; a clear error
    where they cannot split evenly."""
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    shards = math.prod(sizes[a] for a in axes)
    if batch % shards:
        raise ConfigError(f"batch size {batch}: must be divisible by the {shards} devices "
                          f"of mesh axes {axes}")
    return shards


def constrain_batch(x: jax.Array, dim: int = 0) -> jax.Array:
    """Pins dimension ``dim`` of an activation to the batch axes of the mesh being traced
    under (a no-op without them, or where they do not divide it). Why: with ZeRO-3 the
    parameters are split over ``data`` along ``embed``, and XLA's propagation let
    activations follow them: the embedding lookup came out split over H and attention ran
    whole on every device, and cuDNN's attention refused q, k and v in different shardings
    (4 x H200, ``data=4``; session 37)."""
    axes = traced_batch_axes()
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    if not axes or x.shape[dim] % math.prod(sizes[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(*(None,) * dim, axes))

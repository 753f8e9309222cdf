"""A scan over stacked layers whose backward residuals are never zero-filled.

Why: under autodiff, ``jax.lax.scan`` stacks each layer's residuals as the scan's outputs,
and JAX lowers a scan's outputs as zero-initialised buffers (``lax.broadcast`` of a zero).
XLA then writes zeros over every residual stack, and over every weight-gradient stack of
the backward scan, once per step, only to overwrite them layer by layer: 6.9 ms of a
166 ms `small` step on the H100 (docs/performance.md, session 14).

``layer_scan`` computes what ``lax.scan(lambda c, x: step(c, x, consts), carry, xs)``
does. Its custom VJP runs the layers as a loop that writes what ``jax.vjp`` of one layer
keeps (under the step's own remat policy) into ``lax.empty`` stacks, uninitialised on GPU
and TPU, and a reverse loop that reads them back, writing the stacked input gradients
into ``lax.empty`` stacks too. A residual that is the layer's own input slice (its
weights) or one of ``consts`` is not copied: backward reads it from the inputs, as
``lax.scan``'s partial evaluation does; one that no layer input changes (a mask built
from the constants) is computed once, as ``lax.scan`` hoists it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from pallas_kernels.varying import mark_varying, varying_axes

Step = Callable[[Any, Any, Any], tuple[Any, Any]]  # (carry, x, consts) -> (carry, y)


def layer_scan(step: Step, carry: Any, xs: Any, consts: Any, *,
               unroll: bool = False, fence_recompute: bool = True) -> tuple[Any, Any]:
    """``step`` over the leading axis of ``xs``: returns the last carry and the stacked ys.
    ``step`` must not close over traced values (pass them in ``consts``). Narrower than
    ``lax.scan``: reverse mode only (a custom VJP: ``jax.jvp`` refuses it), at least one
    layer, and the cotangents of every input are computed (XLA drops the unused ones).

    ``unroll``: the differentiated forward and backward run one layer after another in
    the program (compile time grows with depth), and each layer's residuals stay separate
    arrays, never written into or read out of a stack. On the GPU those stack copies cost
    several milliseconds a step wherever a residual's producer or consumer is a kernel
    XLA cannot fuse with the slot (docs/performance.md, session 27). Each layer's
    backward hands the carry's cotangent on only together with its weight and constant
    gradients (an optimization barrier): left free, XLA's scheduler put every layer's
    weight gradients after the last layer's input gradient, keeping each layer's
    recomputed and quantized GEMM operands alive till then (the selective FP8 `small`
    step at seq 4096, batch 22: 72 GiB live, of which 37 GiB were those operands;
    docs/performance.md, session 29).

    ``fence_recompute`` (unrolled only): each layer's backward starts from its kept
    activations and the carry's cotangent passed together through an optimization
    barrier, so what its pullback recomputes from them is neither merged by XLA into the
    forward it replays (which would keep those values after all) nor run before the
    layer's turn. Recomputes from the weights alone (casts, weight quantization) are not
    fenced: a barrier on the weights would copy each layer's slice of them. ``False`` lets
    XLA keep forward values instead of recomputing them: faster, more memory (the FP8
    `small` step: 146.3 ms and 37.80 GiB unfenced, 150.9 ms and 34.87 GiB fenced)."""
    _length(xs)
    return _scan(step, carry, xs, consts, unroll, fence_recompute)


def _length(xs: Any) -> int:
    lengths = {leaf.shape[0] for leaf in jax.tree.leaves(xs)}
    if len(lengths) != 1:
        raise ValueError(f"layer_scan: xs leaves need one common leading length, got "
                         f"{sorted(lengths)}")
    length = lengths.pop()
    if length < 1:
        raise ValueError("layer_scan: xs need at least one layer, got a leading length of 0")
    return length


def _index(tree: Any, i: jax.Array | int) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _layer_loop(length: int, body: Callable[[Any, Any], Any], state: Any,
                unroll: bool) -> Any:
    """``lax.fori_loop(0, length, body, state)``; with ``unroll``, the same as a Python
    loop whose index is a static int."""
    if not unroll:
        return lax.fori_loop(0, length, body, state)
    for i in range(length):
        state = body(i, state)
    return state


def _stack_into(stacks: Any, values: Any, i: jax.Array | int) -> Any:
    """``values`` written into slot ``i`` of the matching ``stacks`` (same tree)."""
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v, i, 0), stacks, values)


def _empty_stacks(length: int, avals: Any) -> Any:
    """Uninitialised (length, ...) stacks for a tree of per-layer types (inside shard_map,
    varying where the layers' values are, so the layer loop's carry keeps its type)."""
    return jax.tree.map(lambda a: mark_varying(lax.empty((length, *a.shape), a.dtype),
                                               tuple(varying_axes(a))), avals)


def _layer_avals(tree: Any) -> Any:
    """The per-layer types of (length, ...) stacks, their varying axes included."""
    return jax.eval_shape(lambda t: jax.tree.map(lambda a: a[0], t), tree)


def _differentiable(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _zero_cotangent(aval: Any) -> np.ndarray:
    """The cotangent of an integer value (a float0 zero)."""
    return np.zeros(aval.shape, jax.dtypes.float0)


class _Plan(NamedTuple):
    """Where each of one layer's ``jax.vjp`` residuals is kept: ``sources[j]`` is ("stack",
    n) for the n-th per-layer stack, ("once", n) for the n-th residual that no layer input
    changes (computed once, as ``lax.scan`` hoists it), ("x", n) / ("const", n) for the n-th
    leaf of the layer's input slice / of ``consts``, ("fixed", n) for the n-th concrete
    constant."""
    treedef: Any
    sources: tuple[tuple[str, int], ...]


def _layer_vjp(step: Step, carry: Any, x: Any, consts: Any) -> tuple[Any, list[Any], Any]:
    """One layer's outputs and its pullback's residual leaves and structure."""
    out, vjp = jax.vjp(step, carry, x, consts)
    leaves, treedef = jax.tree.flatten(vjp)
    return out, leaves, treedef


def _layer_dependent(jaxpr: Any, layer_inputs: int) -> list[bool]:
    """For each output of ``jaxpr``, whether it depends on its first ``layer_inputs``
    inputs (an equation's outputs depend on exactly its inputs: the ops are pure)."""
    tainted = set(jaxpr.invars[:layer_inputs])
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jex_core.Var) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [isinstance(v, jex_core.Var) and v in tainted for v in jaxpr.outvars]


class _Probe(NamedTuple):
    plan: _Plan
    y_avals: Any
    stacked_avals: list[Any]
    fixed: list[Any]


def _probe(step: Step, carry: Any, x_avals: Any, consts: Any) -> _Probe:
    """Traces one layer abstractly and decides where each residual is kept."""
    found = {}

    def residuals(carry, x, consts):
        out, leaves, treedef = _layer_vjp(step, carry, x, consts)
        x_ids = {id(leaf): n for n, leaf in enumerate(jax.tree.leaves(x))}
        const_ids = {id(leaf): n for n, leaf in enumerate(jax.tree.leaves(consts))}
        # A zero-size residual carries no data: kept as a concrete empty array.
        kinds = [("x", x_ids[id(v)]) if id(v) in x_ids else
                 ("const", const_ids[id(v)]) if id(v) in const_ids else
                 ("computed", -1) if isinstance(v, jax.core.Tracer) and v.size else
                 ("fixed", -1) for v in leaves]
        found.update(treedef=treedef, kinds=kinds,
                     fixed=[np.zeros(v.shape, v.dtype) if isinstance(v, jax.core.Tracer) else v
                            for v, (k, _) in zip(leaves, kinds) if k == "fixed"])
        return out, [v for v, (k, _) in zip(leaves, kinds) if k == "computed"]

    closed, (out_avals, computed_avals) = jax.make_jaxpr(residuals, return_shape=True)(
        carry, x_avals, consts)
    depends = _layer_dependent(closed.jaxpr, len(jax.tree.leaves((carry, x_avals))))
    depends = iter(depends[len(depends) - len(computed_avals):])
    counts = {"stack": 0, "once": 0, "fixed": 0}
    sources, stacked_avals = [], []
    computed = iter(computed_avals)
    for kind, n in found["kinds"]:
        if kind == "computed":
            aval = next(computed)
            kind = "stack" if next(depends) else "once"
            if kind == "stack":
                stacked_avals.append(aval)
        if kind in counts:
            n = counts[kind]
            counts[kind] += 1
        sources.append((kind, n))
    return _Probe(_Plan(found["treedef"], tuple(sources)), out_avals[1], stacked_avals,
                  found["fixed"])


def _kept(plan: _Plan, leaves: list[Any], kind: str) -> list[Any]:
    """The residual leaves of one layer that the plan keeps as ``kind``."""
    if len(leaves) != len(plan.sources):
        raise AssertionError("layer_scan: a layer's residuals differ between traces")
    return [v for v, (k, _) in zip(leaves, plan.sources) if k == kind]


def _check_types(values: list[Any], avals: list[Any]) -> list[Any]:
    """``values``, after checking that they have the probe's shapes and dtypes."""
    if [(v.shape, v.dtype) for v in values] != [(a.shape, a.dtype) for a in avals]:
        raise AssertionError("layer_scan: a layer's residuals differ from the probe's")
    return values


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _scan(step: Step, carry: Any, xs: Any, consts: Any, unroll: bool,
          fence_recompute: bool) -> tuple[Any, Any]:
    del unroll, fence_recompute  # undifferentiated (evaluation): one compiled layer will do
    return lax.scan(lambda c, x: step(c, x, consts), carry, xs)


class _Residuals:
    """What backward reads: the stacks (each a (length, ...) array, or with ``unroll`` a
    tuple of the layers' arrays), the inputs they point into, the residuals kept once, and
    (static, in the pytree's aux data) the plan and the ys' types."""

    def __init__(self, plan: _Plan, y_avals: Any, stacks: list, xs: Any, consts: Any,
                 once: list, fixed: list) -> None:
        self.plan, self.y_avals = plan, y_avals
        self.stacks, self.xs, self.consts, self.once, self.fixed = stacks, xs, consts, once, fixed


jax.tree_util.register_pytree_node(
    _Residuals,
    lambda r: ((r.stacks, r.xs, r.consts, r.once, r.fixed), (r.plan, r.y_avals)),
    lambda aux, children: _Residuals(*aux, *children))


def _scan_fwd(step: Step, carry: Any, xs: Any, consts: Any, unroll: bool,
              fence_recompute: bool) -> tuple[tuple[Any, Any], Any]:
    del fence_recompute  # a backward matter
    length = _length(xs)
    x_avals = _layer_avals(xs)
    probe = _probe(step, carry, x_avals, consts)
    once = []
    if any(kind == "once" for kind, _ in probe.plan.sources):
        # Layer 0's values; XLA drops the rest of this extra trace.
        once = _kept(probe.plan, _layer_vjp(step, carry, _index(xs, 0), consts)[1], "once")
    def body(i, state):
        carry, stacks, ys = state
        (carry, y), leaves, _ = _layer_vjp(step, carry, _index(xs, i), consts)
        stacked = _check_types(_kept(probe.plan, leaves, "stack"), probe.stacked_avals)
        stacks = ([kept + (v,) for kept, v in zip(stacks, stacked)] if unroll else
                  _stack_into(stacks, stacked, i))
        return carry, stacks, _stack_into(ys, y, i)

    stacks = ([() for _ in probe.stacked_avals] if unroll else
              _empty_stacks(length, probe.stacked_avals))
    carry, stacks, ys = _layer_loop(length, body, (
        carry, stacks, _empty_stacks(length, probe.y_avals)), unroll)
    fixed = [jnp.asarray(v) for v in probe.fixed]
    return (carry, ys), _Residuals(probe.plan, probe.y_avals, stacks, xs, consts, once, fixed)


def _layer_cotangent(ct_ys: Any, y_avals: Any, i: jax.Array | int) -> Any:
    return jax.tree.map(
        lambda ct, aval: (lax.dynamic_index_in_dim(ct, i, 0, keepdims=False)
                          if _differentiable(aval.dtype) else _zero_cotangent(aval)),
        ct_ys, y_avals)


def _rebuild_vjp(res: _Residuals, kept: list[jax.Array], x: Any):
    """One layer's pullback from its ``kept`` stack residuals and input slice ``x``."""
    pools = {"stack": kept, "x": jax.tree.leaves(x),
             "const": jax.tree.leaves(res.consts), "once": res.once, "fixed": res.fixed}
    return jax.tree.unflatten(res.plan.treedef,
                              [pools[kind][n] for kind, n in res.plan.sources])


def _scan_bwd(step: Step, unroll: bool, fence_recompute: bool, res: _Residuals,
              cts: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    del step  # the residuals carry the layer's pullback
    ct_carry, ct_ys = cts
    length = _length(res.xs)
    x_leaves, x_tree = jax.tree.flatten(res.xs)
    x_diff = [_differentiable(leaf.dtype) for leaf in x_leaves]
    const_leaves, const_tree = jax.tree.flatten(res.consts)
    const_diff = [_differentiable(leaf.dtype) for leaf in const_leaves]

    def body(j, state):
        ct_carry, dx_stacks, dconsts = state
        i = length - 1 - j
        if not unroll:
            kept = _index(res.stacks, i)
        elif fence_recompute:  # see layer_scan
            kept, ct_carry = lax.optimization_barrier(([s[i] for s in res.stacks], ct_carry))
        else:
            kept = [s[i] for s in res.stacks]
        vjp = _rebuild_vjp(res, kept, _index(res.xs, i))
        ct_carry, dx, dc = vjp((ct_carry, _layer_cotangent(ct_ys, res.y_avals, i)))
        dx = [v for v, d in zip(jax.tree.leaves(dx), x_diff) if d]
        dc = [v for v, d in zip(jax.tree.leaves(dc), const_diff) if d]
        if unroll:  # see layer_scan: this layer's weight gradients before the next layer
            ct_carry, dx, dc = lax.optimization_barrier((ct_carry, dx, dc))
        return ct_carry, _stack_into(dx_stacks, dx, i), [a + b for a, b in zip(dconsts, dc)]

    dx_avals = _layer_avals([leaf for leaf, d in zip(x_leaves, x_diff) if d])
    dconsts = [jnp.zeros_like(leaf) for leaf, d in zip(const_leaves, const_diff) if d]
    ct_carry, dx_stacks, dconsts = _layer_loop(
        length, body, (ct_carry, _empty_stacks(length, dx_avals), dconsts), unroll)
    dx_iter, dc_iter = iter(dx_stacks), iter(dconsts)
    dxs = x_tree.unflatten([next(dx_iter) if d else _zero_cotangent(leaf)
                            for leaf, d in zip(x_leaves, x_diff)])
    dcs = const_tree.unflatten([next(dc_iter) if d else _zero_cotangent(leaf)
                                for leaf, d in zip(const_leaves, const_diff)])
    return ct_carry, dxs, dcs


_scan.defvjp(_scan_fwd, _scan_bwd)

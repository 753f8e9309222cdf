"""An F&B pair of expert-parallel MoE blocks: the forward of one micro-batch interleaved,
piece by piece, with the backward of another, so that each one's all_to_all runs while
the other computes (DualPipe's overlapped forward-and-backward chunk).

Pieces. On one device (inside a ``shard_map`` manual over the batch axes ``data`` and
``expert``) a MoE decoder block is cut at its two exchanges into five pieces:

==========  =============================================================  =============
attention   norm, MLA, residual, norm, router, top-k, local sort, the       compute
            send layout of the rows and their router weights
            (``Transport.prepare``, ``lay_out_values``)
dispatch    the token exchange over ``expert`` (``Transport.exchange``),    communication
            the router weights' with it
experts     receiver-side sort, grouped SwiGLU GEMMs (each row weighted     compute
            by its router weight), un-sort; shared experts
combine     the exchange back (``Transport.exchange_back``)                 communication
residual    each token's k rows summed, residual add                        compute (small)
==========  =============================================================  =============

A chunk's forward runs them in order and keeps each piece's inputs (the residuals of its
backward). Its backward runs them in reverse, each as ``jax.vjp`` of the piece at its kept
inputs: a compute piece recomputes its own forward (remat at piece granularity); an
exchange is linear, so its forward is dead in its backward and XLA drops it, leaving one
all_to_all per exchange (the tests count them in the compiled HLO).

Interleave. A block is four steps; forward step k is paired with backward step k:

====  ===============================  ===================================
step  forward (micro-batch A)          backward (micro-batch B)
====  ===============================  ===================================
1     attention           (compute)    residual^T, combine^T  (exchange)
2     dispatch           (exchange)    experts^T               (compute)
3     experts             (compute)    dispatch^T             (exchange)
4     combine, residual  (exchange)    attention^T             (compute)
====  ===============================  ===================================

so each step holds one exchange and one compute piece of the other chain. Over a stack,
forward block i pairs with backward block L-1-i; the longer chain's extra steps run alone.

How XLA is led to overlap them (the default ``order="free"``):

1. Data dependencies. Both chains are traced into one HLO computation (one jit, one
   shard_map body, no conditional around either), forward step k then backward step k in
   program order. The two pieces of a step share no value, so the only order XLA must
   keep is each chain's own, and it may fuse across piece boundaries of one chain.
2. Scheduling (GPU). XLA:GPU lowers ``all-to-all`` and ``ragged-all-to-all`` as async
   start/done pairs on a communication stream; its latency-hiding scheduler
   (``--xla_gpu_enable_latency_hiding_scheduler=true``: ``experiments.pipeline_study
   --fb-pair`` sets it when XLA_FLAGS does not mention it, as whether it is on by default
   depends on the jaxlib) puts the start before, and the done after, independent compute,
   which by (1) is the other chain's pieces. Keep all-to-all async: do not list
   ``alltoall`` in ``--xla_gpu_disable_async_collectives``. XLA:CPU runs collectives
   synchronously, so on CPU the pair is checked for its results only.
3. What no pairing hides: the ragged transport's small all_gather of per-expert counts
   (its exchange plan) inside the attention piece, and the gradients' ``psum`` over the
   batch axes, done once after the pair (inside the pipeline executor, once a step: its
   parameters are marked varying, so each piece's backward gives this device's partial
   gradients and no collective sits inside a compute piece).

``order`` picks among three ways to run the same pieces (:data:`ORDERS`): ``free`` (the
above), ``lockstep`` (``lax.optimization_barrier`` over both chains' whole state after
every step, so step k+1 of either chain waits for step k of both: the scheduler cannot run
one chain ahead, but nothing fuses across a step either) and ``sequential`` (one barrier
between the chains: the backward's inputs wait for the forward's outputs; the baseline).
On 2 H200 (``docs/performance.md``) ``free`` hid half the exposed communication of
``sequential`` and was the fastest; ``lockstep`` was no faster than ``sequential``.
With FP8 tokens (``token_format="fp8"``) the dispatch piece sends the rows as FP8 with
their 1x128 scales (``expert.exchange_fp8``: quantize, exchange the bytes, dequantize; the
gradient comes back in the compute dtype), so the quantize and dequantize passes sit in
that piece beside its exchange; the combine piece's transpose sends the outputs' gradient
to the experts in FP8 the same way (``expert.exchange_back_fp8_gradient``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from pallas_kernels.varying import varying_union

from moejax.config import ModelConfig
from moejax.model.decoder import DecoderBlock
from moejax.model.dispatch import dispatch, sorted_weights, sum_copies
from moejax.model.expert_ffn import ExpertWeights, grouped_swiglu
from moejax.model.rope import rope_tables
from moejax.model.routing import balance_loss, route, router_logits
from moejax.parallel.expert import (
    EXPERT_AXIS,
    Transport,
    cross_node_copies,
    current_options,
    exchange_fp8,
    expert_layout,
    make_transport,
    sender_axes,
    varying_over,
)
from moejax.parallel.sharding import manual_batch_axes, param_logical_axes, per_device

Values = dict[str, Any]  # float arrays a piece differentiates through
Meta = dict[str, Any]  # routing decisions and layouts (integers): carried, not differentiated
Piece = Callable[["Context", DecoderBlock, jax.Array, Values, Meta], tuple[Values, Meta]]

FORWARD_STEPS = (("attention",), ("dispatch",), ("experts",), ("combine", "residual"))
BACKWARD_STEPS = tuple(tuple(reversed(step)) for step in reversed(FORWARD_STEPS))


class Context(NamedTuple):
    """What every piece of a block reads besides its parameters and router bias."""

    graphdef: nnx.GraphDef  # of one MoE DecoderBlock
    config: ModelConfig
    transport: Transport
    cos: jax.Array
    sin: jax.Array
    batch_axes: tuple[str, ...]  # the manual axes tokens are split over
    fp8_tokens: bool  # rows travel as FP8 with 1x128 scales
    cross_node: Callable[[jax.Array], jax.Array]  # copies' expert ids -> copies leaving the node


# --- the pieces (per device) ------------------------------------------------------------

def _attention(ctx: Context, block: DecoderBlock, bias: jax.Array, x: Values, meta: Meta
               ) -> tuple[Values, Meta]:
    h = x["h"]
    h = h + block.self_attn(block.input_layernorm(h), ctx.cos, ctx.sin)
    normed = block.post_attention_layernorm(h)
    batch, seq, hidden = normed.shape
    flat = normed.reshape(batch * seq, hidden)
    logits = router_logits(normed, block.mlp.router[...]).reshape(batch * seq, -1)
    routing = route(logits, bias, ctx.config)
    sent = dispatch(flat, routing.experts, ctx.config.n_routed_experts)
    out = ctx.transport.prepare(sent.tokens, routing.experts.reshape(-1)[sent.order],
                                sent.group_sizes)
    row_weights = ctx.transport.lay_out_values(sorted_weights(routing.weights, sent.order),
                                               out.context)
    return ({"h": h, "normed": normed, "rows": out.rows, "row_weights": row_weights,
             # varying like the tokens even when it is a constant 0 (aux_loss_alpha=0)
             "balance": varying_over(balance_loss(routing, batch, ctx.config),
                                     ctx.batch_axes)},
            {"order": sent.order, "counts": sent.group_sizes, "labels": out.labels,
             "outbound": out.context, "dropped": out.dropped,
             "cross_node": ctx.cross_node(routing.experts.reshape(-1))})


def _dispatch(ctx: Context, block: DecoderBlock, bias: jax.Array, x: Values, meta: Meta
              ) -> tuple[Values, Meta]:
    x = dict(x)
    exchange = (functools.partial(exchange_fp8, ctx.transport) if ctx.fp8_tokens
                else ctx.transport.exchange)
    arrived, labels = exchange(x.pop("rows"), meta["labels"], meta["outbound"])
    arrived_weights, _ = ctx.transport.exchange(x.pop("row_weights"), None, meta["outbound"])
    return ({**x, "arrived": arrived, "arrived_weights": arrived_weights},
            {**meta, "labels": labels})


def _experts(ctx: Context, block: DecoderBlock, bias: jax.Array, x: Values, meta: Meta
             ) -> tuple[Values, Meta]:
    x = dict(x)
    received = ctx.transport.arrange(x.pop("arrived"), meta["labels"], meta["outbound"],
                                     meta["dropped"])
    mlp = block.mlp
    weights = ExpertWeights(mlp.gate_proj[...], mlp.up_proj[...], mlp.down_proj[...])
    row_weights = ctx.transport.arrange_values(x.pop("arrived_weights"), received.context)
    y = grouped_swiglu(received.tokens, received.group_sizes, weights,
                       row_weights=row_weights, precision=mlp.precision)
    normed = x.pop("normed")
    shared = None if mlp.shared_experts is None else mlp.shared_experts(normed)
    return ({**x, "rows": ctx.transport.unarrange(y, received.context), "shared": shared},
            {**meta, "inbound": received.context, "dropped": received.dropped})


def _combine(ctx: Context, block: DecoderBlock, bias: jax.Array, x: Values, meta: Meta
             ) -> tuple[Values, Meta]:
    x = dict(x)
    exchange_back = ctx.transport.exchange_back_for(ctx.fp8_tokens)
    return {**x, "rows": exchange_back(x.pop("rows"), meta["inbound"])}, meta


def _residual(ctx: Context, block: DecoderBlock, bias: jax.Array, x: Values, meta: Meta
              ) -> tuple[Values, Meta]:
    h = x["h"]
    rows = ctx.transport.finish(x["rows"], meta["inbound"])
    y = sum_copies(rows, meta["order"], ctx.config.num_experts_per_tok).reshape(h.shape)
    if x["shared"] is not None:
        y = y + x["shared"]
    return {"h": h + y, "balance": x["balance"]}, meta


PIECES: dict[str, Piece] = {"attention": _attention, "dispatch": _dispatch,
                            "experts": _experts, "combine": _combine, "residual": _residual}


# --- the two chains as lists of steps ---------------------------------------------------

class LayerStats(NamedTuple):
    counts: jax.Array  # (E,) int32 on this device
    balance: jax.Array  # unweighted balance loss on this device's sequences
    dropped: jax.Array  # int32
    cross_node: jax.Array  # int32 copies sent to another node


class ForwardState(NamedTuple):
    x: Values  # between blocks: {"h"}
    meta: Meta
    saved: dict[int, dict[str, Any]]  # block -> piece -> what its backward needs (``keep``)
    stats: dict[int, LayerStats]


class BackwardState(NamedTuple):
    ct: Values  # cotangent of the next piece's output (between blocks: {"h"})
    grads: dict[int, nnx.State]  # block -> parameter gradients (this device's part)
    saved: dict[int, dict[str, Any]]  # what the forward kept


Step = Callable[[Any], Any]


def _layer(stack: "Stack", i: int) -> tuple[nnx.State, jax.Array]:
    return jax.tree.map(lambda a: a[i], stack.params), stack.biases[i]


KEEPS = ("inputs", "pullbacks")


def _piece_vjp(ctx: Context, name: str, params: nnx.State, bias: jax.Array, x: Values,
               meta: Meta) -> tuple[Values, Callable, Meta]:
    """A piece's outputs, its pullback (cotangent of the outputs -> (d_params, d_x)) and
    its output meta."""
    piece = functools.partial(PIECES[name], ctx, bias=bias, meta=meta)
    return jax.vjp(lambda p, v: piece(nnx.merge(ctx.graphdef, p), x=v), params, x,
                   has_aux=True)


def _forward_steps(ctx: Context, stack: "Stack", keep: str) -> list[Step]:
    steps = []
    for i in range(stack.biases.shape[0]):
        params, bias = _layer(stack, i)
        for names in FORWARD_STEPS:
            def step(s: ForwardState, i=i, params=params, bias=bias, names=names
                     ) -> ForwardState:
                x, meta, kept, stats = s.x, s.meta, dict(s.saved.get(i, {})), s.stats
                for name in names:
                    if keep == "pullbacks":
                        x, kept[name], meta = _piece_vjp(ctx, name, params, bias, x, meta)
                    else:
                        kept[name] = (x, meta)
                        x, meta = PIECES[name](ctx, nnx.merge(ctx.graphdef, params), bias,
                                               x, meta)
                if names[-1] == "residual":  # block done: its stats out, h on
                    stats = {**stats, i: LayerStats(meta["counts"], x["balance"],
                                                    meta["dropped"], meta["cross_node"])}
                    x, meta = {"h": x["h"]}, {}
                return ForwardState(x, meta, {**s.saved, i: kept}, stats)
            steps.append(step)
    return steps


def _backward_steps(ctx: Context, stack: "Stack", d_balance: jax.Array) -> list[Step]:
    steps = []
    for i in reversed(range(stack.biases.shape[0])):
        params, bias = _layer(stack, i)
        for names in BACKWARD_STEPS:
            def step(s: BackwardState, i=i, params=params, bias=bias, names=names
                     ) -> BackwardState:
                ct, grads = s.ct, s.grads.get(i)
                if names[0] == "residual":  # block start: its balance loss's cotangent in
                    ct = {"h": ct["h"], "balance": d_balance[i]}
                for name in names:
                    kept = s.saved[i][name]  # a pullback, or the inputs to recompute one
                    pullback = kept if callable(kept) else _piece_vjp(
                        ctx, name, params, bias, *kept)[1]
                    d_params, ct = pullback(ct)
                    grads = d_params if grads is None else jax.tree.map(jnp.add, grads,
                                                                        d_params)
                return BackwardState(ct, {**s.grads, i: grads}, s.saved)
            steps.append(step)
    return steps


ORDERS = ("free", "lockstep", "sequential")


def _run(forward: list[Step], backward: list[Step], f: ForwardState, b: BackwardState,
         order: str) -> tuple[ForwardState, BackwardState]:
    barrier = jax.lax.optimization_barrier
    if order == "sequential":
        for step in forward:
            f = step(f)
        f, b = barrier((f, b))
        for step in backward:
            b = step(b)
        return f, b
    for k in range(max(len(forward), len(backward))):
        f = forward[k](f) if k < len(forward) else f
        b = backward[k](b) if k < len(backward) else b
        if order == "lockstep":
            f, b = barrier((f, b))
    return f, b


# --- public: shard_map over the batch axes ----------------------------------------------

class Stack(NamedTuple):
    """Consecutive MoE blocks: their parameters stacked (L, ...) and router biases (L, E)."""

    params: nnx.State
    biases: jax.Array


class Forward(NamedTuple):
    """A forward chunk of a stack on one micro-batch."""

    h: jax.Array  # (B, S, H) the last block's output
    counts: jax.Array  # (L, E) int32 token copies per expert, over all devices
    balance: jax.Array  # (L,) unweighted balance loss (mean over devices)
    dropped: jax.Array  # int32 copies dropped by a capacity limit, all blocks
    cross_node: jax.Array  # int32 copies sent to an expert on another node, all blocks
    saved: Any  # per piece, its inputs or its pullback (``keep``), per device (leading axis)


class Backward(NamedTuple):
    """A backward chunk of a stack on one micro-batch."""

    d_h: jax.Array  # (B, S, H) gradient w.r.t. the first block's input
    d_params: nnx.State  # like Stack.params, summed over devices (in the executor: mine)


def _param_specs(params: nnx.State) -> nnx.State:
    """Stacked MoE-block parameters: routed experts split over ``expert``, the rest whole."""
    def spec(path: tuple, ndim: int) -> P:
        axes = param_logical_axes(("moe_blocks", *path), ndim)
        return P(*(EXPERT_AXIS if a == "expert" else None for a in axes))
    return nnx.from_flat_state([(path, v.replace(spec(path, v.ndim)))
                                for path, v in nnx.to_flat_state(params)])


def stack_specs(stack: Stack) -> Stack:
    """How ``run_pair`` takes a stack over the mesh: routed experts split over ``expert``,
    the rest (and the router-bias rows) whole."""
    return Stack(_param_specs(stack.params), P())


def run_pair(graphdef: nnx.GraphDef, config: ModelConfig, *,
             forward: tuple[Stack, jax.Array] | None = None,
             backward: tuple[Stack, Any, jax.Array, jax.Array] | None = None,
             order: str = "free", keep: str = "inputs"
             ) -> tuple[Forward | None, Backward | None]:
    """A forward chunk ``(stack, h)`` and a backward chunk ``(stack, saved, d_h, d_balance)``
    of MoE-block stacks, run in ``order`` (one of :data:`ORDERS`).

    Either chunk may be None (a lone forward gives the ``saved`` a backward takes). The
    forward keeps, per piece, what ``keep`` says (:data:`KEEPS`): its ``inputs`` (the
    backward recomputes the piece: least memory) or its ``pullbacks`` (``jax.vjp``
    closures holding the piece's residuals: no recompute, for a forward that is itself
    a recompute inside one traced step, as in the pipeline executor's F&B ticks).
    ``d_h`` is the cotangent of the stack's output, ``d_balance`` (L,) that of its
    per-block balance losses as ``Forward.balance`` reports them (e.g. the aux-loss
    weight). Call under ``jax.set_mesh`` with an ``expert`` axis; ``graphdef`` is one MoE
    ``DecoderBlock``'s. Inside a ``shard_map`` already manual over the batch axes (the
    pipeline executor's), the chunks are this device's rows and its own experts, and
    ``Backward.d_params`` is this device's part, summed by the caller once a step.
    """
    if order not in ORDERS:
        raise ValueError(f"run_pair: order={order!r}; choose from {ORDERS}")
    if keep not in KEEPS:
        raise ValueError(f"run_pair: keep={keep!r}; choose from {KEEPS}")
    if forward is None and backward is None:
        raise ValueError("run_pair: give a forward chunk, a backward chunk, or both")
    h_any = forward[1] if forward is not None else backward[2]
    ep, batch_axes = expert_layout(config, h_any.shape[0])
    tokens = P(batch_axes)
    local_grads = bool(manual_batch_axes())
    senders = sender_axes()  # read here: inside ``body`` every axis is manual

    def body(f_in, b_in):
        batch, seq, _ = (f_in[1] if f_in is not None else b_in[2]).shape
        cos, sin = rope_tables(config, jnp.arange(seq)[None, :])
        options = current_options()
        transport = make_transport(options, ep, batch_axes, batch * seq,
                                   config.num_experts_per_tok, config.n_routed_experts)
        cross_node = functools.partial(
            cross_node_copies, transport=transport, num_local=config.n_routed_experts // ep,
            mesh_shape=dict(jax.sharding.get_abstract_mesh().shape), senders=senders,
            devices_per_node=options.devices_per_node or jax.local_device_count())
        ctx = Context(graphdef, config, transport, cos, sin, batch_axes,
                      options.token_format == "fp8", cross_node)
        f = b = None
        f_steps, b_steps = [], []
        if f_in is not None:
            stack, h = f_in
            f_steps = _forward_steps(ctx, stack._replace(
                params=varying_over(stack.params, batch_axes)), keep)
            f = ForwardState({"h": h}, {}, {}, {})
        if b_in is not None:
            stack, saved, d_h, d_balance = b_in
            shards = jax.lax.psum(1, batch_axes)
            params = varying_over(stack.params, batch_axes)
            # d(mean)/d(mine), typed as the balance the pieces compute from params and rows
            d_balance = varying_over(d_balance / shards, varying_union((params, d_h)))
            b_steps = _backward_steps(ctx, stack._replace(params=params), d_balance)
            b = BackwardState({"h": d_h}, {}, jax.tree.map(lambda a: a[0], saved))
        f, b = _run(f_steps, b_steps, f, b, order)
        return (_forward_out(f, batch_axes),
                _backward_out(b, b_in, () if local_grads else batch_axes))

    f_specs = None if forward is None else (stack_specs(forward[0]), tokens)
    b_specs = None if backward is None else (stack_specs(backward[0]), tokens, tokens, P())
    f_out = None if forward is None else Forward(tokens, P(), P(), P(), P(), tokens)
    b_out = None if backward is None else Backward(tokens, _param_specs(backward[0].params))
    return per_device(body, batch_axes, in_specs=(f_specs, b_specs),
                      out_specs=(f_out, b_out))(forward, backward)


def _forward_out(f: ForwardState | None, batch_axes: tuple[str, ...]) -> Forward | None:
    if f is None:
        return None
    stats = [f.stats[i] for i in sorted(f.stats)]
    total = functools.partial(jax.lax.psum, axis_name=batch_axes)
    saved = jax.tree.map(lambda a: a[None], varying_over(f.saved, batch_axes))
    return Forward(f.x["h"], total(jnp.stack([s.counts for s in stats])),
                   jax.lax.pmean(jnp.stack([s.balance for s in stats]), batch_axes),
                   total(sum(s.dropped for s in stats)), total(sum(s.cross_node for s in stats)),
                   saved)


def _backward_out(b: BackwardState | None, b_in: tuple | None,
                  batch_axes: tuple[str, ...]) -> Backward | None:
    """The backward chunk's input gradient and its parameter gradients summed over
    ``batch_axes`` (none: this device's part)."""
    if b is None:
        return None
    specs = _param_specs(b_in[0].params)
    grads = jax.tree.map(lambda *g: jnp.stack(g), *(b.grads[i] for i in sorted(b.grads)))
    summed = grads if not batch_axes else jax.tree.map(
        lambda g, spec: jax.lax.psum(g, tuple(a for a in batch_axes if a not in spec)),
        grads, specs)
    return Backward(b.ct["h"], summed)

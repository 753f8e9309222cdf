"""Expert parallelism: routed experts sharded over the ``expert`` mesh axis.

Under ``jax.set_mesh(mesh)`` with an ``expert`` axis of size ep > 1, each device routes its
own tokens, sorts the token copies by expert (experts are laid out contiguously, E/ep per
device, so this also groups them by destination), exchanges them over ``expert``, runs its
local experts with grouped matmuls, sends the results back and combines them. Two
transports share that flow:

- ``padded``: a fixed (ep, C, H) buffer per device and ``all_to_all``. Dropless when
  C = T*min(k, E/ep) (a token's k experts are distinct, so at most E/ep of its copies go
  to one device); with ``capacity_factor`` f, C = ceil(f*T*k/ep) and copies past C are
  dropped and counted. Works on every backend (XLA:CPU included).
- ``ragged``: ``jax.lax.ragged_all_to_all`` moves exactly the routed rows, one slice per
  (device, expert), each landing where the receiver's grouped GEMM wants it, so the
  receiver never sorts (GPU/TPU only; not implemented on XLA:CPU). Dropless; the receive
  buffer holds the worst case, ep*T*min(k, E/ep) rows; the grouped GEMM computes only the
  received rows. In one GPU process each slice is cut into pieces of about
  ``RAGGED_PIECE_BYTES``: XLA's kernel there copies slice by slice, 2.6 GB/s for one 50 MB
  slice and as fast as ``all_to_all`` at 512 slices a peer (``experiments.bench_exchange``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels.quantize import from_residual
from pallas_kernels.varying import mark_varying, varying_union
from moejax.config import ConfigError, ModelConfig
from moejax.model.dispatch import dispatch, sorted_weights, sum_copies
from moejax.model.expert_ffn import ExpertWeights, grouped_swiglu
from moejax.model.routing import RoutingStats, balance_loss, route, router_logits
from moejax.parallel.sharding import (BATCH, PIPE_AXIS, check_batch_divides, manual_batch_axes,
                                      mesh_batch_axes, per_device)

EXPERT_AXIS = "expert"
TRANSPORTS = ("auto", "padded", "ragged")
TOKEN_FORMATS = ("compute", "fp8")
# ragged_all_to_all pieces: on 2 x H100 (jax 0.11.2, one process) 100 MB a device moved at
# 61 GB/s in 32 slices a peer, 139 in 128, 171 in 512 (96 KB each; all_to_all: 174) and
# 154 in 2048 (docs/performance.md, 2026-11-25 session 32).
RAGGED_PIECE_BYTES = 64 * 1024
RAGGED_MAX_PIECES_PER_PEER = 512


def ragged_piece_bytes() -> int | None:
    """Bytes a ragged slice is cut to, where that was measured to pay: XLA's one-process
    GPU kernel, which copies slice by slice. None elsewhere (across processes XLA sends
    one NCCL message per slice; TPUs: not measured), where each slice goes whole."""
    one_gpu_process = jax.default_backend() == "gpu" and jax.process_count() == 1
    return RAGGED_PIECE_BYTES if one_gpu_process else None


@dataclasses.dataclass(frozen=True)
class ExpertParallelOptions:
    transport: str = "auto"  # auto: ragged on one GPU/TPU process, else padded
    capacity_factor: float | None = None  # None: dropless
    # Devices per node for the cross-node traffic count; None: devices per process.
    devices_per_node: int | None = None
    # Tokens on the wire: the compute dtype, or FP8 E4M3 with 1x128 scales (half the bytes
    # of BF16), as DeepSeek-V3 sends them: the routed rows and, in the backward, the expert
    # outputs' gradient go in FP8; the outputs and the rows' gradient in the compute dtype.
    token_format: str = "compute"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r}: must be one of {TRANSPORTS}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor!r}: must be > 0 or None")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ConfigError(f"devices_per_node={self.devices_per_node!r}: must be >= 1 or None")
        if self.token_format not in TOKEN_FORMATS:
            raise ConfigError(f"token_format={self.token_format!r}: must be one of "
                              f"{TOKEN_FORMATS}")

    def resolved_transport(self) -> str:
        if self.capacity_factor is not None:
            return "padded"  # capacity limits are a property of the fixed-size buffers
        if self.transport == "auto":
            # XLA:CPU has no ragged_all_to_all. Across processes on GPU (jax 0.11.2, XLA's
            # NCCL send/recv fallback) it hung on 2 H200 where padded all_to_all ran
            # (docs/performance.md, expert parallelism, session 6).
            one_gpu_process = jax.default_backend() != "cpu" and jax.process_count() == 1
            return "ragged" if one_gpu_process else "padded"
        return self.transport


_OPTIONS: contextvars.ContextVar[ExpertParallelOptions] = contextvars.ContextVar(
    "expert_parallel_options", default=ExpertParallelOptions())


@contextlib.contextmanager
def expert_parallel_options(options: ExpertParallelOptions) -> Iterator[None]:
    """Sets the transport for MoE layers traced inside the block."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> ExpertParallelOptions:
    return _OPTIONS.get()


def expert_axis_size() -> int:
    """Size of the ``expert`` axis of the mesh being traced under (1 if none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(mesh.shape).get(EXPERT_AXIS, 1) if mesh.axis_names else 1


def varying_over(tree: Any, axes: tuple[str, ...]) -> Any:
    """Marks arrays replicated over ``axes`` (expert weights, fresh buffers) as varying
    there, so the types match the per-device tokens they meet; autodiff then sums the
    gradients of such weights over ``axes``. Axes a leaf already varies over are skipped."""
    return jax.tree.map(lambda x: mark_varying(x, axes), tree)


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


class Received(NamedTuple):
    """Token copies on the expert side, grouped contiguously by local expert."""

    tokens: jax.Array  # (R, H); rows past sum(group_sizes) are padding
    group_sizes: jax.Array  # (num_local,) int32
    context: tuple  # what send_back needs to return each row to its sender
    dropped: jax.Array  # int32 scalar: copies cut by a capacity limit


class Outbound(NamedTuple):
    """Sender side of a dispatch, laid out for the wire but not yet exchanged."""

    rows: jax.Array  # what the exchange moves
    labels: jax.Array | None  # local expert id per row, moved with the rows (padded only)
    context: Any  # sender bookkeeping: padded (index, keep), ragged RaggedPlan
    dropped: jax.Array  # int32 scalar


def _all_to_all(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, EXPERT_AXIS, 0, 0, tiled=True)


class _Transport:
    """A dispatch and its return cut at the exchanges: local work before (``prepare``,
    ``unarrange``) and after (``arrange``, ``finish``) each collective (``exchange``,
    ``exchange_back``). ``send``/``send_back`` run them in a row; the F&B pair
    (``moejax.parallel.pipeline.fb_pair``) runs them as separate pieces."""

    def send(self, rows: jax.Array, experts: jax.Array, counts: jax.Array) -> Received:
        out = self.prepare(rows, experts, counts)
        return self.arrange(*self.exchange(out.rows, out.labels, out.context), out.context,
                            out.dropped)

    def send_back(self, y: jax.Array, context: tuple, fp8_gradient: bool = False
                  ) -> jax.Array:
        exchange_back = self.exchange_back_for(fp8_gradient)
        return self.finish(exchange_back(self.unarrange(y, context), context), context)

    def exchange_back_for(self, fp8_gradient: bool) -> Callable[[jax.Array, Any], jax.Array]:
        """``exchange_back``, or with ``fp8_gradient`` its form whose gradient travels to
        the experts as FP8 with 1x128 scales (``exchange_back_fp8_gradient``)."""
        return (functools.partial(exchange_back_fp8_gradient, self) if fp8_gradient
                else self.exchange_back)

    def sent_per_destination(self, wanted: jax.Array) -> jax.Array:
        """Copies that leave for each destination device, of ``wanted`` (ep,) routed there:
        all of them, where no capacity cuts any."""
        return wanted

    def send_alongside(self, values: jax.Array, context: Any) -> jax.Array:
        """Per-row values (rows,) of the sent rows, moved as ``send`` moved the rows
        (``context``: the ``Received``'s): the receiver's, row for row with its tokens
        (padding rows: 0). One more exchange of a column; autodiff returns its gradient."""
        outbound = self.outbound_context(context)
        moved, _ = self.exchange(self.lay_out_values(values, outbound), None, outbound)
        return self.arrange_values(moved, context)

    def lay_out_values(self, values: jax.Array, outbound: Any) -> jax.Array:
        """Per-row values (rows,) as a (buffer rows, 1) column laid out like the rows."""
        return self.lay_out(values[:, None], outbound)

    def arrange_values(self, column: jax.Array, context: Any) -> jax.Array:
        """An arrived column of per-row values, (rows,) in the order of ``arrange``'s rows."""
        return self.arrange_alongside(column, context)[:, 0]


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows of ``x`` at ``index`` (zeros where an index is out of range), for an ``index``
    that takes each row at most once; ``inverse`` says where each row of ``x`` went (out
    of range: nowhere). Its transpose is then the gather by ``inverse``, where autodiff
    would scatter-add (the padded layer's scatters, its own and autodiff's, were 2.8 ms of
    its 5.1 ms of data movement on an H100: docs/performance.md, 2026-11-25 session 32)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return take_rows(x, index, inverse), (index, inverse)


def _take_rows_bwd(residuals, g):
    index, inverse = residuals
    return take_rows(g, inverse, index), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@dataclasses.dataclass(frozen=True)
class _Padded(_Transport):
    """Fixed-capacity all_to_all: row ``dest*C + slot`` of the buffer goes to ``dest``.

    Rows arrive source-major with a fixed C per source, so the receiver sorts them by
    local expert before the grouped GEMM and undoes that sort before sending back. Every
    placement is a gather both ways (``take_rows``): the sender's context holds, for each
    row, its buffer slot (``index``; ep*C if dropped) and, for each slot, its row
    (``source``; T*k for padding).
    """

    capacity: int
    ep: int
    num_local: int  # experts per device

    def prepare(self, rows: jax.Array, experts: jax.Array, counts: jax.Array) -> Outbound:
        num_local, capacity, n = self.num_local, self.capacity, rows.shape[0]
        dest = experts // num_local
        per_dest = counts.reshape(self.ep, num_local).sum(axis=1)
        first = _exclusive_cumsum(per_dest)  # rows are sorted by expert, so by destination
        slot = jnp.arange(n) - first[dest]
        keep = slot < capacity
        size = self.ep * capacity
        index = jnp.where(keep, dest * capacity + slot, size)
        slot_dest, slot_of = jnp.divmod(jnp.arange(size), capacity)
        source = jnp.where(slot_of < per_dest[slot_dest], first[slot_dest] + slot_of, n)
        ids = jnp.where(source < n, experts[jnp.minimum(source, n - 1)] % num_local, num_local)
        context = (index, source)
        return Outbound(self.lay_out(rows, context), ids.astype(jnp.int32), context,
                        n - keep.sum(dtype=jnp.int32))

    def sent_per_destination(self, wanted: jax.Array) -> jax.Array:
        return jnp.minimum(wanted, self.capacity)  # the first C of each destination go

    def lay_out(self, rows: jax.Array, context: tuple) -> jax.Array:
        """Rows (or per-row values, (rows, ...)) placed in the send buffer."""
        index, source = context
        return take_rows(rows, source, index)

    def exchange(self, rows: jax.Array, labels: jax.Array | None, context: tuple
                 ) -> tuple[jax.Array, jax.Array | None]:
        return _all_to_all(rows), None if labels is None else _all_to_all(labels)

    def arrange(self, tokens: jax.Array, ids: jax.Array, context: tuple, dropped: jax.Array
                ) -> Received:
        # padding (id nl) sorts last, as one more group
        order, sizes = pallas_kernels.sort_by_expert(ids, self.num_local + 1)
        inverse = pallas_kernels.inverse_permutation(order)
        return Received(take_rows(tokens, order, inverse), sizes[:self.num_local],
                        (order, inverse, *context), dropped)

    def arrange_alongside(self, values: jax.Array, context: tuple) -> jax.Array:
        """Arrived per-row values in the order ``arrange`` gave their rows."""
        order, inverse = context[:2]
        return take_rows(values, order, inverse)

    def outbound_context(self, context: tuple) -> tuple:
        """The sender's ``prepare`` context, from the receiver's."""
        return context[2:]

    def unarrange(self, y: jax.Array, context: tuple) -> jax.Array:
        order, inverse = context[:2]
        return take_rows(y, inverse, order)

    def exchange_back(self, y: jax.Array, context: tuple) -> jax.Array:
        return _all_to_all(y)

    def finish(self, back: jax.Array, context: tuple) -> jax.Array:
        index, source = context[2:]
        return take_rows(back, index, source)


class RaggedPlan(NamedTuple):
    """Offsets and sizes of both ragged exchanges, one slice per (device, expert).

    Every sender cuts its expert-sorted rows into one slice per global expert and lands
    each slice at its final place on the receiver: expert-major, then source-major. The
    receive buffer is therefore already grouped by local expert and needs no sort.
    """

    send_offsets: jax.Array  # (E,) where my slice for expert e starts in my rows
    send_sizes: jax.Array  # (E,) my copies routed to expert e
    land_offsets: jax.Array  # (E,) where that slice lands on the expert's device
    recv_offsets: jax.Array  # (ep*nl,) where slice (source s, local expert j) sits here
    recv_sizes: jax.Array  # (ep*nl,) its size
    return_offsets: jax.Array  # (ep*nl,) where it goes back to in source s's rows
    group_sizes: jax.Array  # (nl,) rows per local expert


def cut_into_pieces(sizes: jax.Array, pieces: int) -> tuple[jax.Array, jax.Array]:
    """Each slice of n rows cut into ``pieces`` consecutive pieces at ``c*n // pieces``:
    every piece's start within its slice and its size, slice-major (slice s, piece c at
    ``s*pieces + c``). Both ends of an exchange cut a slice of the same n alike, so the
    pieces pair up and land in order."""
    bounds = sizes[:, None] * jnp.arange(pieces + 1, dtype=sizes.dtype) // pieces
    return bounds[:, :-1].reshape(-1), jnp.diff(bounds, axis=1).reshape(-1)


def ragged_plan(counts: jax.Array, me: jax.Array) -> RaggedPlan:
    """The exchange plan on device ``me`` from every device's per-expert counts (ep, E)."""
    ep, experts = counts.shape
    num_local = experts // ep
    totals = counts.sum(axis=0)  # rows each expert receives
    # where each expert's rows start on its own device: its device's earlier experts' rows
    expert_start = _exclusive_cumsum(totals.reshape(ep, num_local), axis=1).reshape(experts)
    from_earlier_sources = _exclusive_cumsum(counts, axis=0)  # (ep, E)
    send_offsets_all = _exclusive_cumsum(counts, axis=1)  # (ep, E): every sender's offsets

    def my_experts(a: jax.Array) -> jax.Array:  # the columns of my local experts
        return jax.lax.dynamic_slice_in_dim(a, me * num_local, num_local, axis=-1)

    return RaggedPlan(
        send_offsets=send_offsets_all[me],
        send_sizes=counts[me],
        land_offsets=expert_start + from_earlier_sources[me],
        recv_offsets=(my_experts(expert_start)[None, :]
                      + my_experts(from_earlier_sources)).reshape(-1),
        recv_sizes=my_experts(counts).reshape(-1),
        return_offsets=my_experts(send_offsets_all).reshape(-1),
        group_sizes=my_experts(totals).astype(jnp.int32),
    )


@dataclasses.dataclass(frozen=True)
class _Ragged(_Transport):
    """Exact-size exchange with ragged_all_to_all, landing rows grouped by expert."""

    ep: int
    batch_axes: tuple[str, ...]  # the receive buffers vary over these, like the tokens
    num_rows: int  # token copies each device sends (T*k)
    recv_rows: int  # the most copies a device can receive (every source's worst case)
    num_experts: int
    piece_bytes: int | None  # ragged_piece_bytes()

    def pieces(self, row_bytes: int) -> int:
        """Pieces per (device, expert) slice for rows of ``row_bytes``: an even routing's
        slice cut to about ``piece_bytes``, at most ``RAGGED_MAX_PIECES_PER_PEER`` slices
        a peer (1: slices go whole)."""
        if self.piece_bytes is None:
            return 1
        slice_bytes = self.num_rows / self.num_experts * row_bytes
        most = max(1, RAGGED_MAX_PIECES_PER_PEER * self.ep // self.num_experts)
        return min(most, max(1, math.ceil(slice_bytes / self.piece_bytes)))

    def move(self, rows: jax.Array, plan: RaggedPlan, back: bool) -> jax.Array:
        """``ragged_all_to_all`` of ``rows`` along ``plan``: each (device, expert) slice
        out to where it lands on the expert's device, or ``back`` to where it came from,
        each slice cut into ``pieces`` of its row size. Received rows fill a zero buffer."""
        if back:
            out_rows, starts, sizes, lands, recv_sizes = (
                self.num_rows, plan.recv_offsets, plan.recv_sizes, plan.return_offsets,
                plan.send_sizes)
        else:
            out_rows, starts, sizes, lands, recv_sizes = (
                self.recv_rows, plan.send_offsets, plan.send_sizes, plan.land_offsets,
                plan.recv_sizes)
        rows, output = _zeros_after(rows, out_rows)
        output = varying_over(output, self.batch_axes)
        pieces = self.pieces(math.prod(rows.shape[1:]) * rows.dtype.itemsize)
        within, piece_sizes = cut_into_pieces(sizes, pieces)
        return jax.lax.ragged_all_to_all(
            rows, output, jnp.repeat(starts, pieces) + within, piece_sizes,
            jnp.repeat(lands, pieces) + within, cut_into_pieces(recv_sizes, pieces)[1],
            axis_name=EXPERT_AXIS)

    def prepare(self, rows: jax.Array, experts: jax.Array, counts: jax.Array) -> Outbound:
        """Rows are sorted by expert: every device's counts (one small all_gather) say
        where each slice starts and lands."""
        del experts
        plan = ragged_plan(jax.lax.all_gather(counts, EXPERT_AXIS),
                           jax.lax.axis_index(EXPERT_AXIS))
        return Outbound(rows, None, plan, jnp.zeros((), jnp.int32))

    def exchange(self, rows: jax.Array, labels: None, plan: RaggedPlan
                 ) -> tuple[jax.Array, None]:
        return ragged_move(self, rows, plan, False), None

    def arrange(self, tokens: jax.Array, labels: None, plan: RaggedPlan, dropped: jax.Array
                ) -> Received:
        return Received(tokens, plan.group_sizes, plan, dropped)

    def lay_out(self, rows: jax.Array, plan: RaggedPlan) -> jax.Array:
        return rows  # sent as they are: sorted by expert

    def arrange_alongside(self, values: jax.Array, plan: RaggedPlan) -> jax.Array:
        return values  # they land grouped by expert

    def outbound_context(self, plan: RaggedPlan) -> RaggedPlan:
        return plan

    def unarrange(self, y: jax.Array, plan: RaggedPlan) -> jax.Array:
        return y

    def exchange_back(self, y: jax.Array, plan: RaggedPlan) -> jax.Array:
        return ragged_move(self, y, plan, True)

    def finish(self, back: jax.Array, plan: RaggedPlan) -> jax.Array:
        return back


def _zeros_after(rows: jax.Array, out_rows: int) -> tuple[jax.Array, jax.Array]:
    """``rows`` and a zero buffer of ``out_rows`` rows like them, made only once ``rows``
    exist. A constant zero buffer has no inputs, so XLA fused every exchange's buffers,
    the backward's too, into one kernel at the start of the step: on `small` with
    expert=4, 480 MiB a MoE layer held from the forward to the backward (the step's
    peak fell 32.55 -> 27.39 GiB; docs/performance.md, Expert parallelism, session 40)."""
    zero = mark_varying(jnp.zeros((), rows.dtype), varying_union((rows,)))  # types match
    zero, rows = jax.lax.optimization_barrier((zero, rows))
    return rows, jnp.broadcast_to(zero, (out_rows, *rows.shape[1:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def ragged_move(transport: _Ragged, rows: jax.Array, plan: RaggedPlan, back: bool) -> jax.Array:
    """``transport.move``, whose transpose is the move the other way on the same plan.

    JAX's own transpose of ``ragged_all_to_all`` first sends both offset arrays to the
    receivers, with two ``all_to_all``s, in every backward exchange. On 4 x H200 that was 72
    NCCL ``SendRecv`` kernels, 13 ms of a 188 ms ``small`` step. The plan already holds
    both views. It is computed once per layer, from one all_gather of the counts. (In that
    measurement the router had collapsed onto a few experts, and the time saved went into
    waiting for the busiest device: the step did not shorten. docs/performance.md, Expert
    parallelism, session 39.)
    """
    return transport.move(rows, plan, back)


def _ragged_move_fwd(transport, rows, plan, back):
    return transport.move(rows, plan, back), plan


def _ragged_move_bwd(transport, back, plan, g):
    return transport.move(g, plan, not back), None


ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


# (rows, group_sizes, weights, rows' FP8 quantization or None, rows' router weights)
#   -> expert outputs, weighted
RunExperts = Callable[[jax.Array, jax.Array, ExpertWeights, Any, jax.Array], jax.Array]
Transport = _Padded | _Ragged


def dropless_copies_to_one_device(tokens: int, top_k: int, num_experts: int, ep: int) -> int:
    """The most of ``tokens`` tokens' routed copies that can go to one device: a token's
    top-k experts are distinct, so at most min(k, experts per device) share a device."""
    return tokens * min(top_k, num_experts // ep)


def make_transport(options: ExpertParallelOptions, ep: int, batch_axes: tuple[str, ...],
                   tokens: int, top_k: int, num_experts: int) -> Transport:
    """The transport ``options`` ask for, sized for ``tokens`` tokens of ``top_k`` copies
    per device."""
    bound = dropless_copies_to_one_device(tokens, top_k, num_experts, ep)
    if options.resolved_transport() == "ragged":
        return _Ragged(ep, batch_axes, tokens * top_k, ep * bound, num_experts,
                       ragged_piece_bytes())
    capacity = bound if options.capacity_factor is None else max(
        1, math.ceil(options.capacity_factor * tokens * top_k / ep))
    return _Padded(capacity, ep, num_experts // ep)


def _pack_fp8(tokens: jax.Array, scales: jax.Array) -> jax.Array:
    """FP8 rows and their FP32 scales as one byte row each, so one exchange moves both."""
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(scales.shape[0], -1)
    return jnp.concatenate([jax.lax.bitcast_convert_type(tokens, jnp.uint8), scale_bytes], 1)


def _unpack_fp8(packed: jax.Array, hidden: int, dtype: jnp.dtype
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Arrived byte rows -> (dequantized rows in ``dtype``, (FP8 values, 1x128 scales) in
    the ``as_residual`` form the FP8 GEMMs take: the values stay the bytes that arrived)."""
    scale_bytes = packed[:, hidden:].reshape(packed.shape[0], -1, 4)
    kept = packed[:, :hidden], jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)
    return pallas_kernels.dequantize(*from_residual(kept), 1).astype(dtype), kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _dispatch_fp8(transport: Transport, num_experts: int, num_experts_per_token: int,
                  x: jax.Array, expert_ids: jax.Array
                  ) -> tuple[Received, jax.Array, tuple[jax.Array, jax.Array]]:
    """Sort + FP8-quantize (one fused pass), exchange the bytes, dequantize on arrival.

    Returns what arrived, in ``x``'s dtype, the sender's sort permutation, and the arrived
    rows as they travelled (FP8 values as uint8 bits, 1x128 scales: ``as_residual`` form)
    for FP8 GEMMs to take as is (then
    the dequantized copy is dead code). The backward treats quantization as identity
    (straight-through) and sends the gradient back in ``x``'s dtype, as DeepSeek-V3's
    combine-side communication does.
    """
    return _dispatch_fp8_fwd(transport, num_experts, num_experts_per_token, x, expert_ids)[0]


def _dispatch_fp8_fwd(transport, num_experts, num_experts_per_token, x, expert_ids):
    del num_experts_per_token  # expert_ids (T, k) carries it; the backward needs it static
    sent = pallas_kernels.dispatch(x, expert_ids, num_experts, quantize=True)
    sorted_ids = expert_ids.reshape(-1)[sent.permutation]
    received = transport.send(_pack_fp8(sent.tokens, sent.scales), sorted_ids, sent.group_sizes)
    tokens, quantized = _unpack_fp8(received.tokens, x.shape[1], x.dtype)
    return ((received._replace(tokens=tokens), sent.permutation, quantized),
            (received.context, sent.permutation))


def _dispatch_fp8_bwd(transport, num_experts, num_experts_per_token, residuals, cotangents):
    del num_experts
    context, permutation = residuals
    rows = transport.send_back(cotangents[0].tokens, context)
    # the sorted rows' gradient summed back onto their token
    return sum_copies(rows, permutation, num_experts_per_token), None


_dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_fp8(transport: Transport, rows: jax.Array, labels: Any, context: Any
                 ) -> tuple[jax.Array, Any]:
    """``transport.exchange`` with the rows on the wire as FP8 and their 1x128 scales (one
    packed byte row each), dequantized to ``rows``' dtype on arrival: the exchange alone,
    for callers that run it as its own piece (``fb_pair``). The backward is straight-
    through, the gradient returning in ``rows``' dtype by the exchange's transpose
    (``exchange_back``), as in ``_dispatch_fp8``."""
    return _exchange_fp8_fwd(transport, rows, labels, context)[0]


def _exchange_as_fp8(transport: Transport, rows: jax.Array, labels: Any, context: Any
                     ) -> tuple[jax.Array, Any]:
    """Quantize to FP8 with 1x128 scales, exchange the packed bytes, dequantize on arrival."""
    packed, moved = transport.exchange(_pack_fp8(*pallas_kernels.quantize_rows(rows)),
                                       labels, context)
    return _unpack_fp8(packed, rows.shape[1], rows.dtype)[0], moved


def _exchange_fp8_fwd(transport, rows, labels, context):
    return _exchange_as_fp8(transport, rows, labels, context), context


def _exchange_fp8_bwd(transport, context, cotangents):
    return transport.exchange_back(cotangents[0], context), None, None


exchange_fp8.defvjp(_exchange_fp8_fwd, _exchange_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_back_fp8_gradient(transport: Transport, y: jax.Array, context: Any
                               ) -> jax.Array:
    """``transport.exchange_back`` (expert outputs returning in their own dtype) whose
    transpose, the outputs' gradient going to the experts, travels as FP8 with 1x128 scales
    and is dequantized on arrival (straight-through): DeepSeek-V3 sends the activation
    gradient before the MoE down-projections in FP8 and keeps both combines in BF16."""
    return transport.exchange_back(y, context)


def _exchange_back_fp8_gradient_fwd(transport, y, context):
    return transport.exchange_back(y, context), context


def _exchange_back_fp8_gradient_bwd(transport, context, g):
    return _exchange_as_fp8(transport, g, None, transport.outbound_context(context))[0], None


exchange_back_fp8_gradient.defvjp(_exchange_back_fp8_gradient_fwd,
                                  _exchange_back_fp8_gradient_bwd)


def sender_axes() -> frozenset[str]:
    """The mesh axes besides ``expert`` whose index places a device's tokens, read where a
    MoE layer is called (before its own ``shard_map``): the batch axes, and ``pipe`` inside
    the pipeline executor (manual over it), whose ranks each exchange among their own
    devices. Axes the tokens are replicated over (pipe outside it, tensor) count at index
    0, so every replica reports the same traffic."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return frozenset(BATCH) | ({PIPE_AXIS} if PIPE_AXIS in manual else set())


def _node_of_expert_position(position: jax.Array, mesh_shape: dict[str, int],
                             devices_per_node: int, senders: frozenset[str]) -> jax.Array:
    """Node of the device at ``position`` along ``expert`` and this device's coordinates on
    the ``senders`` axes (``sender_axes``). Devices are laid out row-major over the mesh
    axes (``moejax.parallel.mesh``), one node's devices contiguous."""
    flat = jnp.zeros((), jnp.int32)
    for axis, size in mesh_shape.items():
        if axis == EXPERT_AXIS:
            index = position
        elif size > 1 and axis in senders:
            index = jax.lax.axis_index(axis)
        else:
            index = 0
        flat = flat * size + index
    return flat // devices_per_node


def cross_node_copies(copies: jax.Array, *, transport: Transport, num_local: int,
                      mesh_shape: dict[str, int], devices_per_node: int,
                      senders: frozenset[str]) -> jax.Array:
    """How many of this device's token copies (global expert ids, experts laid out
    ``num_local`` per device along ``expert``) ``transport`` sends to a device on another
    node: a copy a capacity drops is not sent (call inside a ``shard_map`` manual over
    ``expert``; ``senders`` as ``sender_axes`` read outside it)."""
    node = functools.partial(_node_of_expert_position, mesh_shape=mesh_shape,
                             devices_per_node=devices_per_node, senders=senders)
    ep = mesh_shape[EXPERT_AXIS]
    sent = transport.sent_per_destination(jnp.bincount(copies // num_local, length=ep))
    remote = node(jnp.arange(ep)) != node(jax.lax.axis_index(EXPERT_AXIS))
    return jnp.sum(jnp.where(remote, sent, 0), dtype=jnp.int32)


def _shard_body(x: jax.Array, router: jax.Array, bias: jax.Array, weights: ExpertWeights, *,
                config: ModelConfig, ep: int, batch_axes: tuple[str, ...],
                mesh_shape: dict[str, int], senders: frozenset[str],
                options: ExpertParallelOptions, devices_per_node: int, run_experts: RunExperts
                ) -> tuple[jax.Array, RoutingStats]:
    batch, seq, hidden = x.shape
    flat = x.reshape(batch * seq, hidden)
    logits = router_logits(x, router).reshape(batch * seq, -1)
    routing = route(logits, bias, config)
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    num_local = experts // ep

    copies = routing.experts.reshape(-1)
    counts = jnp.bincount(copies, length=experts).astype(jnp.int32)
    transport = make_transport(options, ep, batch_axes, flat.shape[0], k, experts)
    if options.token_format == "fp8":
        received, order, quantized = _dispatch_fp8(transport, experts, k, flat,
                                                   routing.experts)
    else:
        sent = dispatch(flat, routing.experts, experts)
        order, quantized = sent.order, None
        received = transport.send(sent.tokens, copies[order], sent.group_sizes)
    weights = varying_over(weights, tuple(a for a in batch_axes if a != EXPERT_AXIS))
    row_weights = transport.send_alongside(sorted_weights(routing.weights, order),
                                           received.context)
    y_rows = transport.send_back(
        run_experts(received.tokens, received.group_sizes, weights, quantized, row_weights),
        received.context, fp8_gradient=options.token_format == "fp8")
    y = sum_copies(y_rows, order, k).reshape(batch, seq, hidden)

    balance = balance_loss(routing, batch, config)
    cross_node = cross_node_copies(copies, transport=transport, num_local=num_local,
                                   mesh_shape=mesh_shape, devices_per_node=devices_per_node,
                                   senders=senders)
    total = functools.partial(jax.lax.psum, axis_name=batch_axes)
    return y, RoutingStats(total(counts), jax.lax.pmean(balance, batch_axes),
                           total(received.dropped), total(cross_node))


def expert_layout(config: ModelConfig, batch: int) -> tuple[int, tuple[str, ...]]:
    """``(ep, batch axes)`` of the mesh being traced under, checked against the model's
    expert count and the token batch (clear errors before any tracing of the layer)."""
    mesh = jax.sharding.get_abstract_mesh()
    ep = dict(mesh.shape)[EXPERT_AXIS]
    if config.n_routed_experts % ep:
        raise ConfigError(f"n_routed_experts={config.n_routed_experts}: must be divisible by "
                          f"the expert mesh axis size {ep}")
    batch_axes = mesh_batch_axes()
    if not manual_batch_axes():  # else ``batch`` is one device's rows already
        check_batch_divides(batch, batch_axes)
    return ep, batch_axes


def expert_parallel_moe(x: jax.Array, router: jax.Array, bias: jax.Array,
                        weights: ExpertWeights, config: ModelConfig,
                        run_experts: RunExperts = grouped_swiglu
                        ) -> tuple[jax.Array, RoutingStats]:
    """The routed part of a MoE layer with experts sharded over the mesh's ``expert`` axis.

    ``run_experts(rows, group_sizes, weights, rows_fp8, row_weights)`` maps the received
    rows (grouped by local expert) to their outputs weighted by ``row_weights`` (each
    row's router weight, moved with the rows); ``rows_fp8`` is their FP8 quantization as
    it travelled with FP8 tokens (the FP8 expert GEMMs take it without re-rounding), else
    None; benchmarks pass an identity to time the token exchange alone. Inside a
    ``shard_map`` already manual over the batch axes (the pipeline executor's), ``x`` is
    this device's rows and ``weights`` its own experts.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ep, batch_axes = expert_layout(config, x.shape[0])
    options = current_options()
    body = functools.partial(
        _shard_body, config=config, ep=ep, batch_axes=batch_axes, mesh_shape=dict(mesh.shape),
        senders=sender_axes(), options=options,
        devices_per_node=options.devices_per_node or jax.local_device_count(),
        run_experts=run_experts)
    tokens = P(batch_axes)
    experts = ExpertWeights(P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS))
    return per_device(body, batch_axes, in_specs=(tokens, P(), P(), experts),
                      out_specs=(tokens, RoutingStats(P(), P(), P(), P())))(
        x, router, bias, weights)

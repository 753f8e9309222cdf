"""Expert parallelism: routed experts sharded over the ``expert`` mesh axis.

Under ``jax.set_mesh(mesh)`` with an ``expert`` axis of size ep > 1, each device routes its
own tokens, sorts the token copies by expert (experts are laid out contiguously, E/ep per
device, so this also groups them by destination), exchanges them over ``expert``, runs its
local experts with grouped matmuls, sends the results back and combines them. Two
transports share that flow:

- ``padded``: a fixed (ep, C, H) buffer per device and ``all_to_all``. Dropless when
  C = T*k (every copy could go to one device); with ``capacity_factor`` f, C = ceil(f*T*k/ep)
  and copies past C are dropped and counted. Works on every backend (XLA:CPU included).
- ``ragged``: ``jax.lax.ragged_all_to_all`` moves exactly the routed rows (GPU/TPU only;
  not implemented on XLA:CPU). Dropless; the receive buffer holds the worst case.
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

from moejax.config import ConfigError, ModelConfig
from moejax.model.dispatch import combine
from moejax.model.expert_ffn import ExpertWeights, grouped_swiglu
from moejax.model.routing import RoutingStats, route, sequence_balance_loss

EXPERT_AXIS = "expert"
BATCH_AXES = ("data", EXPERT_AXIS)  # mesh axes the token batch is sharded over
TRANSPORTS = ("auto", "padded", "ragged")


@dataclasses.dataclass(frozen=True)
class ExpertParallelOptions:
    transport: str = "auto"  # auto: ragged on GPU/TPU, padded on CPU
    capacity_factor: float | None = None  # None: dropless
    # Devices per node for the cross-node traffic count; None: devices per process.
    devices_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport={self.transport!r}: must be one of {TRANSPORTS}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor!r}: must be > 0 or None")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ConfigError(f"devices_per_node={self.devices_per_node!r}: must be >= 1 or None")

    def resolved_transport(self) -> str:
        if self.capacity_factor is not None:
            return "padded"  # capacity limits are a property of the fixed-size buffers
        if self.transport == "auto":
            return "padded" if jax.default_backend() == "cpu" else "ragged"
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


def _varying_over(tree: Any, axes: tuple[str, ...]) -> Any:
    """Marks arrays replicated over ``axes`` (expert weights, fresh buffers) as varying
    there, so the types match the per-device tokens they meet; autodiff then sums the
    gradients of such weights over ``axes``."""
    if not axes:
        return tree
    if hasattr(jax.lax, "pcast"):  # jax >= 0.10
        return jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), tree)
    return jax.lax.pvary(tree, axes)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


class _Padded(NamedTuple):
    """Fixed-capacity all_to_all: row ``dest*C + slot`` of the buffer goes to ``dest``."""

    capacity: int
    ep: int

    def send(self, rows: jax.Array, local_ids: jax.Array, dest: jax.Array, per_dest: jax.Array,
             invalid_id: int) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
        slot = jnp.arange(rows.shape[0]) - _exclusive_cumsum(per_dest)[dest]
        keep = slot < self.capacity
        size = self.ep * self.capacity
        index = jnp.where(keep, dest * self.capacity + slot, size)  # size: dropped
        buffer = jnp.zeros((size, rows.shape[1]), rows.dtype).at[index].set(rows, mode="drop")
        ids = jnp.full((size,), invalid_id, jnp.int32).at[index].set(local_ids, mode="drop")
        exchange = lambda a: jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)  # noqa: E731
        dropped = rows.shape[0] - keep.sum(dtype=jnp.int32)
        return exchange(buffer), exchange(ids), (index, keep), dropped

    def send_back(self, y: jax.Array, context: tuple) -> jax.Array:
        index, keep = context
        back = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0, tiled=True)
        rows = back[jnp.minimum(index, back.shape[0] - 1)]
        return jnp.where(keep[:, None], rows, jnp.zeros_like(rows))


class _Ragged(NamedTuple):
    """Exact-size exchange with ragged_all_to_all; senders' rows land source-major."""

    ep: int
    batch_axes: tuple[str, ...]  # the receive buffers vary over these, like the tokens

    def send(self, rows: jax.Array, local_ids: jax.Array, dest: jax.Array, per_dest: jax.Array,
             invalid_id: int) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
        del dest
        me = jax.lax.axis_index(EXPERT_AXIS)
        sent = jax.lax.all_gather(per_dest, EXPERT_AXIS)  # (src, dst) row counts
        send_offsets = _exclusive_cumsum(per_dest)
        # where my rows start in each destination's buffer: after lower-ranked sources'
        land_offsets = jnp.sum(jnp.where(jnp.arange(self.ep)[:, None] < me, sent, 0), axis=0)
        recv_sizes = sent[:, me]
        recv_offsets = _exclusive_cumsum(recv_sizes)
        size = self.ep * rows.shape[0]  # worst case: every source sends everything to me

        def exchange(operand: jax.Array, output: jax.Array) -> jax.Array:
            return jax.lax.ragged_all_to_all(operand, output, send_offsets, per_dest,
                                             land_offsets, recv_sizes, axis_name=EXPERT_AXIS)

        buffers = _varying_over((jnp.zeros((size, rows.shape[1]), rows.dtype),
                                 jnp.full((size,), invalid_id, jnp.int32)), self.batch_axes)
        tokens = exchange(rows, buffers[0])
        ids = exchange(local_ids, buffers[1])
        # On the way back my received blocks return to where each source took them from.
        back_offsets = jnp.sum(jnp.where(jnp.arange(self.ep)[None, :] < me, sent, 0), axis=1)
        context = (recv_offsets, recv_sizes, back_offsets, per_dest, rows.shape[0])
        return tokens, ids, context, jnp.zeros((), jnp.int32)

    def send_back(self, y: jax.Array, context: tuple) -> jax.Array:
        recv_offsets, recv_sizes, back_offsets, per_dest, num_rows = context
        output = _varying_over(jnp.zeros((num_rows, y.shape[1]), y.dtype), self.batch_axes)
        return jax.lax.ragged_all_to_all(y, output, recv_offsets, recv_sizes, back_offsets,
                                         per_dest, axis_name=EXPERT_AXIS)


RunExperts = Callable[[jax.Array, jax.Array, int, ExpertWeights], jax.Array]


def _local_experts(tokens: jax.Array, ids: jax.Array, num_local: int,
                   weights: ExpertWeights) -> jax.Array:
    """Runs received rows (any order; id == num_local marks padding) through local experts."""
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_local).astype(jnp.int32)  # padding not counted
    y_sorted = grouped_swiglu(tokens[order], group_sizes, weights)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def _node_of_expert_position(position: jax.Array, mesh_shape: dict[str, int],
                             devices_per_node: int) -> jax.Array:
    """Node of the device at ``position`` along ``expert`` and this device's batch coordinates.

    Devices are laid out row-major over the mesh axes (``moejax.parallel.mesh``), one node's
    devices contiguous. Axes the tokens are replicated over (pipe, tensor) count at index 0,
    so every replica reports the same traffic.
    """
    flat = jnp.zeros((), jnp.int32)
    for axis, size in mesh_shape.items():
        if axis == EXPERT_AXIS:
            index = position
        elif axis in BATCH_AXES and size > 1:
            index = jax.lax.axis_index(axis)
        else:
            index = 0
        flat = flat * size + index
    return flat // devices_per_node


def _shard_body(x: jax.Array, router: jax.Array, bias: jax.Array, weights: ExpertWeights, *,
                config: ModelConfig, ep: int, batch_axes: tuple[str, ...],
                mesh_shape: dict[str, int], options: ExpertParallelOptions,
                devices_per_node: int, run_experts: RunExperts) -> tuple[jax.Array, RoutingStats]:
    batch, seq, hidden = x.shape
    flat = x.reshape(batch * seq, hidden)
    logits = jnp.dot(flat.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
    routing = route(logits, bias, config)
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    num_local = experts // ep

    copies = routing.experts.reshape(-1)
    order = jnp.argsort(copies, stable=True).astype(jnp.int32)
    sorted_experts = copies[order]
    dest = sorted_experts // num_local
    per_dest = jnp.bincount(dest, length=ep).astype(jnp.int32)
    rows = flat[order // k]
    if options.resolved_transport() == "ragged":
        transport: _Padded | _Ragged = _Ragged(ep, batch_axes)
    else:
        capacity = rows.shape[0] if options.capacity_factor is None else max(
            1, math.ceil(options.capacity_factor * rows.shape[0] / ep))
        transport = _Padded(capacity, ep)
    tokens, ids, context, dropped = transport.send(rows, sorted_experts % num_local, dest,
                                                   per_dest, num_local)
    weights = _varying_over(weights, tuple(a for a in batch_axes if a != EXPERT_AXIS))
    y_rows = transport.send_back(run_experts(tokens, ids, num_local, weights), context)
    y = combine(y_rows, order, routing.weights).reshape(batch, seq, hidden)

    counts = jnp.bincount(copies, length=experts).astype(jnp.int32)
    balance = (sequence_balance_loss(routing.scores, routing.experts, batch, config)
               if config.aux_loss_alpha else jnp.zeros((), jnp.float32))
    node = functools.partial(_node_of_expert_position, mesh_shape=mesh_shape,
                             devices_per_node=devices_per_node)
    cross_node = jnp.sum(node(dest) != node(jax.lax.axis_index(EXPERT_AXIS)), dtype=jnp.int32)
    total = functools.partial(jax.lax.psum, axis_name=batch_axes)
    return y, RoutingStats(total(counts), jax.lax.pmean(balance, batch_axes), total(dropped),
                           total(cross_node))


def expert_parallel_moe(x: jax.Array, router: jax.Array, bias: jax.Array,
                        weights: ExpertWeights, config: ModelConfig,
                        run_experts: RunExperts = _local_experts) -> tuple[jax.Array, RoutingStats]:
    """The routed part of a MoE layer with experts sharded over the mesh's ``expert`` axis.

    ``run_experts(rows, local_ids, num_local, weights)`` maps the received rows to outputs;
    benchmarks pass an identity to time the token exchange alone.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ep = dict(mesh.shape)[EXPERT_AXIS]
    if config.n_routed_experts % ep:
        raise ConfigError(f"n_routed_experts={config.n_routed_experts}: must be divisible by "
                          f"the expert mesh axis size {ep}")
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    shards = math.prod(dict(mesh.shape)[a] for a in batch_axes)
    if x.shape[0] % shards:
        raise ConfigError(f"batch size {x.shape[0]}: must be divisible by the {shards} devices "
                          f"of mesh axes {batch_axes}")
    options = current_options()
    body = functools.partial(
        _shard_body, config=config, ep=ep, batch_axes=batch_axes, mesh_shape=dict(mesh.shape),
        options=options, devices_per_node=options.devices_per_node or jax.local_device_count(),
        run_experts=run_experts)
    tokens = P(batch_axes)
    experts = ExpertWeights(P(EXPERT_AXIS), P(EXPERT_AXIS), P(EXPERT_AXIS))
    return jax.shard_map(body, in_specs=(tokens, P(), P(), experts),
                         out_specs=(tokens, RoutingStats(P(), P(), P(), P())))(
        x, router, bias, weights)

"""Exponential moving average of the weights, kept and blended in host memory while the
device trains.

``ema_t = decay * ema_{t-1} + (1 - decay) * params_t``, starting from ``ema_0 = params_0``
(DeepSeek-V3 keeps such an EMA in CPU memory, updated asynchronously after each step, to
estimate the model after learning-rate decay without a second training run).

Why it works this way. A blend on the device (the EMA brought over, blended, sent back)
moves two parameter copies over the host link on the device's own queue: on an H100 that
was 269 ms for `small`'s 6.83 GiB, longer than a step (docs/memory.md). Here the device only
copies parameters out, and a transfer to pinned host memory runs on the GPU's copy engine
under the next step's compute (a 243 ms synthetic step ran 243 ms with 1.9 GB leaving under
it each step, at 52 GB/s: docs/performance.md, Host EMA, session 57). The blend runs on the
host.

- The parameters are cut into ``every`` byte-balanced groups (``snapshot_groups``): whole
  leaves, and a stacked leaf's rows along axis 0 where that axis is not sharded. Step t
  snapshots group ``(t - 1) % every`` with a device copy (the copy is the only device
  memory the EMA takes, a ``1/every`` share of the parameters, freed once it reached the
  host; the train step donates the parameters, so they cannot be read in place) and
  ``jax.device_put`` sends it to ``pinned_host`` memory.
- The copy is ``(1 - decay**every)`` times the rows, and a host thread adds it to
  ``decay**every`` times the EMA, one numpy array per distinct shard of each piece: each
  weight blends once every ``every`` steps with the same half-life in steps as a blend on
  every step. A step whose ``finite`` flag is False leaves its group unchanged.
- ``update`` waits for the previous group's copy to reach the host (it left under the
  step dispatched since), so one copy at a time is on the device, and while two groups
  wait for the thread: where the host blends slower than the device steps, the step time
  shows it. On an H100 machine (16 host cores), 8 groups of `small` hid under a batch-64
  step (405.1 vs 405.3 ms) and nearly under a batch-4 one (51.8 vs 50.4 ms); 4 groups
  outran the host's blend at batch 4 (106 ms).
- Each group's copy is its own jitted program, compiled on the group's first update: the
  first ``every`` steps of a run each pay one small compile (about 40 ms on that machine).
- Before the EMA is read (a checkpoint, an evaluation) ``arrays`` waits for the thread and
  assembles global arrays with the sharding asked for (by default the parameters' own in
  ``pinned_host`` memory, which the Orbax checkpoint saves and restores).

A backend without ``pinned_host`` memory (see ``has_host_memory``) gets the same EMA in host
RAM; the thread then reads each snapshot from the device itself, a slower, pageable copy,
and up to four groups' copies wait on the device meanwhile (the budget counts one). A
parameter replicated over several local devices is copied out by each of them (each over
its own link) and blended once.
XLA:CPU exposes ``pinned_host`` in the same RAM, so there the placement is exercised and
saves nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HOST_MEMORY = "pinned_host"
# Elements a host thread blends at a time: 2^20 was the fastest of 2^16-2^22 on the H100
# machine's 16 cores (docs/performance.md, Host EMA, session 57).
BLEND_SLICE = 1 << 20


def has_host_memory(device: jax.Device) -> bool:
    """Whether ``device`` can address pinned host memory."""
    return any(m.kind == HOST_MEMORY for m in device.addressable_memories())


def host_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` in pinned host memory where all of its devices have it, else itself."""
    if all(has_host_memory(d) for d in sharding.device_set):
        return sharding.with_memory_kind(HOST_MEMORY)
    return sharding


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Part of a parameter leaf one snapshot copies: ``rows`` [start, stop) along axis 0
    of a stacked leaf, or None for the whole leaf."""

    leaf: int
    rows: tuple[int, int] | None = None

    def shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this piece of a leaf of ``leaf_shape``."""
        if self.rows is None:
            return tuple(leaf_shape)
        return (self.rows[1] - self.rows[0], *leaf_shape[1:])


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _device_bytes(piece: Piece, leaves: list[Any], shardings: list[Any]) -> int:
    """Bytes of ``piece`` that one device holds (its leaf's per-device shard)."""
    leaf = leaves[piece.leaf]
    return _nbytes(shardings[piece.leaf].shard_shape(piece.shape(leaf.shape)), leaf.dtype)


def snapshot_groups(abstract_params: Any, shardings: Any, every: int) -> list[list[Piece]]:
    """The parameter leaves (flattened order) cut into ``every`` groups of near-equal bytes
    per device.

    A leaf larger than half a group's share is cut into row ranges along axis 0 where that
    axis is not sharded (the stacked layers' and experts' weights), so the largest group
    stays near ``1/every`` of the parameters (`small` at 8: 0.13 of its 6.83 GiB). Groups
    are filled largest piece first, each into the lightest group so far.
    """
    leaves = jax.tree.leaves(abstract_params)
    sharding_leaves = jax.tree.leaves(shardings)
    sizes = [_device_bytes(Piece(i), leaves, sharding_leaves) for i in range(len(leaves))]
    target = max(1, sum(sizes) // (2 * every)) if every > 1 else sum(sizes) + 1  # 1: no cuts
    pieces: list[Piece] = []
    for i, (leaf, sharding, size) in enumerate(zip(leaves, sharding_leaves, sizes,
                                                   strict=True)):
        rows = leaf.shape[0] if leaf.shape else 1
        splittable = bool(leaf.shape) and sharding.shard_shape(leaf.shape)[0] == rows
        parts = min(rows, -(-size // target)) if splittable else 1
        bounds = [round(k * rows / parts) for k in range(parts + 1)]
        pieces += ([Piece(i)] if parts <= 1 else
                   [Piece(i, (start, stop)) for start, stop in zip(bounds, bounds[1:])])
    groups: list[list[Piece]] = [[] for _ in range(every)]
    loads = [0] * every
    for size, piece in sorted(((_device_bytes(p, leaves, sharding_leaves), p) for p in pieces),
                              key=lambda sp: (-sp[0], sp[1])):
        lightest = loads.index(min(loads))
        groups[lightest].append(piece)
        loads[lightest] += size
    return [sorted(g) for g in groups]


def largest_snapshot_bytes(abstract_params: Any, shardings: Any, every: int) -> int:
    """Per-device bytes of the largest snapshot group: the device memory an EMA update
    holds while its copy leaves for the host (the memory budget's term)."""
    leaves = jax.tree.leaves(abstract_params)
    sharding_leaves = jax.tree.leaves(shardings)
    return max(sum(_device_bytes(p, leaves, sharding_leaves) for p in group)
               for group in snapshot_groups(abstract_params, shardings, every))


def _rows(x: Any, piece: Piece) -> Any:
    """The piece's rows of its leaf ``x`` (a numpy or jax array)."""
    return x[piece.rows[0]:piece.rows[1]] if piece.rows else x


def _shard_key(index: tuple[slice, ...], shape: tuple[int, ...], piece: Piece) -> tuple:
    """A hashable key for the shard at ``index`` of an array of ``shape`` (a piece's, or its
    whole leaf's); a row piece drops axis 0, which such a piece never shards."""
    bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    return bounds[1:] if piece.rows is not None else bounds


def _blend_into(ema: np.ndarray, scaled: np.ndarray, decay: float,
                pool: concurrent.futures.Executor) -> None:
    """``ema <- decay * ema + scaled`` in place, where the device already made
    ``scaled = (1 - decay) * params``: two passes where blending the parameters themselves
    without a temporary takes three (1.26x on a 2-core CPU, `.devrun/s57_blend2.py`), in
    slices over the pool's threads."""
    e, q = ema.reshape(-1), np.asarray(scaled, ema.dtype).reshape(-1)
    d = np.asarray(decay, ema.dtype)

    def blend(lo: int) -> None:
        s = slice(lo, lo + BLEND_SLICE)
        np.multiply(e[s], d, out=e[s])
        np.add(e[s], q[s], out=e[s])

    list(pool.map(blend, range(0, e.size, BLEND_SLICE)))


@dataclasses.dataclass(frozen=True)
class _Group:
    """One snapshot group: its pieces, the leaves they come from, where the copies go, and
    the jitted device copy."""

    pieces: list[Piece]
    leaves: list[int]  # sorted leaf indices the copy reads
    to_host: list[jax.sharding.Sharding]  # per piece
    copy: Any  # jitted: the leaves -> (1 - decay) * each piece, laid out like its leaf


class HostEMA:
    """The EMA in host memory and the thread that blends into it.

    It holds state on purpose: the EMA is a host-side accumulator that a thread updates
    while the device trains. Use it as a context manager, or call ``close``. A failed blend
    is raised by the next ``update``, ``wait`` or ``arrays``.
    """

    def __init__(self, decay: float, param_shardings: Any, every: int = 1) -> None:
        """``param_shardings``: the tree of device ``NamedSharding``s of the parameters;
        ``every``: the number of snapshot groups, i.e. the steps between two blends of a
        weight, each with ``decay**every``."""
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay {decay!r}: must be in (0, 1)")
        if every < 1:
            raise ValueError(f"EMA every={every!r}: must be a positive number of steps")
        self.blend_decay = decay ** every  # what one blend keeps of a group's EMA
        self.every = every
        self.shardings = param_shardings
        self.host_shardings = jax.tree.map(host_sharding, param_shardings)
        self._sharding_leaves = jax.tree.leaves(param_shardings)
        self._treedef = jax.tree.structure(param_shardings)
        self._groups: list[_Group] = []
        self._leaf_shapes: list[tuple[int, ...]] = []
        self._leaf_pieces: list[list[Piece]] = []  # per leaf, in row order
        self._host: dict[Piece, dict[tuple, np.ndarray]] = {}
        self._leaving: list[jax.Array] = []  # the last group's copies on their way to the host
        self._pool = concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1))
        self._jobs: queue.Queue[tuple | None] = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._closed = False
        # time `update` waited for the thread (two groups already queued): what a host that
        # blends slower than the device steps costs the run
        self.backlog_seconds = 0.0
        # Started by the first update: a run that fails before training leaves no thread.
        self._thread = threading.Thread(target=self._work, name="host-ema", daemon=True)

    def __enter__(self) -> HostEMA:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def groups(self) -> list[list[Piece]]:
        """The snapshot groups' pieces: step t sends group ``(t - 1) % every``."""
        return [g.pieces for g in self._groups]

    def start(self, params: Any) -> None:
        """``ema_0 = params_0``: a host copy of the parameters."""
        self.load(params)

    def load(self, arrays: Any) -> None:
        """Takes the EMA from global arrays of the parameters' shapes (a checkpoint's, or
        the parameters themselves), whatever their layout."""
        self.wait()
        leaves = jax.tree.leaves(jax.device_put(arrays, self.host_shardings))
        self._leaf_shapes = [x.shape for x in leaves]
        self._groups = [self._group(pieces)
                        for pieces in snapshot_groups(leaves, self._sharding_leaves, self.every)]
        self._leaf_pieces = [[] for _ in leaves]
        for piece in sorted(p for g in self._groups for p in g.pieces):
            self._leaf_pieces[piece.leaf].append(piece)
        self._host = {p: {} for g in self._groups for p in g.pieces}
        for i, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                data = None  # each distinct shard leaves the device once
                for piece in self._leaf_pieces[i]:
                    key = _shard_key(shard.index, leaf.shape, piece)
                    if key not in self._host[piece]:
                        data = np.asarray(shard.data) if data is None else data
                        self._host[piece][key] = np.array(_rows(data, piece))

    def update(self, step: int, params: Any, finite: jax.Array | bool = True) -> None:
        """After train step ``step`` (1-based): sends its group to the host and queues the
        blend. Waits for the previous group's copy to reach the host, and while two groups
        wait for the blending thread."""
        self._raise_error()
        if self._closed:
            raise RuntimeError("host EMA: update() after close()")
        if not self._groups:
            raise RuntimeError("host EMA: update() before start() or load()")
        group = self._groups[(step - 1) % self.every]
        if not group.pieces:
            return
        # The last group's device copy is freed once it reached the host: waiting for that
        # here (it left under the step dispatched before this call) keeps one copy at a time
        # on the device, where a host running steps ahead would otherwise pile them up.
        jax.block_until_ready(self._leaving)
        leaves = jax.tree.leaves(params)
        copies = jax.device_put(group.copy([leaves[i] for i in group.leaves]), group.to_host)
        self._leaving = copies
        if not self._thread.is_alive():
            self._thread.start()
        queued = time.perf_counter()
        self._jobs.put((group.pieces, copies, finite))
        self.backlog_seconds += time.perf_counter() - queued

    def wait(self) -> None:
        """Returns once every queued blend is done; raises if one failed."""
        self._jobs.join()
        self._raise_error()

    def arrays(self, shardings: Any = None) -> Any:
        """The EMA as global arrays laid out by ``shardings`` (default: the parameters' own
        in pinned host memory, as a checkpoint keeps them). They are copies: later blends
        do not change them."""
        self.wait()
        leaves = [jax.make_array_from_callback(shape, sharding,
                                               lambda index, i=i: self._leaf_block(i, index))
                  for i, (shape, sharding) in enumerate(zip(
                      self._leaf_shapes, jax.tree.leaves(shardings or self.host_shardings)))]
        return jax.tree.unflatten(self._treedef, leaves)

    def abstract(self, abstract_params: Any) -> Any:
        """ShapeDtypeStructs as ``arrays()`` lays them out (an Orbax restore target)."""
        return jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
                            abstract_params, self.host_shardings)

    def close(self) -> None:
        """Finishes the queued blends and stops the thread (idempotent; a failed blend is
        not raised here, so closing never hides the error that ended a run)."""
        self._closed = True
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._pool.shutdown()

    def _group(self, pieces: list[Piece]) -> _Group:
        """A group's leaves, host shardings and jitted device copy (scaled by
        ``1 - blend_decay``, which saves the host a pass)."""
        used = sorted({p.leaf for p in pieces})
        weight = 1 - self.blend_decay

        def copy(leaves: list[jax.Array]) -> list[jax.Array]:
            by_leaf = dict(zip(used, leaves))
            return [_rows(by_leaf[p.leaf], p) * jnp.asarray(weight, by_leaf[p.leaf].dtype)
                    for p in pieces]

        shardings = [self._sharding_leaves[p.leaf] for p in pieces]
        return _Group(pieces, used, [host_sharding(s) for s in shardings],
                      jax.jit(copy, out_shardings=shardings))

    def _leaf_block(self, leaf: int, index: tuple[slice, ...]) -> np.ndarray:
        """A copy of the EMA of leaf ``leaf`` at a device's shard ``index``."""
        shape = self._leaf_shapes[leaf]
        blocks = [self._host[p][_shard_key(index, shape, p)] for p in self._leaf_pieces[leaf]]
        return np.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0].copy()

    def _work(self) -> None:
        """The blending thread: takes queued groups until ``close`` queues None."""
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:
                    self._blend(*job)
            except BaseException as error:  # noqa: BLE001 - surfaced by wait/update
                self._error = error
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _blend(self, pieces: list[Piece], copies: list[jax.Array], finite: Any) -> None:
        """Blends one group's host copies into the EMA, each distinct shard once."""
        if not bool(finite):  # waits for the step; a skipped step leaves the EMA as it is
            return
        for piece, copy in zip(pieces, copies):
            blocks = self._host[piece]
            done = set()
            for shard in copy.addressable_shards:
                key = _shard_key(shard.index, copy.shape, piece)
                if key not in done:
                    done.add(key)
                    _blend_into(blocks[key], np.asarray(shard.data), self.blend_decay,
                                self._pool)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("host EMA: a blend failed on the host thread") from self._error

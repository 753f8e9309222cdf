"""Which rows of the stacked layers each pipeline rank holds during a step, and the fetch
that brings them from where the train state stores them.

Storage (the train state, its optimizer state and checkpoints) keeps the model tree,
whatever the schedule, with each stacked-layer array (``dense_blocks``, ``moe_blocks``)
padded to a multiple of ``pipe`` rows (``storage.pad_stacks``), so its layer axis splits
over ``pipe`` in equal contiguous blocks (the sharding rule ``layers -> pipe``). The
embedding, head, final norm and MTP modules are whole on every rank (stage 0 and the last
stage both read the embedding; DualPipe and DualPipeV put both on rank 0).

Compute: rank r holds the rows of the stages it runs, stage after stage in slot order, so
a stage reads contiguous local rows at the offset :attr:`ParamPlacement.offsets` gives.
GPipe and 1F1B hold each layer once, DualPipeV once (rank i: stages i and 2P-1-i), DualPipe
twice (rank i: stages i and P-1-i, one per direction): :meth:`ParamPlacement.copies`.

The fetch runs inside the executor's ``shard_map`` (manual over the mesh): for each
stack, P rounds of one ``ppermute`` each (round d: every rank sends rank r+d the rows
that rank needs from its block; padded to the round's largest count, the padding's
places lie past the held rows and are dropped). The step takes ``jax.vjp`` of the fetch,
so the gradients of the held rows flow back along the same rounds reversed and are summed
where they are stored: DualPipe's two copies of a stage add up there with no extra
collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.parallel.pipeline.schedule import Schedule
from moejax.parallel.pipeline.stages import StagePlan
from moejax.parallel.pipeline.storage import map_leaves, stack_lengths, stored_length
from moejax.parallel.sharding import PIPE_AXIS, STACKED


def sum_over_pipe(x: Any) -> Any:
    """``psum`` of the tree ``x`` over ``pipe`` (call in the executor's shard_map)."""
    return jax.lax.psum(x, PIPE_AXIS)


def _padded(rows: Sequence[Sequence[int]], fill: np.ndarray) -> np.ndarray:
    """``rows`` as one array, each padded with the tail of ``fill`` (one row's width)."""
    out = np.tile(np.asarray(fill, np.int32), (len(rows), 1))
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@dataclasses.dataclass(frozen=True)
class StackPlacement:
    """One stacked-layer array: ``held[r]`` = global rows rank r holds, in local order."""

    length: int  # rows stored (a multiple of ``ranks``)
    ranks: int
    held: tuple[tuple[int, ...], ...]

    @property
    def local_length(self) -> int:
        return max(1, *(len(rows) for rows in self.held))

    def rounds(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(d, sends, places)`` per round that moves rows; ``sends[s]`` = rows of sender
        s's block bound for rank s+d, ``places[r]`` = where the rows from rank r-d land in
        r's local layout. A padded place is ``local_length`` or more, distinct from every
        other place of its row: the fetch drops it and its indices stay unique."""
        block = self.length // self.ranks
        out = []
        for d in range(self.ranks):
            sends = [[] for _ in range(self.ranks)]
            places = [[] for _ in range(self.ranks)]
            for r in range(self.ranks):
                sender = (r - d) % self.ranks
                for pos, row in enumerate(self.held[r]):
                    if row // block == sender:
                        sends[sender].append(row - sender * block)
                        places[r].append(pos)
            width = max(map(len, places))
            if width:
                out.append((d, _padded(sends, np.zeros(width)),
                            _padded(places, self.local_length + np.arange(width))))
        return out

    def fetch(self, stored: jax.Array, rank: jax.Array) -> jax.Array:
        """This rank's rows (``local_length``, ...) from its stored block (call in shard_map).

        The places are unique, so the scatter's derivative is a plain scatter (and its
        transpose a gather). Without that promise JAX differentiates the scatter by
        scattering u32 ids of every update and keeps id and mask arrays of the held
        stacks' shape until the step's end: on a DualPipe rank, which holds every layer,
        XLA's peak grew by about two held copies of the parameters (the budget read 19-33%
        under it, session 44)."""
        local = jnp.zeros((self.local_length, *stored.shape[1:]), stored.dtype)
        for d, sends, places in self.rounds():
            rows = stored[jnp.asarray(sends)[rank]]
            if d:
                rows = jax.lax.ppermute(rows, PIPE_AXIS,
                                        [(s, (s + d) % self.ranks) for s in range(self.ranks)])
            local = local.at[jnp.asarray(places)[rank]].set(rows, mode="drop",
                                                             unique_indices=True)
        return local


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """Every stack's placement, and each stage's local row offsets on its rank."""

    stacks: dict[str, StackPlacement]  # by top-level attribute (only stacks that exist)
    offsets: np.ndarray  # (P, S, 2) int32: local index of the stage's first dense / MoE row

    @classmethod
    def build(cls, plan: StagePlan, schedule: Schedule) -> "ParamPlacement":
        ranks = schedule.num_ranks
        lengths = stack_lengths(plan.config)
        held = {name: [[] for _ in range(ranks)] for name in lengths}
        offsets = np.zeros((ranks, plan.num_stages, 2), np.int32)
        for r in range(ranks):
            stages = sorted({(slot, stage) for leg in schedule.placement
                             for stage, (rank, slot) in enumerate(leg) if rank == r})
            for _, stage in stages:
                shape = plan.shape(stage)
                starts = plan.offsets(stage)
                for i, (name, count) in enumerate((("dense_blocks", shape.dense),
                                                   ("moe_blocks", shape.moe))):
                    offsets[r, stage, i] = len(held[name][r])
                    held[name][r].extend(range(starts[i], starts[i] + count))
        stacks = {name: StackPlacement(stored_length(lengths[name], ranks), ranks,
                                       tuple(map(tuple, held[name])))
                  for name in lengths if lengths[name]}
        return cls(stacks, offsets)

    def copies(self) -> float:
        """Layer rows held over all ranks during a step, per layer of the model."""
        held = [row for s in self.stacks.values() for rows in s.held for row in rows]
        layers = sum(len({row for rows in s.held for row in rows})
                     for s in self.stacks.values())
        return len(held) / layers

    def _stack_of(self, path: tuple) -> StackPlacement | None:
        return self.stacks.get(path[0]) if path and path[0] in STACKED else None

    def check_stored(self, params: nnx.State) -> None:
        """Raises ValueError for a stack not stored as ``storage.pad_stacks`` lays it out
        (its layer axis then would not split over ``pipe`` in equal blocks)."""
        for path, variable in nnx.to_flat_state(params):
            stack = self._stack_of(path)
            if stack is not None and variable.shape[0] != stack.length:
                raise ValueError(
                    f"{'.'.join(map(str, path))}: stored with {variable.shape[0]} layer rows, "
                    f"the pipeline over pipe={stack.ranks} wants {stack.length} (the stack "
                    f"padded to a multiple of pipe): pass storage.pad_stacks(params, config, "
                    f"{stack.ranks})")

    def fetch(self, params: nnx.State, rank: jax.Array) -> nnx.State:
        """The parameters this rank computes with: stacks cut to its rows, the rest as is."""
        def local(path: tuple, value: jax.Array) -> jax.Array:
            stack = self._stack_of(path)
            return value if stack is None else stack.fetch(value, rank)
        return map_leaves(params, local)

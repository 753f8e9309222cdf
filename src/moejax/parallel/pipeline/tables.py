"""A schedule as the static per-tick tables an SPMD executor indexes by rank, with the
entries of its activation and gradient buffers allocated ahead of time.

Every op takes one lock-step tick (``tick_grid``); data sent in tick t is usable in tick
t+1. A rank keeps two buffers: stage *inputs* (read by the stage's F, and again by its B,
which recomputes the forward from them) and gradients w.r.t. stage *outputs* (read by the
B). An entry is taken when its data arrives at the end of a tick and given back by the B
that reads it last, so a buffer holds what the schedule has in flight on that rank, not
every micro-batch: :attr:`TickTables.act_entries` is that count per rank. Entries are
handed out smallest-free-first, so a later arrival reuses an entry a B freed in the same
tick (the tick's reads happen before its arrivals land).

A first stage embeds tokens and a last stage seeds its gradient from the loss: they read
no buffer, and their tables point at entry 0, whose value the stage ignores.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.parallel.pipeline.schedule import Kind, Schedule, ScheduleError
from moejax.parallel.pipeline.simulate import tick_grid

ACT_SOURCES = ("act_left", "act_right", "act_local")
GRAD_SOURCES = ("grad_left", "grad_right", "grad_local")


@dataclasses.dataclass(frozen=True)
class TickTables:
    """``rows``: int32 arrays ``[ticks, P, ...]``:

    - ``f``: (on, stage, act entry, micro-batch) of the rank's F chunk this tick;
    - ``b``: (on, stage, act entry, grad entry, micro-batch) of its B chunk;
    - ``act_*``/``grad_*``: (on, entry) of the buffer entry that an arrival at the end of
      the tick fills, by source (left neighbour, right neighbour, same rank).

    ``act_entries``/``grad_entries``: per rank, the most entries its buffer holds at once.
    """

    rows: dict[str, np.ndarray]
    act_entries: tuple[int, ...]
    grad_entries: tuple[int, ...]

    @property
    def num_ticks(self) -> int:
        return len(self.rows["f"])

    @property
    def buffer_sizes(self) -> tuple[int, int]:
        """Entries of the (act, grad) buffers every rank allocates (the largest rank's)."""
        return max(1, *self.act_entries), max(1, *self.grad_entries)


class _Pool:
    """One rank's buffer: keys to entries, smallest free entry first; ``size`` = peak."""

    def __init__(self) -> None:
        self.where: dict[tuple[int, int], int] = {}
        self.size = 0

    def take(self, key: tuple[int, int]) -> int:
        used = set(self.where.values())
        entry = next(e for e in range(self.size + 1) if e not in used)
        self.where[key] = entry
        self.size = max(self.size, entry + 1)
        return entry

    def find(self, key: tuple[int, int]) -> int:
        return self.where[key]

    def give_back(self, key: tuple[int, int]) -> int:
        return self.where.pop(key)


def tick_tables(schedule: Schedule) -> TickTables:
    """The tables of ``schedule``; raises ScheduleError if it sends beyond a neighbour."""
    grid = tick_grid(schedule)
    ticks, ranks = len(grid), schedule.num_ranks
    rows = {"f": np.zeros((ticks, ranks, 4), np.int32),
            "b": np.zeros((ticks, ranks, 5), np.int32),
            **{k: np.zeros((ticks, ranks, 2), np.int32) for k in ACT_SOURCES + GRAD_SOURCES}}
    acts = [_Pool() for _ in range(ranks)]
    grads = [_Pool() for _ in range(ranks)]
    last = schedule.num_stages - 1

    for t, row in enumerate(grid):
        sends = []  # (kind, sender, stage it feeds, direction, micro-batch)
        for r, op in enumerate(row):
            for c in op.chunks if op is not None else ():
                key = (schedule.slot_of(c.stage, c.direction), c.mb)
                if c.kind is Kind.F:
                    entry = acts[r].find(key) if c.stage > 0 else 0
                    rows["f"][t, r] = (1, c.stage, entry, c.mb)
                    if c.stage < last:
                        sends.append(("act", r, c.stage + 1, c.direction, c.mb))
                elif c.kind is Kind.B:
                    act = acts[r].give_back(key) if c.stage > 0 else 0
                    grad = grads[r].give_back(key) if c.stage < last else 0
                    rows["b"][t, r] = (1, c.stage, act, grad, c.mb)
                    if c.stage > 0:
                        sends.append(("grad", r, c.stage - 1, c.direction, c.mb))
        for kind, src, stage, direction, mb in sends:
            dest = schedule.rank_of(stage, direction)
            source = {src: "local", src + 1: "left", src - 1: "right"}.get(dest)
            if source is None:
                raise ScheduleError("schedule", f"schedule={schedule.name!r}: rank {src} sends "
                                    f"to rank {dest}; the executor moves data between "
                                    "neighbours only")
            arrival = rows[f"{kind}_{source}"][t, dest]
            if arrival[0]:
                raise ScheduleError("schedule", f"schedule={schedule.name!r}: two {kind} "
                                    f"arrivals at rank {dest} from one source in tick {t}")
            pool = (acts if kind == "act" else grads)[dest]
            arrival[:] = (1, pool.take((schedule.slot_of(stage, direction), mb)))
    return TickTables(rows, tuple(p.size for p in acts), tuple(p.size for p in grads))

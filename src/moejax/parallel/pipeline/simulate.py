"""Discrete-event simulation of a schedule: when each op runs, given what ops cost.

Each rank runs its ops in order; an op starts once its rank is free and every chunk's
inputs exist: F(m, s) needs F(m, s-1); B(m, s) needs F(m, s) and B(m, s+1); W needs
its B. Data from another rank arrives ``comm`` after its producer ends. Bubbles and
in-flight activations are read off the resulting timeline, never assumed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from moejax.parallel.pipeline.schedule import Chunk, Kind, Op, Schedule, ScheduleError


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-chunk times in the DualPipe paper's terms.

    ``b`` is a full backward; a B that defers its weight gradients costs ``b - w`` and its
    W costs ``w``. ``fb`` is an overlapped F&B pair (None: no overlap gain, ``f + b``).
    """

    f: float = 1.0
    b: float = 2.0
    w: float = 1.0
    fb: float | None = None
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm"):
            if getattr(self, name) < 0:
                raise ScheduleError(name, f"{name}={getattr(self, name)!r}: a cost must be >= 0")
        if self.w > self.b:
            raise ScheduleError("w", f"w={self.w!r}: W is part of B, so w <= b={self.b!r}")
        if self.fb is not None and self.fb < 0:
            raise ScheduleError("fb", f"fb={self.fb!r}: a cost must be >= 0")

    @property
    def f_and_b(self) -> float:
        return self.f + self.b if self.fb is None else self.fb

    def of(self, op: Op) -> float:
        if op.kind == "FB":
            return self.f_and_b
        (c,) = op.chunks
        if c.kind is Kind.F:
            return self.f
        if c.kind is Kind.W:
            return self.w
        return self.b - self.w if c.defer_w else self.b


@dataclasses.dataclass(frozen=True)
class Span:
    op: Op
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Each rank's ops with start and end times; the step ends when the last rank ends."""

    schedule: Schedule
    spans: tuple[tuple[Span, ...], ...]

    @property
    def makespan(self) -> float:
        return max((s.end for rank in self.spans for s in rank), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans[rank])

    def bubble(self, rank: int) -> float:
        """Idle time of ``rank`` within the step."""
        return self.makespan - self.busy(rank)

    def bubble_fraction(self, rank: int) -> float:
        return self.bubble(rank) / self.makespan if self.makespan else 0.0

    def peak_activations(self) -> tuple[int, ...]:
        """Per rank, the most stage activations held at once.

        An F's activation is held from its start until its last backward piece ends (B,
        or W when B deferred it: W still reads the saved inputs). In an F&B pair both are
        live together, so F's allocation counts before B's release.
        """
        peaks = []
        for rank in self.spans:
            held = peak = 0
            for span in rank:
                for c in span.op.chunks:
                    if c.kind is Kind.F:
                        held += 1
                        peak = max(peak, held)
                    elif c.kind is Kind.W or not c.defer_w:
                        held -= 1
            peaks.append(peak)
        return tuple(peaks)


def _key(c: Chunk) -> tuple[Kind, int, int, int]:
    return (c.kind, c.mb, c.stage, c.direction)


def _needs(c: Chunk, last_stage: int) -> list[tuple[Kind, int, int, int]]:
    if c.kind is Kind.F:
        return [(Kind.F, c.mb, c.stage - 1, c.direction)] if c.stage > 0 else []
    if c.kind is Kind.W:
        return [(Kind.B, c.mb, c.stage, c.direction)]
    needs = [(Kind.F, c.mb, c.stage, c.direction)]
    if c.stage < last_stage:
        needs.append((Kind.B, c.mb, c.stage + 1, c.direction))
    return needs


def simulate(
    schedule: Schedule, op_cost: Callable[[Op], float], comm: float = 0.0
) -> Timeline:
    """Run every op as early as its rank and its inputs allow.

    Raises ScheduleError if the op orders deadlock (an op waits on one that can never run).
    """
    last_stage = schedule.num_stages - 1
    done: dict[tuple[Kind, int, int, int], tuple[float, int]] = {}  # key -> (end, rank)
    spans: list[list[Span]] = [[] for _ in schedule.ops]
    free_at = [0.0] * schedule.num_ranks
    remaining = sum(len(ops) for ops in schedule.ops)
    while remaining:
        progressed = False
        for rank, ops in enumerate(schedule.ops):
            while len(spans[rank]) < len(ops):
                op = ops[len(spans[rank])]
                needs = [n for c in op.chunks for n in _needs(c, last_stage)]
                if any(n not in done for n in needs):
                    break
                ready = [done[n][0] + (comm if done[n][1] != rank else 0.0) for n in needs]
                start = max([free_at[rank], *ready])
                free_at[rank] = start + op_cost(op)
                spans[rank].append(Span(op, start, free_at[rank]))
                for c in op.chunks:
                    done[_key(c)] = (free_at[rank], rank)
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: ops[len(spans[r])].chunks for r, ops in enumerate(schedule.ops)
                     if len(spans[r]) < len(ops)}
            raise ScheduleError("schedule", f"schedule={schedule.name!r}: deadlock, ranks wait "
                                            f"at {stuck}")
    return Timeline(schedule, tuple(tuple(s) for s in spans))


def run(schedule: Schedule, costs: Costs) -> Timeline:
    """The timeline under the paper's per-chunk costs."""
    return simulate(schedule, costs.of, costs.comm)


def tick_grid(schedule: Schedule) -> tuple[tuple[Op | None, ...], ...]:
    """``grid[tick][rank]``: the op each rank runs at each lock-step tick, or None.

    Every op takes one tick and data sent at the end of tick t is usable at tick t+1:
    the shape an SPMD executor needs (all ranks run one op, then exchange sends).
    """
    timeline = simulate(schedule, lambda op: 1.0)
    grid: list[list[Op | None]] = [
        [None] * schedule.num_ranks for _ in range(int(timeline.makespan))
    ]
    for rank, spans in enumerate(timeline.spans):
        for span in spans:
            grid[int(span.start)][rank] = span.op
    return tuple(tuple(row) for row in grid)

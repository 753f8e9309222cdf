"""ASCII rendering of a simulated timeline, one row per rank, time to the right.

Labels: ``F3`` forward of micro-batch 3, ``B3`` full backward, ``b3`` backward for
inputs only (its weight grads come later as ``W3``), ``F3B1`` F of 3 overlapped with B
of 1. A chunk of the rank's second stage (DualPipe: direction 1; DualPipeV: the V's
return leg) is marked ``'`` (``F3'B1``: F3 on that stage, B1 on the first). Idle is ``.``.
"""

from __future__ import annotations

from moejax.parallel.pipeline.schedule import Chunk, Kind, Op, Schedule
from moejax.parallel.pipeline.simulate import Timeline


def _second_leg(schedule: Schedule, c: Chunk) -> bool:
    """True for direction 1 (DualPipe) or the second stage a rank holds (DualPipeV)."""
    return schedule.slot_of(c.stage, c.direction) == 1


def chunk_label(schedule: Schedule, c: Chunk) -> str:
    kind = "b" if c.kind is Kind.B and c.defer_w else c.kind.value
    mark = "'" if _second_leg(schedule, c) else ""
    return f"{kind}{c.mb}{mark}"


def op_label(schedule: Schedule, op: Op) -> str:
    return "".join(chunk_label(schedule, c) for c in op.chunks)


def render(timeline: Timeline, chars_per_unit: int = 4) -> str:
    """Each op fills its [start, end) columns: its label, then ``-`` to its end."""
    schedule = timeline.schedule
    width = round(timeline.makespan * chars_per_unit)
    rows = []
    for rank, spans in enumerate(timeline.spans):
        row = ["."] * width
        for span in spans:
            lo, hi = round(span.start * chars_per_unit), round(span.end * chars_per_unit)
            text = op_label(schedule, span.op).ljust(hi - lo, "-")[: hi - lo]
            row[lo:hi] = text
        rows.append(f"rank {rank:<2d}|{''.join(row)}|")
    return "\n".join(rows)

"""Pipeline schedules as data: per rank, the ordered ops an executor runs.

A schedule fixes *what* each pipeline rank computes and in which order, never *when*:
the executor (jit + shard_map over the mesh) walks each rank's op list, and
:mod:`.simulate` derives times, bubbles and memory from the same lists.

Vocabulary (DualPipe paper): a *stage* is a contiguous slice of layers; a micro-batch
goes forward (F) through stages 0..S-1 and backward (B) through S-1..0. A B may defer its
weight gradients to a later W chunk (zero-bubble split) to fill bubbles. DualPipe runs two
*directions*: direction 0 enters at rank 0, direction 1 at rank P-1, each through its own
copy of the S stages (hence 2x parameters). DualPipeV folds 2P stages into a V instead.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, NoReturn


class ScheduleError(ValueError):
    """A schedule parameter breaks a rule; the message names parameter, value and rule, and
    ``parameter`` the parameter (a caller names its own field for it)."""

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


def _fail(name: str, value: object, rule: str) -> NoReturn:
    raise ScheduleError(name, f"{name}={value!r}: {rule}")


class Kind(str, enum.Enum):
    F = "F"  # forward of one stage for one micro-batch
    B = "B"  # backward: input gradients, plus weight gradients unless deferred to a W
    W = "W"  # the weight gradients a deferring B left behind


class Tensor(str, enum.Enum):
    ACT = "act"  # a stage's output activation, sent to the next stage
    GRAD = "grad"  # the gradient w.r.t. a stage's input, sent to the previous stage


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stage's work for one micro-batch."""

    kind: Kind
    mb: int
    stage: int
    direction: int = 0
    defer_w: bool = False  # B only: compute input grads now, weight grads in a later W

    def __post_init__(self) -> None:
        if self.defer_w and self.kind is not Kind.B:
            _fail("defer_w", self.defer_w, f"only a B chunk may defer W, not {self.kind.value}")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A tensor between two ranks, keyed by the chunk that consumes it.

    A send on one rank and the matching receive on ``peer`` carry equal
    ``(tensor, mb, stage, direction)``, so an executor can pair them by key.
    """

    tensor: Tensor
    peer: int
    mb: int
    stage: int  # the consuming stage
    direction: int


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a rank: a chunk, or an F and a B run overlapped (F&B)."""

    chunks: tuple[Chunk, ...]  # (c,) or (F, B)
    recvs: tuple[Transfer, ...] = ()  # must have arrived before the op starts
    sends: tuple[Transfer, ...] = ()  # issued when the op ends

    @property
    def kind(self) -> str:
        """'F', 'B', 'W' or 'FB' (overlapped pair)."""
        return "".join(c.kind.value for c in self.chunks)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-rank op lists plus the placement and memory bound they promise.

    ``placement[direction][stage] == (rank, slot)``: the rank holding that stage's
    parameters, and which of the rank's local parameter slots (0 or 1) they occupy.
    ``activation_bounds[rank]`` is the stated peak of stage activations held at once
    (F done, last backward piece not done), in units of one micro-batch through one stage.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    num_stages: int
    placement: tuple[tuple[tuple[int, int], ...], ...]
    activation_bounds: tuple[int, ...]
    ops: tuple[tuple[Op, ...], ...]

    @property
    def num_directions(self) -> int:
        return len(self.placement)

    @property
    def param_copies(self) -> int:
        """Copies of the model's weights across the pipe: one per direction."""
        return len(self.placement)

    def rank_of(self, stage: int, direction: int = 0) -> int:
        return self.placement[direction][stage][0]

    def slot_of(self, stage: int, direction: int = 0) -> int:
        return self.placement[direction][stage][1]


# --- validation -------------------------------------------------------------------------


def _check_counts(name: str, num_ranks: int, num_microbatches: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        _fail("num_ranks", num_ranks, f"{name} needs an integer P >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        _fail("num_microbatches", num_microbatches, f"{name} needs an integer M >= 1")


# --- communication ----------------------------------------------------------------------


def _with_comm(
    chunk_ops: list[list[tuple[Chunk, ...]]],
    placement: tuple[tuple[tuple[int, int], ...], ...],
) -> tuple[tuple[Op, ...], ...]:
    """Attach to each op the neighbour transfers its chunks need and produce."""
    last = len(placement[0]) - 1

    def rank(stage: int, direction: int) -> int:
        return placement[direction][stage][0]

    def transfers(c: Chunk, me: int) -> tuple[list[Transfer], list[Transfer]]:
        if c.kind is Kind.W:
            return [], []
        fwd = c.kind is Kind.F
        tensor = Tensor.ACT if fwd else Tensor.GRAD
        src, dst = (c.stage - 1, c.stage + 1) if fwd else (c.stage + 1, c.stage - 1)
        recvs, sends = [], []
        if 0 <= src <= last and rank(src, c.direction) != me:
            recvs.append(Transfer(tensor, rank(src, c.direction), c.mb, c.stage, c.direction))
        if 0 <= dst <= last and rank(dst, c.direction) != me:
            sends.append(Transfer(tensor, rank(dst, c.direction), c.mb, dst, c.direction))
        return recvs, sends

    out = []
    for me, ops in enumerate(chunk_ops):
        rank_ops = []
        for chunks in ops:
            recvs, sends = [], []
            for c in chunks:
                r, s = transfers(c, me)
                recvs += r
                sends += s
            rank_ops.append(Op(chunks, tuple(recvs), tuple(sends)))
        out.append(tuple(rank_ops))
    return tuple(out)


# --- GPipe and 1F1B ---------------------------------------------------------------------


def _linear_placement(num_ranks: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    return (tuple((r, 0) for r in range(num_ranks)),)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards: M activations in flight on every rank."""
    _check_counts("GPipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ops = [
        [(Chunk(Kind.F, i, r),) for i in range(m)] + [(Chunk(Kind.B, i, r),) for i in range(m)]
        for r in range(p)
    ]
    placement = _linear_placement(p)
    return Schedule("gpipe", p, m, p, placement, (m,) * p, _with_comm(ops, placement))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Rank r warms up with P-1-r forwards, then alternates F and B, then drains Bs.

    This caps rank r at min(P - r, M) activations in flight.
    """
    _check_counts("1F1B", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ops = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        rank_ops = [(Chunk(Kind.F, i, r),) for i in range(warm)]
        for i in range(m - warm):
            rank_ops += [(Chunk(Kind.F, warm + i, r),), (Chunk(Kind.B, i, r),)]
        rank_ops += [(Chunk(Kind.B, i, r),) for i in range(m - warm, m)]
        ops.append(rank_ops)
    placement = _linear_placement(p)
    bounds = tuple(min(p - r, m) for r in range(p))
    return Schedule("1f1b", p, m, p, placement, bounds, _with_comm(ops, placement))


# --- DualPipe and DualPipeV -------------------------------------------------------------
#
# Both run the same 8-step order per rank, written in *phases*: phase 0 is the rank's
# stage nearer its micro-batches' entry, phase 1 the other one. With n "half ranks",
# h = the rank's distance from the nearest end of the pipe, k micro-batches per entry:
#   1 warm-up F0s           2 (F0 F1) pairs         3 B1 W1 F1 (B1 defers W)
#   4 steady (F0&B1)(F1&B0)  5 B1 (F1&B0)            6 B1 B0 (the later half defer W)
#   7 W B0 (B0 defers W)     8 drain the deferred Ws (FIFO)
# DualPipe: n = P/2, k = M/2, phases map to the two directions. DualPipeV ("cut in
# half"): n = P, k = M, phases map to the two legs of the V.

@dataclasses.dataclass(frozen=True)
class _Step:
    """A chunk before numbering: which kind on which phase (a W pops the oldest deferral)."""

    kind: Kind
    phase: int = 0
    defer_w: bool = False


def _dual_steps(n: int, h: int, k: int) -> list[tuple[_Step, ...]]:
    f0, f1, w = _Step(Kind.F, 0), _Step(Kind.F, 1), _Step(Kind.W)

    def b(phase: int, defer_w: bool = False) -> _Step:
        return _Step(Kind.B, phase, defer_w)

    ops: list[tuple[_Step, ...]] = [(f0,)] * (2 * (n - h - 1))  # 1
    ops += [(f0,), (f1,)] * (h + 1)  # 2
    ops += [(b(1, True),), (w,), (f1,)] * (n - h - 1)  # 3
    for i in range(k - 2 * n + h + 1):  # 4
        if i == 0 and h == n - 1:
            ops += [(f0,), (b(1),)]  # the middle ranks: not overlapped, shrinks the bubble
        else:
            ops.append((f0, b(1)))
        ops.append((f1, b(0)))
    ops += [(b(1),), (f1, b(0))] * (n - h - 1)  # 5
    half = (h + 1) // 2
    for i in range(h + 1):  # 6
        ops.append((b(1, i > half or (i == half and h % 2 == 1)),))
        ops.append((b(0, i >= half),))
    ops += [(w,), (b(0, True),)] * (n - h - 1)  # 7
    ops += [(w,)] * (h + 1)  # 8
    return ops


def _number(
    steps: list[tuple[_Step, ...]], legs: tuple[tuple[int, int, int], ...]
) -> list[tuple[Chunk, ...]]:
    """Give each phase's Fs and Bs consecutive micro-batches and each W its B.

    ``legs[phase] = (stage, direction, first micro-batch)``; W pairs FIFO with deferrals.
    """
    next_mb = {(kind, phase): legs[phase][2] for kind in (Kind.F, Kind.B) for phase in (0, 1)}
    pending_w: list[Chunk] = []
    out = []
    for op in steps:
        chunks = []
        for step in op:
            if step.kind is Kind.W:
                b = pending_w.pop(0)
                chunks.append(Chunk(Kind.W, b.mb, b.stage, b.direction))
                continue
            stage, direction, _ = legs[step.phase]
            c = Chunk(step.kind, next_mb[step.kind, step.phase], stage, direction, step.defer_w)
            next_mb[step.kind, step.phase] += 1
            if c.defer_w:
                pending_w.append(c)
            chunks.append(c)
        out.append(tuple(chunks))
    assert not pending_w, "step 8 drains every deferred W"
    return out


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """Bidirectional: rank r holds stage r (slot 0, direction 0's copy) and stage P-1-r
    (slot 1, direction 1's copy); M/2 micro-batches enter from each end (direction 0:
    ids 0..M/2-1 at rank 0; direction 1: ids M/2..M-1 at rank P-1)."""
    _check_counts("DualPipe", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if p % 2:
        _fail("num_ranks", p, "DualPipe needs an even P (each rank pairs stage i with P-1-i)")
    if m % 2 or m < 2 * p:
        _fail("num_microbatches", m,
              f"DualPipe needs an even M >= 2P = {2 * p} (M/2 enter from each end)")
    k = m // 2
    # direction 0: stage s on rank s; direction 1 enters at rank P-1: stage s on rank P-1-s.
    placement = (tuple((s, 0) for s in range(p)), tuple((p - 1 - s, 1) for s in range(p)))
    ops = []
    for r in range(p):
        entered_first = int(r >= p // 2)  # the direction whose entry is nearer rank r
        legs = tuple((r if d == 0 else p - 1 - r, d, d * k)
                     for d in (entered_first, 1 - entered_first))
        ops.append(_number(_dual_steps(p // 2, min(r, p - 1 - r), k), legs))
    return Schedule("dualpipe", p, m, p, placement, (p + 1,) * p, _with_comm(ops, placement))


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe cut in half: 2P stages in a V, rank r holds stages r and 2P-1-r; all M
    micro-batches enter at rank 0 and leave there. One copy of the parameters."""
    _check_counts("DualPipeV", num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        _fail("num_microbatches", m, f"DualPipeV needs M >= 2P = {2 * p}")
    placement = (tuple((s, 0) if s < p else (2 * p - 1 - s, 1) for s in range(2 * p)),)
    ops = [_number(_dual_steps(p, r, m), ((r, 0, 0), (2 * p - 1 - r, 0, 0))) for r in range(p)]
    return Schedule("dualpipev", p, m, 2 * p, placement, (2 * p + 1,) * p,
                    _with_comm(ops, placement))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "dualpipe": dualpipe,
    "dualpipev": dualpipe_v,
}


def build(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The named schedule for P ranks and M micro-batches; validates all three."""
    if name not in SCHEDULES:
        _fail("name", name, f"unknown schedule; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_ranks, num_microbatches)

"""Pipeline schedules: op orders, completeness, dependencies, memory bounds, bubbles.

External oracles: the DualPipeV op order transcribed from the figure in
github.com/deepseek-ai/DualPipe (README, 4 ranks, 10 micro-batches), and the DualPipe
paper's bubble and activation formulas.
"""

from __future__ import annotations

import collections
import itertools

import pytest

from moejax.parallel.pipeline import (
    SCHEDULES,
    Costs,
    Kind,
    ScheduleError,
    Tensor,
    build,
    run,
    tick_grid,
)
from moejax.parallel.pipeline.formulas import paper_activations, paper_bubble
from moejax.parallel.pipeline.timeline import op_label, render
from experiments import pipeline_study

RANKS = (2, 4, 8)


def _cases():
    for name, p in itertools.product(SCHEDULES, RANKS):
        for m in sorted({2 * p, 2 * p + 2, 3 * p + (3 * p) % 2}):
            yield name, p, m
    for name in ("gpipe", "1f1b"):
        for p, m in ((1, 1), (1, 3), (3, 1), (3, 2), (4, 3), (8, 5)):
            yield name, p, m


CASES = list(_cases())


def _key(c):
    return (c.mb, c.stage, c.direction)


# --- op orders --------------------------------------------------------------------------

# Transcribed from images/dualpipev.png of deepseek-ai/DualPipe: ' marks the V's return leg
# (stage 2P-1-r), b an input-only backward whose W comes later.
DUALPIPEV_4x10_FIGURE = (
    "F0 F1 F2 F3 F4 F5 F6 F0' b0' W0' F1' b1' W1' F2' b2' W2' F3' F7B3' F4'B0 F8B4' F5'B1 "
    "F9B5' F6'B2 B6' F7'B3 B7' F8'B4 B8' F9'B5 B9' b6 W6 b7 W7 b8 W8 b9 W9",
    "F0 F1 F2 F3 F4 F0' F5 F1' b0' W0' F2' b1' W1' F3' F6B2' F4'B0 F7B3' F5'B1 F8B4' F6'B2 "
    "F9B5' F7'B3 B6' F8'B4 B7' F9'B5 B8' B6 b9' b7 W9' b8 W7 b9 W8 W9",
    "F0 F1 F2 F0' F3 F1' F4 F2' b0' W0' F3' F5B1' F4'B0 F6B2' F5'B1 F7B3' F6'B2 F8B4' F7'B3 "
    "F9B5' F8'B4 B6' F9'B5 B7' B6 B8' b7 b9' b8 W7 b9 W9' W8 W9",
    "F0 F0' F1 F1' F2 F2' F3 F3' F4 B0' F4'B0 F5B1' F5'B1 F6B2' F6'B2 F7B3' F7'B3 F8B4' "
    "F8'B4 F9B5' F9'B5 B6' B6 B7' B7 b8' b8 b9' b9 W8' W8 W9' W9",
)


def test_dualpipev_matches_the_reference_figure():
    s = build("dualpipev", 4, 10)
    got = tuple(" ".join(op_label(s, op) for op in ops) for ops in s.ops)
    assert got == DUALPIPEV_4x10_FIGURE


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16), (8, 20)])
def test_dualpipe_is_mirror_symmetric_and_cuts_in_half_to_dualpipev(p, m):
    """Rank P-1-r runs rank r's order with directions swapped, and the first half of
    DualPipe's ranks run DualPipeV's order on P/2 ranks ("cut in half")."""
    dual, v = build("dualpipe", p, m), build("dualpipev", p // 2, m // 2)

    def shape(s, rank):  # (kind, defer_w, second leg?, mb index within its leg) per chunk
        chunks = [c for op in s.ops[rank] for c in op.chunks]
        entry = s.slot_of(chunks[0].stage, chunks[0].direction)
        base = {}
        for c in chunks:
            base.setdefault(s.slot_of(c.stage, c.direction), c.mb)

        def norm(c):
            slot = s.slot_of(c.stage, c.direction)
            return (c.kind, c.defer_w, slot != entry, c.mb - base[slot])

        return [tuple(map(norm, op.chunks)) for op in s.ops[rank]]

    for r in range(p // 2):
        assert shape(dual, r) == shape(dual, p - 1 - r)
        assert shape(dual, r) == shape(v, r)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 3), (3, 6), (8, 16)])
def test_gpipe_and_1f1b_orders(p, m):
    for r, ops in enumerate(build("gpipe", p, m).ops):
        assert [op.kind for op in ops] == ["F"] * m + ["B"] * m
    for r, ops in enumerate(build("1f1b", p, m).ops):
        warm = min(p - 1 - r, m)
        kinds = "".join(op.kind for op in ops)
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm
        for kind in "FB":
            assert [op.chunks[0].mb for op in ops if op.kind == kind] == list(range(m))


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,m,needle", [
    ("gpipe", 0, 4, "num_ranks=0"),
    ("1f1b", 4, 0, "num_microbatches=0"),
    ("dualpipe", 3, 6, "num_ranks=3: DualPipe needs an even P"),
    ("dualpipe", 4, 9, "num_microbatches=9: DualPipe needs an even M >= 2P = 8"),
    ("dualpipe", 4, 6, "num_microbatches=6: DualPipe needs an even M >= 2P = 8"),
    ("dualpipev", 4, 7, "num_microbatches=7: DualPipeV needs M >= 2P = 8"),
    ("zb1p", 4, 8, "name='zb1p': unknown schedule"),
])
def test_bad_parameters_name_value_and_rule(name, p, m, needle):
    with pytest.raises(ScheduleError, match=needle) as err:
        build(name, p, m)
    assert isinstance(err.value, ValueError)


def test_costs_are_validated():
    with pytest.raises(ScheduleError, match="w=3: W is part of B"):
        Costs(f=1, b=2, w=3)
    with pytest.raises(ScheduleError, match="comm=-1"):
        Costs(comm=-1)


# --- completeness, placement, transfers -------------------------------------------------


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_microbatch_gets_one_f_and_b_per_stage_on_its_rank(name, p, m):
    s = build(name, p, m)
    seen = collections.Counter()
    for rank, ops in enumerate(s.ops):
        for op in ops:
            assert op.kind in ("F", "B", "W", "FB")
            for c in op.chunks:
                assert s.rank_of(c.stage, c.direction) == rank
                seen[(c.kind, *_key(c))] += 1
    per_direction = m // s.num_directions
    expected = {
        (mb, stage, d)
        for d in range(s.num_directions)
        for mb in range(d * per_direction, (d + 1) * per_direction)
        for stage in range(s.num_stages)
    }
    for kind in (Kind.F, Kind.B):
        assert {k[1:] for k in seen if k[0] is kind} == expected
    deferred = {_key(c) for ops in s.ops for op in ops for c in op.chunks if c.defer_w}
    assert {k[1:] for k in seen if k[0] is Kind.W} == deferred
    assert set(seen.values()) == {1}


@pytest.mark.parametrize("name,p,m", CASES)
def test_same_rank_order_and_matching_neighbour_transfers(name, p, m):
    s = build(name, p, m)
    sends, recvs = collections.Counter(), collections.Counter()
    for rank, ops in enumerate(s.ops):
        position = {}
        for i, op in enumerate(ops):
            for c in op.chunks:
                position[(c.kind, *_key(c))] = i
        for (kind, *key), i in position.items():  # F before its B before its W
            if kind is Kind.B:
                assert position[(Kind.F, *key)] < i
            if kind is Kind.W:
                assert position[(Kind.B, *key)] < i
        for op in ops:
            for t in op.sends:
                assert abs(t.peer - rank) == 1
                sends[(rank, t.peer, t.tensor, t.mb, t.stage, t.direction)] += 1
            for t in op.recvs:
                assert abs(t.peer - rank) == 1 and s.rank_of(t.stage, t.direction) == rank
                recvs[(t.peer, rank, t.tensor, t.mb, t.stage, t.direction)] += 1
            for t in op.recvs:  # an F consumes an activation, a B a gradient
                consumers = {c.kind for c in op.chunks if _key(c) == _key(t)}
                assert consumers == {Kind.F if t.tensor is Tensor.ACT else Kind.B}
    assert sends == recvs and set(sends.values()) <= {1}
    hops = sum(s.rank_of(st, d) != s.rank_of(st + 1, d)
               for d in range(s.num_directions) for st in range(s.num_stages - 1))
    assert len(sends) == 2 * hops * m // s.num_directions


# --- simulated timelines: dependencies, memory, bubbles ---------------------------------


def _assert_dependencies_hold(s, spans_by_rank, gap=0.0):
    """F(m,s) after F(m,s-1); B(m,s) after F(m,s) and B(m,s+1); W after its B."""
    when = {}
    for rank, spans in enumerate(spans_by_rank):
        for start, end, op in spans:
            for c in op.chunks:
                when[(c.kind, *_key(c))] = (start, end, rank)

    def after(kind, mb, stage, d, start, rank):
        if (kind, mb, stage, d) in when:
            _, end, other = when[(kind, mb, stage, d)]
            assert start >= end + (gap if other != rank else 0.0)

    for (kind, mb, stage, d), (start, _, rank) in when.items():
        if kind is Kind.F:
            after(Kind.F, mb, stage - 1, d, start, rank)
        elif kind is Kind.B:
            after(Kind.F, mb, stage, d, start, rank)
            after(Kind.B, mb, stage + 1, d, start, rank)
        else:
            after(Kind.B, mb, stage, d, start, rank)


@pytest.mark.parametrize("name,p,m", CASES)
def test_timeline_respects_dependencies_and_memory_bound(name, p, m):
    s = build(name, p, m)
    costs = Costs(f=1.0, b=2.5, w=1.0, fb=3.0, comm=0.25)
    t = run(s, costs)
    spans = [[(x.start, x.end, x.op) for x in rank] for rank in t.spans]
    _assert_dependencies_hold(s, spans, gap=costs.comm)
    for rank, rank_spans in enumerate(spans):
        assert [op for _, _, op in rank_spans] == list(s.ops[rank])
        assert all(a[1] <= b[0] for a, b in zip(rank_spans, rank_spans[1:]))
    peaks = t.peak_activations()
    assert all(peak <= bound for peak, bound in zip(peaks, s.activation_bounds))
    assert max(peaks) == max(s.activation_bounds)  # the stated bound is reached
    if m >= p:
        assert max(peaks) == paper_activations(name, p, m)


@pytest.mark.parametrize("name,p,m", CASES)
def test_tick_grid_runs_each_op_once_in_order_after_its_inputs(name, p, m):
    s = build(name, p, m)
    grid = tick_grid(s)
    spans = [[(t, t + 1, row[r]) for t, row in enumerate(grid) if row[r] is not None]
             for r in range(p)]
    assert [[op for _, _, op in rank] for rank in spans] == [list(ops) for ops in s.ops]
    _assert_dependencies_hold(s, spans)


@pytest.mark.parametrize("name,p,m", [c for c in CASES if c[0] in ("gpipe", "1f1b")])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_linear_schedules_bubble_is_textbook(name, p, m, f, b):
    t = run(build(name, p, m), Costs(f=f, b=b, w=0.0))
    expected = paper_bubble(name, p, Costs(f=f, b=b, w=0.0))
    assert expected == (p - 1) * (f + b)
    assert [t.bubble(r) for r in range(p)] == pytest.approx([expected] * p)


DUAL_CASES = [c for c in CASES if c[0] in ("dualpipe", "dualpipev")]


@pytest.mark.parametrize("name,p,m", DUAL_CASES)
@pytest.mark.parametrize("f,w", [(1.0, 1.0), (2.0, 1.0), (1.0, 0.0), (2.0, 2.0)])
def test_dualpipe_bubble_matches_paper(name, p, m, f, w):
    """The paper's regime: B's input part costs F (b = f + w), W <= F. Without overlap
    gain (F&B = F+B) every rank idles exactly the formula; with F&B between max(F, B) and
    F+B the formula is the worst rank's idle time."""
    b = f + w
    for fb in (f + b, (max(f, b) + f + b) / 2, max(f, b)):
        costs = Costs(f=f, b=b, w=w, fb=fb)
        t = run(build(name, p, m), costs)
        bubbles = [t.bubble(r) for r in range(p)]
        expected = paper_bubble(name, p, costs)
        assert max(bubbles) == pytest.approx(expected)
        if fb == f + b:
            assert bubbles == pytest.approx([expected] * p)


def test_deadlocked_order_is_reported():
    s = build("1f1b", 2, 2)
    swapped = (s.ops[0], tuple(reversed(s.ops[1])))
    broken = type(s)(s.name, s.num_ranks, s.num_microbatches, s.num_stages, s.placement,
                     s.activation_bounds, swapped)
    with pytest.raises(ScheduleError, match="deadlock"):
        run(broken, Costs())


# --- rendering and the study ------------------------------------------------------------


def test_render_draws_one_row_per_rank_of_equal_width():
    s = build("dualpipe", 4, 8)
    rows = render(run(s, Costs(fb=3.0))).splitlines()
    assert len(rows) == 4 and len({len(r) for r in rows}) == 1
    assert rows[0].startswith("rank 0 |F0") and "F3B5'" in rows[0]


@pytest.mark.parametrize("args, message", [
    (["--schedules", "1f1b,foo"], "--schedules 1f1b,foo: unknown ['foo']; choose from"),
    (["--ranks", "0"], "--ranks 0: must be >= 1"),
    (["--microbatches", "0"], "--microbatches 0: must be >= 1"),
])
def test_study_refuses_a_bad_flag_by_name_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit):
        pipeline_study.main(args)
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out


def test_study_prints_every_schedule_without_fake_measurements(capsys):
    pipeline_study.main(["--ranks", "4", "--microbatches", "8", "--show-timeline"])
    out = capsys.readouterr().out
    for name in ("gpipe", "1f1b", "zb1p", "dualpipe", "dualpipev"):
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert out.count("pending") >= 4 and "rank 3 |" in out
    pipeline_study.main(["--ranks", "4", "--microbatches", "6"])
    assert "not built: num_microbatches=6" in capsys.readouterr().out

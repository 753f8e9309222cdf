"""Bubbles, parameter copies and activation memory per pipeline schedule.

    python -m experiments.pipeline_study [--ranks 4] [--microbatches 8] [--f 1 --b 2 --w 1
        --fb 3 --comm 0] [--show-timeline]

The "derived" bubble comes from simulating each schedule's op lists under the given
per-chunk costs; the "paper" column evaluates the DualPipe paper's formula with the same
costs. The "measured" column is filled by the pipeline executor from per-tick timings;
until it exists the column reads "pending" rather than a number.
"""

from __future__ import annotations

import argparse

from moejax.parallel.pipeline import Costs, ScheduleError, build, run
from moejax.parallel.pipeline.formulas import (
    PAPER,
    num_stages,
    paper_activations,
    paper_bubble,
)
from moejax.parallel.pipeline.timeline import render

HEADER = (
    f"{'schedule':<10} {'PP':>3} {'bubble':>7} {'paper':>7} {'formula':<19} "
    f"{'frac':>6} {'measured':>9} {'copies':>6} {'p/dev':>5} {'peak act/rank':<26} paper act"
)


def _row(name: str, ranks: int, microbatches: int, costs: Costs) -> tuple[str, str | None]:
    """One table line (and the rendered timeline) for a schedule; errors become the line."""
    paper = PAPER[name]
    formula = paper_bubble(name, ranks, costs)
    stages = num_stages(name, ranks)
    head = f"{name:<10} {stages:>3}"
    act_paper = f"{paper.activations_text}={paper_activations(name, ranks, microbatches)}"
    if name not in ("gpipe", "1f1b", "dualpipe", "dualpipev"):
        return (f"{head} {'-':>7} {formula:>7.2f} {paper.bubble_text:<19} {'-':>6} {'-':>9} "
                f"{'-':>6} {paper.params_per_device:>5} {'(formula only)':<26} {act_paper}"), None
    try:
        schedule = build(name, ranks, microbatches)
    except ScheduleError as err:
        return f"{head}  not built: {err}", None
    timeline = run(schedule, costs)
    bubble = max(timeline.bubble(r) for r in range(ranks))
    frac = max(timeline.bubble_fraction(r) for r in range(ranks))
    peaks = ",".join(map(str, timeline.peak_activations()))
    line = (f"{head} {bubble:>7.2f} {formula:>7.2f} {paper.bubble_text:<19} {frac:>6.1%} "
            f"{'pending':>9} {schedule.param_copies:>5}x {paper.params_per_device:>5} "
            f"{peaks:<26} {act_paper}")
    return line, render(timeline)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks P")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches M")
    parser.add_argument("--f", type=float, default=1.0, help="forward chunk time")
    parser.add_argument("--b", type=float, default=2.0, help="full backward chunk time")
    parser.add_argument("--w", type=float, default=1.0, help="weight-grad part of B")
    parser.add_argument("--fb", type=float, default=None,
                        help="overlapped F&B pair time (default F+B)")
    parser.add_argument("--comm", type=float, default=0.0, help="p2p latency between ranks")
    parser.add_argument("--show-timeline", action="store_true",
                        help="draw each schedule's simulated timeline")
    args = parser.parse_args(argv)
    costs = Costs(args.f, args.b, args.w, args.fb, args.comm)

    print(f"P={args.ranks} ranks, M={args.microbatches} micro-batches; costs F={costs.f:g} "
          f"B={costs.b:g} W={costs.w:g} F&B={costs.f_and_b:g} comm={costs.comm:g}")
    print("bubble: idle time of the worst rank per step (derived from the simulated "
          "timeline); paper: the formula at these costs; frac: bubble / step time")
    print("measured: from per-tick timings of the executor (pending: not built yet); "
          "copies: model weight copies across the pipe; p/dev: the paper's parameters per "
          "device; peak act: stage activations held at once, per rank\n")
    print(HEADER)
    timelines = []
    for name in PAPER:
        line, drawing = _row(name, args.ranks, args.microbatches, costs)
        print(line)
        if drawing is not None:
            timelines.append((name, drawing))
    print("\nPP = stages. DualPipeV's stages hold half the layers of the others' (PP = 2P), "
          "so its F, B, W and activations are half-size; the paper's p/dev "
          "(2x) counts its two half-size stages per rank, with one model copy.")
    if args.show_timeline:
        print("\nF3 forward, B3 backward, b3 input-grad backward (W3 later), F3B1 overlapped "
              "pair, ' chunk of the rank's second stage (direction 1 / V's return leg), . idle")
        for name, drawing in timelines:
            print(f"\n{name}\n{drawing}")


if __name__ == "__main__":
    main()

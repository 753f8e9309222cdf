"""Bubbles, parameter copies and activation memory per pipeline schedule.

    python -m experiments.pipeline_study [--ranks 4] [--microbatches 8] [--f 1 --b 2 --w 1
        --fb 3 --comm 0] [--show-timeline]
        [--measure [--preset tiny --layers 8 --batch 16 --seq 32 --mesh pipe=4,data=2]
         [--profile DIR]]
    python -m experiments.pipeline_study --fb-pair --mesh expert=2 [--transport padded]
        [--profile DIR]

The "derived" bubble comes from simulating each schedule's op lists under the given
per-chunk costs; the "paper" column evaluates the DualPipe paper's formula with the same
costs. With ``--measure`` the executor runs each schedule on the devices present (CPU: 8
simulated devices) and the "measured" column is the worst rank's share of per-tick wall
time spent in ticks where it runs no F or B; a second table gives the whole jitted step's
median time. ``--fb-pair`` times one F&B pair of two micro-batches through the model's MoE
blocks, the forward of one interleaved piece by piece with the backward of the other
(``moejax.parallel.pipeline.fb_pair``), in each order (free, lockstep, sequential: one
chunk after the other; ``--transport`` picks the exchange); with ``--profile`` the busy,
compute and exposed communication times come from the trace. It turns on
XLA:GPU's latency-hiding scheduler unless XLA_FLAGS already sets it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import TYPE_CHECKING

from experiments import cli
from moejax.config import get_model_preset
from moejax.parallel.pipeline import SCHEDULES, Costs, ScheduleError, build, run
from moejax.parallel.pipeline.formulas import (
    PAPER,
    num_stages,
    paper_activations,
    paper_bubble,
)
from moejax.parallel.pipeline.timeline import render

if TYPE_CHECKING:  # imports jax, which starts after _use_simulated_devices
    from moejax.parallel.mesh import MeshSpec

HEADER = (
    f"{'schedule':<10} {'PP':>3} {'bubble':>7} {'paper':>7} {'formula':<19} "
    f"{'frac':>6} {'measured':>9} {'copies':>6} {'p/dev':>5} {'peak act/rank':<26} paper act"
)


def _row(name: str, ranks: int, microbatches: int, costs: Costs,
         measured: dict[str, float] | None = None) -> tuple[str, str | None]:
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
            f"{_measured_cell(name, measured):>9} {schedule.param_copies:>5}x "
            f"{paper.params_per_device:>5} {peaks:<26} {act_paper}")
    return line, render(timeline)


def _measured_cell(name: str, measured: dict[str, float] | None) -> str:
    if measured is None:
        return "pending"  # not measured in this run (--measure)
    return f"{measured[name]:.1%}" if name in measured else "not run"


def _use_simulated_devices(count: int) -> None:
    """On a host without accelerators, let XLA:CPU expose ``count`` devices (must run
    before jax initialises; a GPU backend ignores it)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


def _check_batch(parser: argparse.ArgumentParser, batch: int, microbatches: int,
                 mesh: MeshSpec) -> None:
    """--batch splits into ``microbatches`` that each split evenly over the batch axes
    (data, expert): refused here, as the executor's reshapes fail on it with a
    ZeroDivisionError or a sharding error."""
    shards = mesh.data * mesh.expert
    if batch % (microbatches * shards):
        parser.error(f"--batch {batch}: must be a multiple of {microbatches * shards} "
                     f"({microbatches} micro-batch(es) x the {shards} data x expert devices "
                     f"of --mesh {mesh})")


def _measure(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, float]:
    """Runs the executor for every schedule the builder accepts; prints step times."""
    # jax starts here, after _use_simulated_devices
    from moejax.parallel.mesh import MeshSpec
    from moejax.parallel.pipeline.measure import make_problem, measure_schedule

    mesh = cli.checked(parser, lambda: MeshSpec.parse(args.mesh or f"pipe={args.ranks}"))
    if mesh.pipe != args.ranks:
        parser.error(f"--mesh {args.mesh}: its pipe axis must equal --ranks {args.ranks}")
    _check_batch(parser, args.batch, args.microbatches, mesh)
    layers = 2 * args.ranks if args.layers is None else args.layers
    problem = make_problem(args.preset, layers, args.batch, args.seq, args.dtype)
    pairs = "whole stages" if args.stage_pairs else "MoE pieces where an expert axis has any"
    print(f"executor on {mesh} ({args.preset}, {problem.config.num_hidden_layers} layers, "
          f"batch {args.batch} x seq {args.seq}, {args.dtype}; F&B ticks pair {pairs})")
    print(f"{'schedule':<10} {'step ms':>9} {'ticks':>5} {'sum ticks ms':>12} "
          f"{'bubble/rank (measured)':<30} {'layers held/rank':<17} {'act buf/rank':<13} "
          f"{'peak GiB/rank':<14} {'exp. a2a':>8} loss")
    bubbles = {}
    for name in args.schedules.split(","):
        try:
            build(name, args.ranks, args.microbatches)
        except ScheduleError:
            continue
        profile = pathlib.Path(args.profile) if args.profile else None
        m = measure_schedule(problem, name, mesh, args.microbatches, args.repeats, profile,
                             pair_pieces=not args.stage_pairs)
        bubbles[name] = max(m.bubble_fraction)
        per_rank = ",".join(f"{b:.1%}" for b in m.bubble_fraction)
        held = ",".join(map(str, m.layers_held))
        buffers = ",".join(map(str, m.act_entries))
        peak = ("-" if m.peak_bytes is None else
                ",".join(f"{b / 2**30:.2f}" for b in m.peak_bytes))
        exposed = ("-" if m.exposed_all_to_all is None else
                   f"{max(m.exposed_all_to_all):.1%}")
        print(f"{name:<10} {m.step_s * 1e3:>9.2f} {len(m.tick_s):>5} "
              f"{sum(m.tick_s) * 1e3:>12.2f} {per_rank:<30} {held:<17} {buffers:<13} "
              f"{peak:<14} {exposed:>8} {m.loss:.5f}")
    print(f"layers held: rows of the stacked layers a rank's stages hold during the step "
          f"(of {problem.config.num_hidden_layers}); act buf: stage inputs its buffer "
          "holds at once (the executor's allocation); peak: the device allocator's peak since "
          "the process began (one schedule per process for a per-schedule figure; - where "
          "the backend keeps none); exp. a2a: with --profile, the worst device's all_to_all "
          "time with no compute beside it, as a share of the traced step\n")
    return bubbles


def _use_latency_hiding_scheduler() -> None:
    """XLA:GPU's latency-hiding scheduler places async all_to_alls under independent
    compute, which the F&B pair provides (must run before jax initialises; XLA:CPU ignores
    it)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_latency_hiding_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_latency_hiding_scheduler=true"


def _fb_pair(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    # jax starts here, after _use_simulated_devices and _use_latency_hiding_scheduler
    from moejax.parallel.expert import ExpertParallelOptions, expert_parallel_options
    from moejax.parallel.mesh import MeshSpec
    from moejax.parallel.pipeline.measure import fb_pair, make_problem

    mesh = cli.checked(parser, lambda: MeshSpec.parse(args.mesh or "expert=2"))
    if mesh.pipe != 1:
        parser.error(f"--fb-pair --mesh {args.mesh}: runs without a pipe axis")
    _check_batch(parser, args.batch, 1, mesh)  # --batch is per micro-batch here
    options = cli.checked(parser, lambda: ExpertParallelOptions(transport=args.transport),
                          "--transport")
    layers = 4 if args.layers is None else args.layers
    problem = make_problem(args.preset, layers, 2 * args.batch, args.seq, args.dtype)
    with expert_parallel_options(options):
        results = fb_pair(problem, mesh, args.repeats,
                          pathlib.Path(args.profile) if args.profile else None)
    print(f"F&B pair on {mesh} ({args.preset}, forward and backward of "
          f"{problem.config.num_moe_layers} MoE block(s), two micro-batches of {args.batch} x "
          f"{args.seq}, {args.dtype}, {options.resolved_transport()} transport)")
    print(f"{'order':<11} {'ms':>8} {'vs sequential':>13} {'busy ms':>8} {'compute ms':>10} "
          f"{'exposed comm ms':>15} {'exposed / busy':>14}")
    base = results["sequential"].wall_s
    for order, r in results.items():
        trace = ("" if r.busy_ms is None else
                 f"{r.busy_ms:>8.2f} {r.compute_ms:>10.2f} {r.exposed_comm_ms:>15.3f} "
                 f"{r.exposed_comm_ms / r.busy_ms:>14.1%}")
        print(f"{order:<11} {r.wall_s * 1e3:>8.2f} {base / r.wall_s:>12.3f}x {trace}")
    print("free: forward and backward pieces interleaved in program order, no barriers; "
          "lockstep: the same with barriers between steps; sequential: the backward after "
          "the forward. Trace columns per pair (--profile).")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="pipeline ranks P")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches M")
    cost = cli.number(0)
    parser.add_argument("--f", type=cost, default=1.0, help="forward chunk time")
    parser.add_argument("--b", type=cost, default=2.0, help="full backward chunk time")
    parser.add_argument("--w", type=cost, default=1.0, help="weight-grad part of B")
    parser.add_argument("--fb", type=cost, default=None,
                        help="overlapped F&B pair time (default F+B)")
    parser.add_argument("--comm", type=cost, default=0.0, help="p2p latency between ranks")
    parser.add_argument("--show-timeline", action="store_true",
                        help="draw each schedule's simulated timeline")
    parser.add_argument("--measure", action="store_true",
                        help="run the executor per schedule: measured bubble and step time")
    parser.add_argument("--fb-pair", action="store_true",
                        help="time one F&B pair interleaved vs sequential (no pipe axis)")
    parser.add_argument("--stage-pairs", action="store_true",
                        help="--measure: F&B ticks run whole stage functions side by side "
                        "instead of MoE pieces (PipelineExecutor.pair_pieces=False)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="--measure only these (comma-separated)")
    parser.add_argument("--mesh", default="", help="devices for --measure (default "
                        "pipe=RANKS) or --fb-pair (default expert=2)")
    parser.add_argument("--preset", default="tiny", help="model preset to run")
    parser.add_argument("--layers", type=cli.integer(1),
                        help="num_hidden_layers (default 2 x ranks; --fb-pair: 4)")
    parser.add_argument("--batch", type=cli.integer(1), default=16, help="sequences per step "
                        "(--fb-pair: per micro-batch)")
    parser.add_argument("--seq", type=cli.integer(1), default=32, help="sequence length")
    parser.add_argument("--dtype", type=cli.float_dtype, default="float32",
                        help="compute dtype")
    parser.add_argument("--repeats", type=cli.integer(1), default=5,
                        help="timed runs (median)")
    parser.add_argument("--profile", help="write jax.profiler traces under this folder")
    parser.add_argument("--transport", default="auto", help="--fb-pair: token exchange "
                        "(auto: ragged on GPU, padded on CPU; ragged; padded)")
    args = parser.parse_args(argv)
    for flag in ("ranks", "microbatches"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if unknown := sorted(set(args.schedules.split(",")) - set(SCHEDULES)):
        parser.error(f"--schedules {args.schedules}: unknown {unknown}; choose from "
                     f"{sorted(SCHEDULES)}")
    try:
        costs = Costs(args.f, args.b, args.w, args.fb, args.comm)
    except ScheduleError as err:
        parser.error(f"--{err.parameter}: {err}")
    if args.measure or args.fb_pair:
        cli.checked(parser, lambda: get_model_preset(args.preset), "--preset")
        _use_simulated_devices(8)
    if args.fb_pair:
        _use_latency_hiding_scheduler()
        cli.checked(parser, lambda: _fb_pair(args, parser))
        return
    # the config checks the executor meets (a mesh for other devices, too few layers)
    measured = cli.checked(parser, lambda: _measure(args, parser)) if args.measure else None

    print(f"P={args.ranks} ranks, M={args.microbatches} micro-batches; costs F={costs.f:g} "
          f"B={costs.b:g} W={costs.w:g} F&B={costs.f_and_b:g} comm={costs.comm:g}")
    print("bubble: idle time of the worst rank per step (derived from the simulated "
          "timeline); paper: the formula at these costs; frac: bubble / step time")
    print("measured: the worst rank's share of per-tick time in ticks without an F or B "
          "(pending: pass --measure); "
          "copies: model weight copies across the pipe; p/dev: the paper's parameters per "
          "device; peak act: stage activations held at once, per rank\n")
    print(HEADER)
    timelines = []
    for name in PAPER:
        line, drawing = _row(name, args.ranks, args.microbatches, costs, measured)
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

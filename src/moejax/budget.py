"""Will it fit? ``python -m moejax.budget --preset NAME --mesh ... [--set ...]``.

Prints the per-device memory budget of one training step (``moejax.memory.budget``) as a
table with a fits / does-not-fit verdict. ``--validate`` also compiles the real step at the
same micro-batch (on ``--mesh``, sharded, where this host has its devices: simulated CPU
devices do) and prints XLA's ``memory_analysis()`` beside the estimate.
Bad input: one line on stderr, exit status 2; a budget that does not fit: exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from moejax.config import ConfigError
from moejax.memory.budget import (GIB, at_micro_batch, check_compilable_here, compiled_peak,
                                  compiled_peak_on_mesh, estimate, parse_bytes, start_compile)
from moejax.parallel.mesh import MeshSpec
from moejax.train.config import (ExperimentConfig, apply_overrides, get_experiment_preset,
                                 overridden_sections)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moejax.budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model + training preset (default tiny)")
    p.add_argument("--mesh", default="", metavar="pipe=P,data=D,expert=E",
                   help="the layout to budget for (no devices needed)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.remat=full (repeatable)")
    p.add_argument("--device-memory", help="memory per device, e.g. 80GB (binary units)")
    p.add_argument("--micro-batch", type=int,
                   help="sequences per device per forward/backward (default: the global "
                        "batch over data x expert x train.microbatches)")
    p.add_argument("--validate", action="store_true",
                   help="compile the real step at this micro-batch (on --mesh, which this "
                        "host's devices must hold) and compare with XLA's memory_analysis()")
    return p.parse_args(argv)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def budget_config(args: argparse.Namespace) -> ExperimentConfig:
    """The preset with ``--set`` and ``--mesh`` (the config checks the mesh against the
    model and the batch). With ``--micro-batch`` the step's batch is the one that gives
    each data x expert device that many sequences a pass (``train.batch_size`` is set to
    it, whatever the preset's)."""
    preset = get_experiment_preset(args.preset)
    overrides = args.set + (MeshSpec.parse(args.mesh).as_overrides() if args.mesh else [])
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise ConfigError(f"--micro-batch={args.micro_batch}: must be >= 1")
        sections = overridden_sections(preset, overrides)
        shards = sections.get("train", preset.train).batch_shards(
            sections.get("mesh", preset.mesh))
        overrides = [*overrides, f"train.batch_size={args.micro_batch * shards}"]
    return apply_overrides(preset, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = budget_config(args)
        mesh = cfg.mesh
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        on_mesh = args.validate and mesh.size > 1
        # the step's global batch that gives each device --micro-batch per pass
        global_batch = None if args.micro_batch is None else cfg.train.batch_size
        if on_mesh:
            check_compilable_here(mesh)  # before the budget's compiles
        elif args.validate:  # compiles beside the budget's own two
            _progress("memory budget: lowering the real step and compiling it for XLA's "
                      "memory_analysis()")
            start_compile(at_micro_batch(cfg, global_batch))
        budget = estimate(cfg, mesh, micro_batch=args.micro_batch, device_memory=memory,
                          progress=_progress)
        if on_mesh:
            _progress(f"memory budget: compiling the real step on --mesh {mesh} for XLA's "
                      "memory_analysis()")
            peak, analysis = compiled_peak_on_mesh(at_micro_batch(cfg, global_batch), mesh)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(budget.table())
    if args.validate:
        if not on_mesh:
            peak, analysis = compiled_peak(cfg, global_batch)
        beside = budget.device_total - budget.step_total
        print(f"XLA memory_analysis of the real step (per device): arguments "
              f"{analysis.argument_size_in_bytes / GIB:.3f} GiB + temp "
              f"{analysis.temp_size_in_bytes / GIB:.3f} GiB = {peak / GIB:.3f} GiB; budget "
              f"{budget.step_total / GIB:.3f} GiB ({budget.step_total / peak - 1:+.1%})"
              + (f", plus {beside / GIB:.3f} GiB beside the step (the EMA's copy)"
                 if beside else ""))
    return 1 if budget.fits is False else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # compiles may be running on daemon threads: leave them be
        print("memory budget: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

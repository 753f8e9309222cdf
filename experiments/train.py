"""Train a DeepSeek-V3-style MoE: ``python -m experiments.train --preset tiny``.

With no data flags it trains on the embedded corpus (the Python standard library's
source, byte-level). Metrics go to RUN_DIR/metrics.jsonl (one JSON object per step) and a
progress line to stdout; checkpoints to RUN_DIR/checkpoints (Orbax). Bad input gives one
line on stderr and exit status 2; a run stopped by a non-finite loss exits with status 3,
one out of device memory with status 4.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax

from experiments import cli
from moejax.config import ConfigError
from moejax.data.shards import DataError
from moejax.memory.budget import allocator_share_hint
from moejax.parallel import distributed
from moejax.parallel.mesh import MeshSpec
from moejax.train.config import (PIPELINE_SCHEDULES, ExperimentConfig, apply_overrides,
                                 get_experiment_preset)
from moejax.train.loop import StepTrace, Trainer, TrainingError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model + training preset (default tiny)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--steps", type=int, help="train up to this step (sets train.steps)")
    p.add_argument("--run-dir", type=pathlib.Path,
                   help="where checkpoints and metrics go (default runs/PRESET)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in the run dir")
    p.add_argument("--seed", type=int, help="init and data-order seed (sets train.seed)")
    p.add_argument("--mesh", default="", metavar="pipe=P,data=D,expert=E",
                   help="device mesh over all devices of all processes; the sizes must "
                        "multiply to the device count (tensor: 1 for now)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES,
                   help="pipeline schedule for --mesh pipe=P>1 (sets train.pipeline_schedule)")
    p.add_argument("--microbatches", type=int,
                   help="micro-batches per step (sets train.microbatches): the pipeline's "
                        "with --mesh pipe=P>1 (default 2P); else the step accumulates the "
                        "gradients of that many (default 1)")
    p.add_argument("--data", help="shard folder from experiments.prepare_data "
                                  "(sets data.dir; default: the embedded corpus)")
    p.add_argument("--profile", type=pathlib.Path, metavar="DIR",
                   help="trace --profile-steps steps (from the third) with jax.profiler into "
                        "DIR and log where each step's device time went")
    p.add_argument("--profile-steps", type=int,
                   help=f"steps --profile traces (default {StepTrace.steps}; not counted in the "
                        "median step)")
    distributed.add_arguments(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> ExperimentConfig:
    """The validated experiment config: preset, then flags, then --set overrides, then
    --mesh, all validated together (so a batch that does not divide is named with the mesh
    it runs on)."""
    overrides = []
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.data is not None:
        overrides.append(f"data.dir={args.data}")
    if args.schedule is not None:
        overrides.append(f"train.pipeline_schedule={args.schedule}")
    if args.microbatches is not None:
        overrides.append(f"train.microbatches={args.microbatches}")
    overrides += args.set
    if args.mesh:
        overrides += MeshSpec.parse(args.mesh).as_overrides()
    cfg = apply_overrides(get_experiment_preset(args.preset), overrides)
    if args.schedule is not None and cfg.mesh.pipe == 1:  # else ignored without a word
        raise ConfigError(f"--schedule {args.schedule}: applies to a pipelined run, and "
                          f"--mesh {cfg.mesh} has no pipe axis; add pipe=P>1 to --mesh")
    if args.profile_steps is not None and args.profile is None:
        raise ConfigError(f"--profile-steps {args.profile_steps}: applies to a traced run; "
                          "add --profile DIR")
    return cfg


def _on_run_dir(err: OSError, run_dir: pathlib.Path) -> bool:
    """Whether ``err`` is about the run dir: the dir, a folder above it (creating it) or a
    path in it (checkpoints, metrics); an OSError elsewhere keeps its traceback."""
    if not isinstance(err.filename, (str, os.PathLike)):
        return False
    path, root = (pathlib.Path(os.path.abspath(p)) for p in (err.filename, run_dir))
    return path == root or root in path.parents or path in root.parents


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.run_dir or pathlib.Path("runs") / args.preset
    try:
        cli.join_run(args)
        cfg = build_config(args)
        steps = StepTrace.steps if args.profile_steps is None else args.profile_steps
        trace = StepTrace(args.profile, steps) if args.profile else None
        Trainer(cfg, run_dir, resume=args.resume, log=lambda m: print(m, flush=True),
                trace=trace).run()
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not _on_run_dir(e, run_dir):
            raise
        print(f"error: run dir {run_dir} (--run-dir): {e}; pass a directory this process "
              "can create and write", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except jax.errors.JaxRuntimeError as e:
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise
        print(f"error: out of device memory: {str(e).splitlines()[0].split(' [')[0]}\n"
              "  The trainer's memory check is an estimate (python -m moejax.budget prints "
              "it; docs/memory.md): lower train.batch_size, raise train.remat (selective, "
              "full), or keep the batch in K passes (--microbatches K). Where a large block "
              "fails with memory free (fragmentation), XLA suggests "
              "TF_GPU_ALLOCATOR=cuda_malloc_async."
              + allocator_share_hint(jax.devices()[0].platform, os.environ), file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())

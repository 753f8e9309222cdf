"""Joining a multi-process run: one process per host (or per GPU) via jax.distributed."""

from __future__ import annotations

import argparse

import jax

from moejax.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launch flags every multi-process entrypoint takes."""
    group = parser.add_argument_group("multi-process (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0; omit for a single process")
    group.add_argument("--num-processes", type=int, help="processes in the run")
    group.add_argument("--process-id", type=int, help="this process's index, 0-based")


def initialize(args: argparse.Namespace) -> None:
    """Joins the run named by the launch flags; a no-op for a single process.

    CPU collectives between processes go through gloo (XLA:CPU has no other cross-process
    transport); GPUs use NCCL and TPUs ICI whatever this says.
    """
    if args.coordinator is None:
        if args.num_processes not in (None, 1) or args.process_id not in (None, 0):
            raise ConfigError("--num-processes/--process-id need --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise ConfigError("--coordinator needs --num-processes and --process-id")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

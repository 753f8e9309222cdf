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
    group.add_argument("--local-device-ids", metavar="I,J",
                       help="the accelerators of this host this process drives (one process "
                       "per GPU: its index); default all of them")


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
    local = None
    if args.local_device_ids:
        try:
            local = [int(i) for i in args.local_device_ids.split(",")]
        except ValueError:
            raise ConfigError(f"--local-device-ids={args.local_device_ids!r}: must be comma-"
                              "separated device indices, e.g. 0 or 0,1") from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               local_device_ids=local)

"""Argument checks the experiment entrypoints share, so that a bad flag value is refused at
once in one line naming the flag, the value and what is allowed (argparse's usage error,
exit status 2) instead of failing deep in a run: a zero size as a ZeroDivisionError, a
negative one as an XLA shape error, ``nan`` as a cost every comparison lets through.

Nothing here imports jax at module level: pipeline_study parses its flags before it sets
XLA_FLAGS, and its simulation-only path never starts jax.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from moejax.config import ConfigError
from moejax.parallel.pipeline.schedule import ScheduleError

T = TypeVar("T")


def integer(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: must be an integer >= {minimum}")
        return value

    return parse


def number(minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """argparse type: a finite float >= ``minimum`` (> with ``above``): ``float`` alone
    takes nan and inf."""
    rule = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number {rule}")
        return value

    return parse


def integers(minimum: int) -> Callable[[str], list[int]]:
    """argparse type: comma-separated integers >= ``minimum``; '' for none."""
    one = integer(minimum)

    def parse(text: str) -> list[int]:
        try:
            return [one(part) for part in text.split(",") if part]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text}: must be comma-separated integers >= {minimum}, or '' for none"
            ) from None

    return parse


def shapes(dims: str) -> Callable[[str], list[tuple[int, ...]]]:
    """argparse type: comma-separated shapes spelled like ``dims`` (e.g. ``GxKxN``), each
    size >= 1; '' for none."""
    rank, size = len(dims.split("x")), integer(1)

    def one(part: str, text: str) -> tuple[int, ...]:
        try:
            sizes = tuple(size(s) for s in part.split("x"))
        except argparse.ArgumentTypeError:
            sizes = ()
        if len(sizes) != rank:
            raise argparse.ArgumentTypeError(
                f"{text}: {part!r} is not a {dims} shape of sizes >= 1 "
                f"(e.g. {'x'.join(['64'] * rank)}); '' for none")
        return sizes

    return lambda text: [one(part, text) for part in text.split(",") if part]


def float_dtype(text: str) -> str:
    """argparse type: the name of a floating dtype (bfloat16, float32, ...), checked with
    numpy and ml_dtypes (a jax dependency) so that parsing starts no jax."""
    import ml_dtypes  # registers bfloat16 and the FP8 names with numpy
    import numpy as np

    try:
        ml_dtypes.finfo(np.dtype(text))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text}: must be a floating dtype, e.g. bfloat16, float32") from None
    return text


def checked(parser: argparse.ArgumentParser, build: Callable[[], T],
            flag: str | None = None) -> T:
    """``build()``; a ConfigError or ScheduleError it raises (a value the config or the
    schedule refuses) becomes ``parser.error``, prefixed with ``flag`` where the error's own
    text does not name it."""
    try:
        return build()
    except (ConfigError, ScheduleError) as err:
        parser.error(f"{flag}: {err}" if flag else str(err))


def join_run(args: argparse.Namespace) -> None:
    """``distributed.initialize``, refusing ``--local-device-ids`` without
    ``--coordinator``: initialize ignores it there, and the one process would drive every
    device of the host instead of the ones named."""
    if args.local_device_ids is not None and args.coordinator is None:
        raise ConfigError(f"--local-device-ids {args.local_device_ids}: applies to a "
                          "multi-process run; add --coordinator HOST:PORT (with "
                          "--num-processes and --process-id), or drop it to use every device")
    from moejax.parallel import distributed  # imports jax

    distributed.initialize(args)

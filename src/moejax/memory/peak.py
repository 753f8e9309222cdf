"""What is live at the peak of the compiled step: XLA's own answer, read from its dumps.

Why: ``compiled.memory_analysis()`` says how much the step needs, not what for, and the
budget (``memory.budget``) models terms, not XLA's schedule. When the two disagree, the
buffers live at XLA's peak say why. Session 29 found that way that XLA had scheduled every
layer's weight gradients after the whole backward, keeping each layer's recomputed GEMM
operands alive (docs/performance.md).

XLA's live-range dump gives each buffer's first and last instruction in the schedule;
the optimized HLO gives its shape and the JAX op that made it. Summing the live sizes at
each instruction gives the schedule's peak (within 2% of ``memory_analysis()`` for the
``small`` step on the H100: the packing of the buffers adds the rest).

    python -m moejax.memory.peak --preset small --set train.seq_len=4096 \\
        --set train.batch_size=22 [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import tempfile
from typing import NamedTuple

import numpy as np

from moejax.memory.budget import GIB, compiled_peak
from moejax.train.config import apply_overrides, get_experiment_preset

_BYTES = {"token": 0, "pred": 1, "bf16": 2, "c64": 8, "c128": 16}
_SIZED = re.compile(r"[fsu](\d+)(?:e\d+m\d+\w*)?")  # s32, u4, f16, f8e4m3fn, f4e2m1fn, ...
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{[^}]*\})?")


def _element_bytes(dtype: str) -> int:
    """Bytes an element of HLO type ``dtype`` takes in a buffer: sub-byte types (s4, f4...)
    one each, as XLA lays them out unless a layout packs them; a token none."""
    if dtype in _BYTES:
        return _BYTES[dtype]
    sized = _SIZED.fullmatch(dtype)
    if sized is None:
        raise ValueError(f"HLO element type {dtype!r}: not one of {sorted(_BYTES)} or "
                         "[fsu]<bits>")
    return max(1, int(sized.group(1)) // 8)


def parse_shape(text: str) -> tuple[object, str]:
    """The leading HLO shape of ``text`` as bytes (an int for an array, a tuple of these for
    a tuple) and the text after it."""
    text = text.lstrip()
    if text.startswith("("):
        parts, rest = [], text[1:]
        while not rest.lstrip().startswith(")"):
            part, rest = parse_shape(re.sub(r"^\s*/\*index=\d+\*/", "", rest))
            parts.append(part)
            rest = rest.lstrip().removeprefix(",")
        return tuple(parts), rest.lstrip()[1:]
    match = _ARRAY.match(text)
    if match is None:
        raise ValueError(f"no HLO shape at {text[:40]!r}")
    dtype, dims = match.groups()
    count = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return count * _element_bytes(dtype), text[match.end():]


class Instruction(NamedTuple):
    shape: object  # bytes, nested like the HLO shape
    label: str  # "shape op_name": what made the buffer


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of the optimized HLO by name (all computations)."""
    found = {}
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, rest = match.groups()
        try:
            shape, after = parse_shape(rest)
        except ValueError:
            continue  # not an instruction (a computation header's parameter list)
        op_name = re.search(r'op_name="([^"]*)"', after)
        shape_text = rest[:len(rest) - len(after)].strip()
        found[name] = Instruction(shape, f"{re.sub(r'{[^}]*}', '', shape_text)[:72]}  "
                                         f"{op_name.group(1) if op_name else ''}")
    return found


def buffer_bytes(shape: object, index: str) -> int:
    """The bytes of the buffer ``index`` ("" or "0,2") of an instruction's shape; a tuple's
    own buffer is its table of pointers."""
    for i in (int(i) for i in index.split(",") if i):
        shape = shape[i]
    return 8 * len(shape) if isinstance(shape, tuple) else shape


class Buffer(NamedTuple):
    name: str
    index: str
    start: int
    end: int
    nbytes: int
    label: str


class LiveSet(NamedTuple):
    buffers: list[Buffer]
    live: np.ndarray  # bytes live at each instruction of the schedule
    schedule: dict[int, str]  # instruction position -> name

    @property
    def peak(self) -> int:
        return int(np.argmax(self.live))

    def at(self, position: int) -> list[Buffer]:
        return [b for b in self.buffers if b.start <= position <= b.end]


def live_set(live_range_text: str, hlo: dict[str, Instruction]) -> LiveSet:
    """Each buffer of the live-range dump with its bytes, and the bytes live over time."""
    schedule = {int(pos): name for pos, name
                in re.findall(r"^\s+(\d+):(\S+)$", live_range_text, re.M)}
    buffers = [Buffer(name, index, int(start), int(end),
                      buffer_bytes(hlo[name].shape, index), hlo[name].label)
               for name, index, start, end
               in re.findall(r"^\s+(\S+?)\{([\d,]*)\}:(\d+)-(\d+)$", live_range_text, re.M)]
    if not buffers:
        raise ValueError("no buffer live ranges in the live-range dump")
    delta = np.zeros(max(b.end for b in buffers) + 2, np.int64)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[b.end + 1] -= b.nbytes
    return LiveSet(buffers, np.cumsum(delta)[:-1], schedule)


def read_dump(folder: pathlib.Path) -> LiveSet:
    """The live set of the train step in an ``xla_dump_to`` folder (its largest module)."""
    ranges = sorted(folder.glob("*train_step*after_optimizations-live-range.txt"),
                    key=lambda p: p.stat().st_size)
    if not ranges:
        raise FileNotFoundError(f"no train step live-range dump in {folder}")
    hlo_path = ranges[-1].with_name(ranges[-1].name.replace("-live-range.txt", ".txt"))
    return live_set(ranges[-1].read_text(), parse_hlo(hlo_path.read_text()))


def report(live: LiveSet, top: int) -> list[str]:
    """The peak and the buffers live there, grouped by shape and op (numbers stripped)."""
    at = live.peak
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for b in live.at(at):
        groups[re.sub(r"\.\d+", "", b.label)].append(b.nbytes)
    lines = [f"peak of the schedule: {live.live[at] / GIB:.3f} GiB live at instruction {at} "
             f"of {len(live.live)} ({live.schedule.get(at, '?')})",
             f"{'GiB':>8} {'count':>5} x {'MiB':>8}  shape  op"]
    ranked = sorted(groups.items(), key=lambda item: -sum(item[1]))
    for label, sizes in ranked[:top]:
        lines.append(f"{sum(sizes) / GIB:8.3f} {len(sizes):5d} x {max(sizes) / 2**20:8.1f}  "
                     f"{label[:160]}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--top", type=int, default=40, help="groups of buffers to list")
    parser.add_argument("--dump", type=pathlib.Path, help="keep XLA's dumps here")
    args = parser.parse_args(argv)
    cfg = apply_overrides(get_experiment_preset(args.preset), args.overrides)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.dump or pathlib.Path(scratch)
        compiled, analysis = compiled_peak(cfg, autotune=False, dump_to=str(folder))
        live = read_dump(folder)
    print(f"compiled step: {compiled / GIB:.3f} GiB (arguments "
          f"{analysis.argument_size_in_bytes / GIB:.3f}, temp "
          f"{analysis.temp_size_in_bytes / GIB:.3f})")
    print("\n".join(report(live, args.top)))


if __name__ == "__main__":
    main()

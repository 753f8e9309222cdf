"""Where device time goes, read from a ``jax.profiler`` trace; and wall time of one call.

Benchmarks need two numbers a wall clock cannot give: how a step's device time splits
between communication, GEMMs, attention and data movement, and how much communication is
*exposed* (runs while no compute kernel runs on the same device). Both come from the
kernel events of the trace JSON that ``jax.profiler.trace`` writes next to its xplane.
Kernels are classified by their name and the HLO op XLA attaches to them.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import statistics
import tempfile
import time
from typing import Callable, Iterable, NamedTuple

import jax

CATEGORIES = ("communication", "gemm", "attention", "movement", "other")
_PATTERNS = (  # first match wins
    ("communication", re.compile(
        r"nccl|all-to-all|all_to_all|alltoall|all-gather|allgather|all-reduce|allreduce|"
        r"reduce-scatter|reducescatter|collective-permute|sendrecv|send|recv", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cublas|cutlass|xmma|nvjet|wgmma|\bdot|_mm\b", re.I)),
    ("movement", re.compile(
        r"gather|scatter|sort|copy|transpose|dynamic-update-slice|dynamic_update_slice|"
        r"concatenate|slice|pad|permute|dispatch|combine|memset|quantize", re.I)),
)


# XLA's all_to_all and ragged all_to_all, and the barrier kernels the ragged one launches
# (their HLO op names it): the token exchange of expert parallelism.
ALL_TO_ALL = re.compile(r"all-to-all|all_to_all|alltoall", re.I)


# Each collective's kernels, by kind, for a step's account. The HLO op decides where the
# trace names one (NCCL runs an all_to_all as ``SendRecv`` kernels); else the kernel name.
COLLECTIVES = (
    ("all-to-all", ALL_TO_ALL),
    ("all-gather", re.compile(r"all-gather|allgather", re.I)),
    ("reduce-scatter", re.compile(r"reduce-scatter|reducescatter", re.I)),
    ("all-reduce", re.compile(r"all-reduce|allreduce", re.I)),
    ("send/recv", re.compile(r"collective-permute|ppermute|sendrecv|send|recv", re.I)),
)

# The kind of a communication kernel that none of COLLECTIVES names.
UNLISTED = "other"
COLLECTIVE_KINDS = (*(kind for kind, _ in COLLECTIVES), UNLISTED)


class KernelEvent(NamedTuple):
    device: str  # the trace's process name, e.g. "/device:GPU:0"
    name: str  # kernel name
    hlo_op: str  # the HLO instruction it implements ("" if the trace does not say)
    start_us: float
    dur_us: float

    @property
    def category(self) -> str:
        for category, pattern in _PATTERNS:
            if pattern.search(self.name) or pattern.search(self.hlo_op):
                return category
        return "other"


def load_kernel_events(log_dir: str | pathlib.Path) -> list[KernelEvent]:
    """Kernel events of every accelerator in the newest trace under ``log_dir``."""
    traces = sorted(pathlib.Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(traces[-1]) as f:
        trace = json.load(f)
    return kernel_events(trace["traceEvents"] if isinstance(trace, dict) else trace)


def kernel_events(trace_events: Iterable[dict]) -> list[KernelEvent]:
    """Complete ("X") events of processes named ``/device:...`` other than the host."""
    events = list(trace_events)
    devices = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:")
               and not e["args"]["name"].startswith("/device:CPU")}
    return [KernelEvent(devices[e["pid"]], e["name"], str(e.get("args", {}).get("hlo_op", "")),
                        float(e["ts"]), float(e["dur"]))
            for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _covered_us(intervals: list[tuple[float, float]],
                cover: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` that lies inside the union of ``cover`` (a sweep
    over all end points, counting open intervals of each kind)."""
    points = sorted([(a, 0, 1) for a, _ in intervals] + [(b, 0, -1) for _, b in intervals]
                    + [(c, 1, 1) for c, _ in cover] + [(d, 1, -1) for _, d in cover])
    active, covered, last = [0, 0], 0.0, 0.0
    for t, kind, delta in points:
        if active[0] > 0 and active[1] > 0:
            covered += t - last
        active[kind] += delta
        last = t
    return covered


def _exposed_us(intervals: list[tuple[float, float]],
                compute: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals`` with no ``compute`` interval beside it."""
    return _union_us(intervals) - _covered_us(intervals, compute)


class DeviceTime(NamedTuple):
    busy_ms: dict[str, float]  # per category: union of its kernels' time
    total_busy_ms: float  # union over all kernels
    exposed_communication_ms: float  # communication while no other kernel runs
    compute_ms: float  # union of every kernel that is not communication


def device_time(events: list[KernelEvent], device: str | None = None) -> DeviceTime:
    """Per-category busy time and exposed communication of one device (default: first)."""
    devices = sorted({e.device for e in events})
    if not devices:
        raise ValueError("the trace holds no accelerator kernel events")
    device = device or devices[0]
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in events:
        if e.device == device:
            spans[e.category].append((e.start_us, e.start_us + e.dur_us))
    compute = [s for c, v in spans.items() if c != "communication" for s in v]
    exposed = _exposed_us(spans["communication"], compute)
    return DeviceTime({c: _union_us(spans[c]) / 1e3 for c in CATEGORIES},
                      _union_us([s for v in spans.values() for s in v]) / 1e3, exposed / 1e3,
                      _union_us(compute) / 1e3)


def exposed_share(events: list[KernelEvent], pattern: re.Pattern = ALL_TO_ALL
                  ) -> dict[str, float]:
    """Per device: the time kernels matching ``pattern`` (by name or HLO op) run with no
    compute kernel beside them, as a share of the trace's span over all devices (one
    traced call: the step). Why not the communication category's exposed time: in a
    pipeline it also holds the stage-to-stage sends, whose kernels wait out the bubble.
    Empty where the trace holds no accelerator kernels (XLA:CPU)."""
    if not events:
        return {}
    start = min(e.start_us for e in events)
    span = max(e.start_us + e.dur_us for e in events) - start
    shares = {}
    for device in sorted({e.device for e in events}):
        mine = [e for e in events if e.device == device]
        matched = [(e.start_us, e.start_us + e.dur_us) for e in mine
                   if pattern.search(e.name) or pattern.search(e.hlo_op)]
        compute = [(e.start_us, e.start_us + e.dur_us) for e in mine
                   if e.category != "communication"]
        shares[device] = _exposed_us(matched, compute) / span
    return shares


def collective_kind(event: KernelEvent) -> str | None:
    """Which of ``COLLECTIVES`` a kernel runs (``UNLISTED`` where neither its HLO op nor its
    name says), or None for a compute kernel."""
    if event.category != "communication":
        return None
    for text in (event.hlo_op, event.name):
        for kind, pattern in COLLECTIVES:
            if text and pattern.search(text):
                return kind
    return UNLISTED


class CollectiveTime(NamedTuple):
    busy_ms: float  # union of the kind's kernels
    exposed_ms: float  # of that, while no compute kernel runs on the device


def collective_time(events: list[KernelEvent], device: str) -> dict[str, CollectiveTime]:
    """Busy and exposed time of each collective kind on ``device`` (kinds that ran). Why
    per kind: a step's exposed communication alone cannot say whether ZeRO-3's weight
    gathers, its gradient reduce-scatters or the token exchange is what the GPU waits on."""
    mine = [e for e in events if e.device == device]
    compute = [(e.start_us, e.start_us + e.dur_us) for e in mine
               if e.category != "communication"]
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in mine:
        kind = collective_kind(e)
        if kind:
            spans[kind].append((e.start_us, e.start_us + e.dur_us))
    return {kind: CollectiveTime(_union_us(spans[kind]) / 1e3,
                                 _exposed_us(spans[kind], compute) / 1e3)
            for kind in COLLECTIVE_KINDS if spans[kind]}


def top_kernels(events: list[KernelEvent], count: int = 15) -> list[tuple[str, str, float]]:
    """(name, category, total us) of the kernels with the most device time in a trace:
    what a per-category split cannot say (which kernel, and whether it was filed right)."""
    total: dict[tuple[str, str], float] = collections.defaultdict(float)
    for e in events:
        total[e.name[:80], e.category] += e.dur_us
    return [(n, c, round(us, 1)) for (n, c), us in
            sorted(total.items(), key=lambda kv: -kv[1])[:count]]


def account(events: list[KernelEvent], calls: int, device: str | None = None) -> list[str]:
    """Lines that say where ``calls`` traced calls (a training run's steps) spent one
    device's time, per call: busy time by category, exposed communication, each collective
    kind, and the costliest kernels. Empty where the trace holds no accelerator kernels."""
    if not events:
        return []
    device = device or sorted({e.device for e in events})[0]
    per = lambda ms: ms / calls  # noqa: E731
    t = device_time(events, device)
    categories = ", ".join(f"{c} {per(t.busy_ms[c]):.1f}" for c in CATEGORIES)
    lines = [f"{device}, ms per step: kernels busy {per(t.total_busy_ms):.1f} ({categories}); "
             f"communication exposed {per(t.exposed_communication_ms):.1f}"]
    kinds = collective_time(events, device)
    if kinds:
        lines.append("  collectives: " + ", ".join(
            f"{kind} {per(c.busy_ms):.1f} (exposed {per(c.exposed_ms):.1f})"
            for kind, c in kinds.items()))
    lines += [f"  {name} [{category}] {per(us / 1e3):.2f}"
              for name, category, us in top_kernels([e for e in events if e.device == device],
                                                    8)]
    return lines


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` until its outputs are ready, after ``warmup`` calls
    (the first compiles)."""
    return interleaved_median_seconds({"fn": fn}, repeats, warmup)["fn"]


def interleaved_median_seconds(fns: dict[str, Callable[[], object]], repeats: int,
                               warmup: int = 2) -> dict[str, float]:
    """``median_seconds`` of each of ``fns``, timed in turn within each of ``repeats`` rounds
    rather than one after the other. Why: a ratio of two timings (an exchange over the raw
    all_to_all of the same bytes) should not read the drift of clocks and links between two
    separate windows: on 4 H200 the raw all_to_all read 122 and 164 GB/s in two calls
    (docs/performance.md, session 36)."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def profile(fn: Callable[[], object], log_dir: str | pathlib.Path, repeats: int = 3,
            overlap: bool = False) -> DeviceTime:
    """Traces ``repeats`` calls of ``fn`` (already compiled) and splits the device time,
    per call. ``overlap``: dispatch each call before waiting on the one before, as a
    training loop that reads a step's metrics one step late does (the trace then shows
    the gaps that loop leaves, not those of a host that waits on every call)."""
    jax.block_until_ready(fn())
    with jax.profiler.trace(str(log_dir)):
        previous = None
        for _ in range(repeats):
            out = fn()
            jax.block_until_ready(previous if overlap else out)
            previous = out
        jax.block_until_ready(previous)
    t = device_time(load_kernel_events(log_dir))
    per = lambda ms: ms / repeats  # noqa: E731
    return DeviceTime({c: per(v) for c, v in t.busy_ms.items()}, per(t.total_busy_ms),
                      per(t.exposed_communication_ms), per(t.compute_ms))


def device_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Device-busy seconds of one call of ``fn`` (the union of its kernels in a trace, over
    ``repeats`` calls). Short calls need it: a wall clock adds the host's dispatch and the
    launch, which at tens of microseconds of kernel can be most of the reading."""
    with tempfile.TemporaryDirectory() as log_dir:
        return profile(fn, log_dir, repeats).total_busy_ms / 1e3

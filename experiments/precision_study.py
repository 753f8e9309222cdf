"""BF16 vs FP8 training side by side: speed, memory, loss, and the largest micro-batch.

    python -m experiments.precision_study [--preset small] [--steps 40] [--batch B] [--seq S]
        [--precisions bf16,fp8] [--eval-batches 4] [--eval-every N] [--seeds N]
        [--fit-seq 4096] [--fit-cases none:bf16,...]
        [--fit-cache FILE] [--device-memory GiB] [--profile DIR]
        [--set section.field=value ...]

Both runs start from the same seed and see the same batches (byte-level text of the Python
standard library, sampled once). Per precision it prints tokens/s, MFU (active-parameter
FLOPs, ``moejax.train.flops``), median step time after the first (compiling) step, the
compiled step's memory (``compiled.memory_analysis()``: arguments + temporaries, as
``moejax.memory.budget`` counts it; outputs alias the donated state) and the device's
measured peak, then both loss curves and their relative difference after warm-up, and
the loss of both on the same held-out batches (``--eval-batches``, text after the training
text) after every ``--eval-every`` steps and after the last: one batch's training loss
swings by several percent from step to step, the held-out mean does not. ``--seeds N``
trains each precision from N seeds (one compile each) and sets each seed's FP8 - BF16 gap
beside the spread of one precision's runs across seeds: how far two runs of the same
arithmetic drift apart is the floor under any gap a run this short can show. Every seed
scores on the same held-out text, so runs from separate processes compare too. On the GPU
even one seed's two runs part (session 59: at step 2, and by 2.5% of held-out loss after
500 steps), so read a gap from the mean over several seeds.

``--profile DIR`` runs one more step of each run, then traces three, and accounts for the
step time the MFU figure leaves out: device busy time per kernel category
(``moejax.profiling``: GEMM, attention, data movement, collectives, other), the host gap
(step time the device sits idle), and the kernels with the most time; the step's
optimized HLO goes next to the trace (``DIR/PRECISION/step.hlo.txt.gz``) to look a fusion
up by name.

The fit table gives the largest micro-batch at ``--fit-seq`` for remat none / selective
and BF16 / FP8 activation storage: the step is compiled (never run) at candidate batch
sizes and its memory compared with the device's memory (``bytes_limit``, or
``--device-memory``). Each probe is interpolated from the compiles so far
(``largest_batch``), so nothing OOMs and a search takes a handful of compiles;
``--fit-cache FILE`` keeps every compile's bytes so a search cut off resumes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gzip
import hashlib
import json
import pathlib
import statistics
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from experiments import cli
from moejax import profiling
from moejax.atomic_file import write_atomically
from moejax.data.corpus import stdlib_documents
from moejax.data.tokenizer import ByteTokenizer
from moejax.memory.budget import compiled_peak, device_memory_limit
from moejax.memory.remat import POLICIES as REMAT_POLICIES
from moejax.precision import PRECISIONS
from moejax.train.config import ExperimentConfig, apply_overrides, get_experiment_preset
from moejax.train.flops import mfu, peak_flops, train_flops_per_token
from moejax.train.loop import microbatch_note
from moejax.train.step import (attention_implementation, layer_loop, make_eval_step,
                               make_train_step, state_initializer)

LOSS_WINDOW = 20  # steps per mean in the loss comparison
PROFILED_STEPS = 3  # steps a --profile trace holds
GIB = 2**30
HELD_OUT_SEED = 0  # the held-out windows' offsets, the same for every training seed


@dataclasses.dataclass
class RunResult:
    losses: list[float]
    step_s: float
    tokens_per_s: float
    mfu: float | None
    compiled_gib: float | None
    measured_peak_gib: float | None
    held_out: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> loss
    device_time: profiling.DeviceTime | None = None  # per step, with --profile
    top_kernels: list[tuple[str, str, float]] | None = None  # us per step, with --profile


def text_batches(steps: int, batch: int, seq: int, seed: int, held_out: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, batch, seq+1) windows of byte-tokenized stdlib text at seeded offsets, and
    (held_out, batch, seq+1) windows from text after all of them (never trained on).

    The held-out offsets come from ``HELD_OUT_SEED``, not ``seed``: every run of these
    sizes scores on the same text, whichever seed it trained from and in whichever
    process (session 59 compared runs from separate processes whose held-out sets had
    followed their first seed)."""
    window = batch * (seq + 1)
    train_need, eval_need = steps * window * 4, held_out * window * 4
    tokenizer, chunks, have = ByteTokenizer(), [], 0
    for doc in stdlib_documents():
        chunks.append(tokenizer.encode(doc))
        have += len(chunks[-1])
        if have >= train_need + eval_need:
            break
    stream = np.concatenate(chunks)
    cut = len(stream) * train_need // (train_need + eval_need)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, cut - seq - 1, (steps, batch))
    eval_starts = (np.random.default_rng(HELD_OUT_SEED).integers(
        cut, len(stream) - seq - 1, (held_out, batch)) if held_out
                   else np.zeros((0, batch), np.int64))
    return (stream[starts[..., None] + np.arange(seq + 1)],
            stream[eval_starts[..., None] + np.arange(seq + 1)])


def measured_peak_gib() -> float | None:
    peak = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / GIB


def train(cfg: ExperimentConfig, runs: list[tuple[int, np.ndarray]],
          profile_dir: str | None = None, held_out: np.ndarray | None = None,
          eval_every: int = 0) -> list[RunResult]:
    """One result per ``(seed, batches)`` run, all through one compiled step: the seed picks
    the initial weights. ``held_out`` batches are evaluated (main next-token loss, mean over
    them) after every ``eval_every`` steps (0: after the last only), outside the timed
    steps. ``profile_dir``: the last run traces three more steps."""
    graphdef, init = state_initializer(cfg)
    init = jax.jit(init)
    compiled = make_train_step(graphdef, cfg).lower(
        init(runs[0][0]), jnp.asarray(runs[0][1][0])).compile()
    evaluate = make_eval_step(graphdef, cfg)
    analysis = compiled.memory_analysis()  # counted as moejax.memory.budget.compiled_peak does
    used = (None if analysis is None
            else analysis.argument_size_in_bytes + analysis.temp_size_in_bytes)
    flops = train_flops_per_token(cfg.model, cfg.train.seq_len)
    peak = peak_flops(jax.devices()[0].device_kind, cfg.train.peak_tflops)
    results = []
    for seed, batches in runs:
        state = init(seed)
        losses, times, held_out_losses = [], [], {}
        pending, last = None, time.perf_counter()

        def read_back(metrics) -> None:  # blocks until that step is done
            nonlocal last
            losses.append(float(metrics["loss"]))
            now = time.perf_counter()
            times.append(now - last)
            last = now

        for step, tokens in enumerate(batches, start=1):
            # As experiments.train does: a step's loss is read while the next one runs.
            state, metrics = compiled(state, jnp.asarray(tokens))
            if pending is not None:
                read_back(pending)
            pending = metrics
            if held_out is not None and len(held_out) and (
                    step == len(batches) or (eval_every and step % eval_every == 0)):
                read_back(pending)
                pending = None
                held_out_losses[step] = float(np.mean([evaluate(state, jnp.asarray(b))
                                                       for b in held_out]))
                last = time.perf_counter()  # eval time is not step time
        if pending is not None:
            read_back(pending)
        step_s = statistics.median(times[1:] or times)
        tokens_per_s = cfg.train.tokens_per_step / step_s
        results.append(RunResult(losses, step_s, tokens_per_s,
                                 mfu(tokens_per_s, flops, peak, 1),
                                 None if used is None else used / GIB, measured_peak_gib(),
                                 held_out_losses))
    if profile_dir:
        last_batch = jnp.asarray(runs[-1][1][-1])

        def one_step():  # the step donates the last run's state: thread it through
            nonlocal state
            state, step_metrics = compiled(state, last_batch)
            return step_metrics
        trace_dir = pathlib.Path(profile_dir, cfg.train.precision)
        trace_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace_dir / "step.hlo.txt.gz", "wt") as f:  # to read a fusion's body
            f.write(compiled.as_text())
        results[-1].device_time = profiling.profile(one_step, trace_dir, PROFILED_STEPS,
                                                    overlap=True)
        results[-1].top_kernels = [
            (name, category, us / PROFILED_STEPS) for name, category, us in
            profiling.top_kernels(profiling.load_kernel_events(trace_dir))]
    return results


def largest_batch(bytes_at: Callable[[int], int], limit: int, cap: int = 4096,
                  guess: int = 1) -> int:
    """The largest batch <= ``cap`` whose compiled step fits ``limit`` bytes (0: none does).

    The step's memory is nearly linear in batch and a little convex. The search starts at
    ``guess`` (a good one, e.g. the last run's answer, settles it in two compiles: guess and
    guess + 1), then each probe is where a line through measured points meets ``limit``:
    through the two largest batches that fit while nothing above is known; through the
    largest batch known to fit and the smallest known not to, once those bracket the
    answer (on a convex curve the chord's crossing lies at or below the true one, so the
    bracket closes from below in a few compiles, each minutes at seq 4096); through the
    origin while nothing fits yet (the fixed bytes put that crossing below the true one).
    After two fitting probes in a row inside a bracket the probe is at least its midpoint,
    so a strongly curved step still halves the bracket every other compile.
    """
    seen: dict[int, int] = {}
    probe, fitted_in_a_row = min(max(guess, 1), cap), 0
    while True:
        used = seen[probe] = bytes_at(probe)
        fitted_in_a_row = fitted_in_a_row + 1 if used <= limit else 0
        fits = sorted(b for b, n in seen.items() if n <= limit)
        lo, hi = (fits[-1] if fits else 0), min((b for b in seen if seen[b] > limit),
                                                default=cap + 1)
        if hi - lo <= 1:
            return lo
        if not fits:
            probe = hi * limit // seen[hi]
        elif hi > cap and len(fits) == 1:
            probe = lo + 1
        else:
            base = fits[-2] if hi > cap else hi
            slope = max((seen[base] - seen[lo]) / (base - lo), 1.0)
            probe = lo + int((limit - seen[lo]) // slope)
            if hi <= cap and fitted_in_a_row >= 2:
                probe = max(probe, (lo + hi) // 2)
        probe = min(max(probe, lo + 1), hi - 1)


CPU_ASSUMED_GIB = 1.0


def device_memory_bytes(override_gib: float | None) -> int:
    """The memory to fit into: ``--device-memory``, else the device's ``bytes_limit``; a CPU
    reports none, so a smoke run there assumes ``CPU_ASSUMED_GIB`` (and says so)."""
    if override_gib is not None:
        return int(override_gib * GIB)
    limit = device_memory_limit(jax.local_devices()[0])
    if limit is None:
        print(f"(no device memory limit reported: assuming {CPU_ASSUMED_GIB} GiB; "
              f"pass --device-memory)")
        return int(CPU_ASSUMED_GIB * GIB)
    return int(limit)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_runs(results: dict[str, RunResult], cfg: ExperimentConfig) -> None:
    print(f"\n{'':<28}" + "".join(f"{p:>14}" for p in results))
    rows = [("tokens/s", lambda r: _fmt(r.tokens_per_s, ",.0f")),
            ("MFU (BF16 peak)", lambda r: _fmt(None if r.mfu is None else 100 * r.mfu, ".1f")
             + ("%" if r.mfu is not None else "")),
            ("step time (ms, median)", lambda r: _fmt(1e3 * r.step_s, ".1f")),
            ("compiled step memory (GiB)", lambda r: _fmt(r.compiled_gib, ".2f")),
            ("measured peak so far (GiB)", lambda r: _fmt(r.measured_peak_gib, ".2f"))]
    for name, cell in rows:
        print(f"{name:<28}" + "".join(f"{cell(r):>14}" for r in results.values()))
    if set(results) != set(PRECISIONS):
        print("\n" + "\n".join(f"{p} losses: " + " ".join(f"{x:.4f}" for x in r.losses)
                                for p, r in results.items()))
        for p, r in results.items():
            if r.held_out:
                print(f"{p} held-out loss: " + ", ".join(f"step {step} {x:.4f}"
                                                          for step, x in r.held_out.items()))
        return
    bf16, fp8 = results["bf16"], results["fp8"]
    print(f"FP8 / BF16 tokens/s: {fp8.tokens_per_s / bf16.tokens_per_s:.2f}x")
    print(f"\n{'step':>5} {'bf16 loss':>10} {'fp8 loss':>10} {'rel diff':>9}")
    for step, (a, b) in enumerate(zip(bf16.losses, fp8.losses), start=1):
        print(f"{step:>5} {a:>10.4f} {b:>10.4f} {(b - a) / a:>+9.2%}")
    warm = cfg.train.warmup_steps
    rel = np.abs(np.subtract(fp8.losses, bf16.losses)[warm:]) / np.array(bf16.losses[warm:])
    if rel.size:
        print(f"after warm-up (steps > {warm}): relative loss difference mean {rel.mean():.3%}, "
              f"max {rel.max():.3%}, last {rel[-1]:.3%}")
    # One batch's loss is noisy at small batch; means over windows show the trend.
    for lo in range(warm, len(bf16.losses) - LOSS_WINDOW + 1, LOSS_WINDOW):
        a, b = (np.mean(r.losses[lo:lo + LOSS_WINDOW]) for r in (bf16, fp8))
        print(f"steps {lo + 1}-{lo + LOSS_WINDOW}: mean loss bf16 {a:.4f}, fp8 {b:.4f}, "
              f"relative {(b - a) / a:+.2%}")
    if bf16.held_out:
        # The same held-out batches for both: no batch-to-batch noise in the difference.
        print(f"\n{'step':>5} {'held-out bf16':>14} {'held-out fp8':>13} {'rel diff':>9}")
        for step, a in bf16.held_out.items():
            b = fp8.held_out[step]
            print(f"{step:>5} {a:>14.4f} {b:>13.4f} {(b - a) / a:>+9.2%}")


def print_seeds(results: dict[str, list[RunResult]], seeds: list[int]) -> None:
    """Per seed, the last loss window's mean and each held-out loss; then each seed's FP8 -
    BF16 gap beside each precision's spread over seeds ((max - min) / mean). Runs from two
    seeds of one precision part by chance alone (another start, other batches, and GPU
    reductions that are not deterministic): a gap within that spread is not resolved."""
    first = next(iter(results.values()))[0]
    points = [("last window", lambda r: float(np.mean(r.losses[-LOSS_WINDOW:])))] + [
        (f"held-out @{step}", lambda r, step=step: r.held_out[step]) for step in first.held_out]
    print(f"\nloss per seed ({', '.join(map(str, seeds))}); spread = (max - min) / mean "
          f"over seeds")
    header = "".join(f"{p + ' s' + str(i):>11}" for p in results for i in range(len(seeds)))
    gaps = "FP8-BF16 per seed" if set(results) == set(PRECISIONS) else ""
    print(f"{'':<18}{header}" + "".join(f"{p + ' spread':>13}" for p in results)
          + (f"  {gaps}" if gaps else ""))
    for name, value in points:
        values = {p: [value(r) for r in runs] for p, runs in results.items()}
        cells = "".join(f"{v:>11.4f}" for vs in values.values() for v in vs)
        spreads = "".join(f"{(max(vs) - min(vs)) / np.mean(vs):>13.2%}"
                          for vs in values.values())
        gap = ("  " + " ".join(f"{(b - a) / a:+.2%}" for a, b in
                               zip(values["bf16"], values["fp8"]))) if gaps else ""
        print(f"{name:<18}{cells}{spreads}{gap}")


def print_account(results: dict[str, RunResult]) -> None:
    """Where each profiled step's time goes: busy time per kernel category (a kernel counted
    once, in its first matching category), and the host gap (the step's wall time the
    device has no kernel running)."""
    profiled = {p: r for p, r in results.items() if r.device_time is not None}
    if not profiled:
        return
    print("\nstep time account (ms per step from the trace; % of the median step time):")
    print(f"{'':<28}" + "".join(f"{p:>20}" for p in profiled))
    cells = lambda ms, r: f"{ms:.1f} ({100 * ms / (1e3 * r.step_s):.0f}%)"  # noqa: E731
    for category in profiling.CATEGORIES:
        print(f"{category:<28}" + "".join(
            f"{cells(r.device_time.busy_ms[category], r):>20}" for r in profiled.values()))
    print(f"{'device busy (union)':<28}" + "".join(
        f"{cells(r.device_time.total_busy_ms, r):>20}" for r in profiled.values()))
    print(f"{'host gap (step - busy)':<28}" + "".join(
        f"{cells(max(1e3 * r.step_s - r.device_time.total_busy_ms, 0.0), r):>20}"
        for r in profiled.values()))
    for precision, r in profiled.items():
        print(f"\n{precision}: kernels with the most time (ms a step)")
        for name, category, us in r.top_kernels:
            print(f"  {us / 1e3:>9.1f} ms  {category:<13} {name}")


FitCase = tuple[str, str, int]  # (remat policy, precision, first batch the search compiles)
FIT_CASES: tuple[FitCase, ...] = tuple((remat, precision, 1) for remat in ("none", "selective")
                                       for precision in PRECISIONS)


def parse_fit_cases(text: str) -> tuple[FitCase, ...]:
    """``none:bf16@9,selective:fp8`` -> ((none, bf16, 9), (selective, fp8, 1)): ``@B`` is
    where that search starts (a right guess settles it in two compiles). A ValueError names
    the bad entry and what is allowed."""
    cases = []
    for entry in text.split(","):
        pair, _, guess = entry.partition("@")
        remat, _, precision = pair.partition(":")
        if (remat not in REMAT_POLICIES or precision not in PRECISIONS
                or not (guess or "1").isdigit() or int(guess or 1) < 1):
            raise ValueError(f"fit case {entry!r}: want REMAT:PRECISION[@BATCH] with REMAT in "
                             f"{REMAT_POLICIES}, PRECISION in {PRECISIONS} and BATCH >= 1")
        cases.append((remat, precision, int(guess or 1)))
    return tuple(cases)


class CompileCache:
    """Compiled step bytes by config, GEMM backend, device and jax version, kept in a JSON
    file so a fit search cut off by a time limit resumes where it stopped
    (``--fit-cache``). The key does not see the code: start a new file after changing it."""

    def __init__(self, path: pathlib.Path | None):
        self.path, self._lock = path, threading.Lock()
        self._bytes = self._read(path) if path is not None and path.exists() else {}

    @staticmethod
    def _read(path: pathlib.Path) -> dict[str, int]:
        """The file's bytes by key; a ValueError naming the file where it is not a fit
        cache, so a wrong --fit-cache is refused before any training or compile."""
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, or not JSON
            raise ValueError(f"{path}: not a fit cache ({e})") from None
        if not (isinstance(cached, dict) and all(isinstance(v, int) for v in cached.values())):
            raise ValueError(f"{path}: not a fit cache (want a JSON object of compiled bytes "
                             "by key, as an earlier search wrote)")
        return cached

    @staticmethod
    def key(cfg: ExperimentConfig) -> str:
        text = (f"{cfg!r} {pallas_kernels.backend()} {jax.devices()[0].device_kind} "
                f"jax {jax.__version__}")
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, cfg: ExperimentConfig) -> int | None:
        with self._lock:
            return self._bytes.get(self.key(cfg))

    def put(self, cfg: ExperimentConfig, used: int) -> None:
        with self._lock:
            self._bytes[self.key(cfg)] = used
            if self.path is not None:  # whole: a search killed mid-write keeps its cache
                write_atomically(self.path, json.dumps(self._bytes, indent=1))


def fit_config(cfg: ExperimentConfig, seq: int, case: FitCase) -> ExperimentConfig:
    """The config a fit search compiles at batch 1: one micro-batch in one pass."""
    remat, precision, _ = case
    return apply_overrides(cfg, [f"train.remat={remat}", f"train.precision={precision}",
                                 f"train.seq_len={seq}", "train.batch_size=1",
                                 "train.microbatches=1"])


def print_fit(cfg: ExperimentConfig, seq: int, limit: int,
              cases: tuple[FitCase, ...] = FIT_CASES, cache: CompileCache | None = None
              ) -> None:
    """The searches run in threads: XLA compiles without the GIL, so they overlap. Each
    compile is printed as it ends with its time (a seq-4096 `small` step takes minutes to
    compile on a GPU, so a long search shows where it is, and a cut one what it had found);
    probes compile without GEMM autotuning (memory is what they measure)."""
    cache = cache or CompileCache(None)
    print(f"\nlargest micro-batch at seq {seq} within {limit / GIB:.1f} GiB "
          f"(compiled memory, nothing run):", flush=True)

    def search(case: FitCase) -> int:
        remat, precision, guess = case
        run = fit_config(cfg, seq, case)

        def bytes_at(batch: int) -> int:
            probe = apply_overrides(run, [f"train.batch_size={batch}"])
            used, start = cache.get(probe), time.perf_counter()
            if used is None:
                used = compiled_peak(probe, autotune=False)[0]
                cache.put(probe, used)
            took = time.perf_counter() - start
            print(f"    remat={remat} precision={precision} batch {batch}: "
                  f"{used / GIB:.2f} GiB ({took:.0f} s)", flush=True)
            return used

        return largest_batch(bytes_at, limit, guess=guess)

    found = {}
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = {pool.submit(search, case): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            (remat, precision, _), batch = futures[future], future.result()
            found[remat, precision] = batch
            print(f"  remat={remat:<10} precision={precision:<5} batch {batch}", flush=True)
    base, saver = found.get(("none", "bf16")), found.get(("selective", "fp8"))
    if base and saver is not None:
        print(f"selective + FP8 storage vs none + BF16: {saver / base:.2f}x the micro-batch")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=40,
                        help="training steps per precision; 0 runs only the fit search")
    parser.add_argument("--batch", type=int, help="global batch (default: the preset's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    parser.add_argument("--fit-seq", type=cli.integer(0),
                        help="sequence length of the largest-micro-batch search: default "
                             "4096 or the model's max_position_embeddings if less; 0 skips it")
    parser.add_argument("--fit-cases", default=",".join(f"{r}:{p}" for r, p, _ in FIT_CASES),
                        help="REMAT:PRECISION[@BATCH] pairs to search, from BATCH (default 1; "
                             "one device call may not hold all four at seq 4096)")
    parser.add_argument("--fit-cache", type=pathlib.Path, metavar="FILE",
                        help="JSON of compiled step bytes: read, and written after each "
                             "compile, so a cut search resumes without recompiling (start "
                             "a new file after changing the code)")
    parser.add_argument("--eval-batches", type=int, default=4,
                        help="held-out batches (text after the training text) whose mean "
                             "loss both precisions report; 0 skips it")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate the held-out batches every N steps (0: after the "
                             "last step only)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train each precision from this many seeds (train.seed, +1, ...: "
                             "other weights and batches, one compile) and compare the FP8 - "
                             "BF16 gap with the BF16 runs' own spread across seeds")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated subset of {PRECISIONS} to train")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace 3 more steps per precision here and account for the time")
    parser.add_argument("--device-memory", type=cli.number(0, above=True),
                        help="GiB to fit into (default: the device's bytes_limit)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    precisions = args.precisions.split(",")
    if set(precisions) - set(PRECISIONS):
        parser.error(f"--precisions {args.precisions!r}: choose from {PRECISIONS}")
    try:
        fit_cases = parse_fit_cases(args.fit_cases)
    except ValueError as e:
        parser.error(f"--fit-cases: {e}")
    if args.steps < 0:
        parser.error(f"--steps {args.steps}: must be >= 0")
    for flag in ("batch", "seq"):  # None: the preset's
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)}: must be >= 1")
    for flag in ("eval_batches", "eval_every"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be >= 1")
    if args.profile and jax.default_backend() == "cpu":
        parser.error("--profile reads accelerator kernel events from the trace; this process "
                     "runs on the CPU")

    base = cli.checked(parser, lambda: get_experiment_preset(args.preset), "--preset")
    sizes = [f"train.steps={args.steps}",
             f"train.warmup_steps={min(base.train.warmup_steps, args.steps - 1)}"
             ] if args.steps else []
    sizes += [f"train.batch_size={args.batch}"] if args.batch else []
    sizes += [f"train.seq_len={args.seq}"] if args.seq else []
    cfg = cli.checked(parser, lambda: apply_overrides(base, sizes + args.overrides))
    fit_seq = (min(4096, cfg.model.max_position_embeddings) if args.fit_seq is None
               else args.fit_seq)
    for case in fit_cases if fit_seq else ():  # refused now, not after the training runs
        cli.checked(parser, lambda: fit_config(cfg, fit_seq, case),
                    f"--fit-seq {fit_seq} with --fit-cases {case[0]}:{case[1]}")
    try:
        cache = CompileCache(args.fit_cache if fit_seq else None)
    except ValueError as e:
        parser.error(f"--fit-cache {e}")
    tc = cfg.train
    print(f"preset {args.preset}: batch {tc.batch_size} x seq {tc.seq_len}, {args.steps} steps, "
          f"device {jax.devices()[0].device_kind}, remat {tc.remat}, "
          f"attention {attention_implementation(cfg)}, layer loop {layer_loop(cfg)}"
          f"{microbatch_note(cfg)}", flush=True)
    if args.steps:
        runs, held_out = [], None
        for seed in range(tc.seed, tc.seed + args.seeds):
            batches, held_out = text_batches(tc.steps, tc.batch_size, tc.seq_len, seed,
                                             args.eval_batches)  # one held-out set for all
            runs.append((seed, batches))
        results = {p: train(apply_overrides(cfg, [f"train.precision={p}"]), runs,
                            args.profile, held_out, args.eval_every) for p in precisions}
        print_runs({p: r[0] for p, r in results.items()}, cfg)
        if args.seeds > 1:
            print_seeds(results, [seed for seed, _ in runs])
        print_account({p: r[-1] for p, r in results.items()})
    if fit_seq:
        print_fit(cfg, fit_seq, device_memory_bytes(args.device_memory), fit_cases, cache)


if __name__ == "__main__":
    main()

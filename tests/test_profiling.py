"""The trace reader: kernel classification, busy time and exposed communication."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from moejax import profiling


def _trace(tmp_path, events):
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/host:CPU"))]
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def _kernel(pid, name, ts, dur, hlo_op=""):
    return {"ph": "X", "pid": pid, "tid": 7, "name": name, "ts": ts, "dur": dur,
            "args": {"hlo_op": hlo_op}}


def test_split_and_exposed_communication(tmp_path):
    _trace(tmp_path, [
        _kernel(1, "sm90_xmma_gemm_bf16", 0, 10, "dot.1"),
        _kernel(1, "ncclDevKernel_SendRecv", 5, 15, "all-to-all.2"),  # 5..20: 5 under gemm
        _kernel(1, "loop_fusion", 12, 4, "gather.3"),  # 12..16: under the exchange too
        _kernel(1, "input_reduce_fusion", 30, 2, "reduce.4"),
        _kernel(1, "quantize_rows_", 40, 3),  # the FP8 quantizing passes move data
        _kernel(2, "ncclDevKernel_SendRecv", 0, 100, "all-to-all.2"),  # other device
        _kernel(3, "PjitFunction", 0, 1000),  # host events are not kernels
    ])
    events = profiling.load_kernel_events(tmp_path)
    assert {e.device for e in events} == {"/device:GPU:0", "/device:GPU:1"}
    t = profiling.device_time(events, "/device:GPU:0")
    assert t.busy_ms == pytest.approx({"communication": 0.015, "gemm": 0.010, "attention": 0.0,
                                       "movement": 0.007, "other": 0.002})
    assert t.total_busy_ms == pytest.approx(0.025)
    # exchange 5..20 minus compute under it (5..10 gemm, 12..16 gather) = 20 - 5 - 9 = 6 us
    assert t.exposed_communication_ms == pytest.approx(0.006)
    assert t.compute_ms == pytest.approx(0.019)  # 0..10, 12..16, 30..32, 40..43
    assert profiling.device_time(events, "/device:GPU:1").exposed_communication_ms == \
        pytest.approx(0.1)


def test_exposed_all_to_all_leaves_out_the_pipeline_sends():
    """A pipeline's stage-to-stage sends wait out the bubble inside their kernels; the
    exposed all_to_all share counts only the token exchange, over the whole traced step."""
    K = profiling.KernelEvent
    events = [
        K("/device:GPU:0", "ncclDevKernel_SendRecv", "ppermute.1", 0, 50),  # a long wait
        K("/device:GPU:0", "RaggedAllToAllKernelImpl", "ragged-all-to-all.2", 50, 10),
        K("/device:GPU:0", "MultiGpuBarrierKernelImpl", "ragged-all-to-all.2", 60, 2),
        K("/device:GPU:0", "bf16_grouped_gemm", "custom-call.3", 55, 20),  # hides 55..62
        K("/device:GPU:1", "ncclDevKernel_AllToAll", "all-to-all.4", 90, 10),
    ]
    shares = profiling.exposed_share(events)
    assert shares == pytest.approx({"/device:GPU:0": 5 / 100, "/device:GPU:1": 10 / 100})
    assert profiling.exposed_share([]) == {}


def test_cpu_trace_has_no_kernel_events(tmp_path):
    """A real trace from XLA:CPU parses, holds no accelerator kernels, and says so."""
    f = jax.jit(lambda a: (a @ a).sum())
    x = jnp.ones((32, 32))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(x).block_until_ready()
    assert profiling.load_kernel_events(tmp_path) == []
    with pytest.raises(ValueError, match="no accelerator kernel"):
        profiling.device_time([])


def test_device_seconds_is_the_traced_busy_time_per_call(monkeypatch):
    """Benchmarks' device timer: the per-call busy time of `profile`, in seconds, traced
    into a directory of its own."""
    seen = {}

    def fake_profile(fn, log_dir, repeats):
        seen.update(log_dir=log_dir, repeats=repeats, out=fn())
        return profiling.DeviceTime({}, 2.5, 0.0, 2.5)

    monkeypatch.setattr(profiling, "profile", fake_profile)
    assert profiling.device_seconds(lambda: "ran", 7) == pytest.approx(0.0025)
    assert seen["repeats"] == 7 and seen["out"] == "ran" and seen["log_dir"]


def test_interleaved_timing_takes_turns_and_returns_each_median():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("exchange", "raw")}
    medians = profiling.interleaved_median_seconds(fns, repeats=3, warmup=1)
    assert calls == ["exchange", "raw"] + ["exchange", "raw"] * 3
    assert set(medians) == {"exchange", "raw"} and all(t >= 0 for t in medians.values())

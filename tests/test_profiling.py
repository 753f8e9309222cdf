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


def test_collective_account_splits_each_kind_and_what_is_exposed():
    """ZeRO-3's weight gathers, its gradient reduce-scatters and the token exchange are told
    apart (by HLO op first: NCCL runs an all_to_all as SendRecv kernels), each with the part
    no compute kernel hides. Times in ms (x 1000 us)."""
    gpu = "/device:GPU:0"

    def K(name, hlo_op, start_ms, dur_ms, device=gpu):
        return profiling.KernelEvent(device, name, hlo_op, start_ms * 1e3, dur_ms * 1e3)

    events = [
        K("sm90_xmma_gemm_bf16", "dot.1", 0, 100),
        K("ncclDevKernel_AllGather_RING_LL", "all-gather-start.2", 90, 20),  # 10 exposed
        K("ncclDevKernel_ReduceScatter_Sum", "reduce-scatter.3", 120, 30),
        K("ncclDevKernel_SendRecv", "all-to-all.4", 20, 10),  # hidden by the GEMM
        K("loop_fusion", "fusion.5", 140, 20),  # hides 140..150 of the scatter: 20 exposed
        K("ncclDevKernel_Broadcast_RING_LL", "", 300, 4),  # a collective of no listed kind
        K("ncclDevKernel_AllGather_RING_LL", "all-gather.2", 0, 500, "/device:GPU:1"),
    ]
    split = profiling.collective_time(events, gpu)
    assert split == {"all-to-all": (10.0, 0.0), "all-gather": (20.0, 10.0),
                     "reduce-scatter": (30.0, 20.0), "other": (4.0, 4.0)}
    assert list(map(profiling.collective_kind, events[:6])) == [
        None, "all-gather", "reduce-scatter", "all-to-all", None, "other"]
    lines = profiling.account(events, calls=2, device=gpu)
    assert lines[0] == (f"{gpu}, ms per step: kernels busy 77.0 (communication 32.0, gemm "
                        "50.0, attention 0.0, movement 0.0, other 10.0); communication "
                        "exposed 17.0")
    assert lines[1] == ("  collectives: all-to-all 5.0 (exposed 0.0), all-gather 10.0 "
                        "(exposed 5.0), reduce-scatter 15.0 (exposed 10.0), other 2.0 "
                        "(exposed 2.0)")
    assert lines[2] == "  sm90_xmma_gemm_bf16 [gemm] 50.00"
    assert profiling.account([], calls=3) == []

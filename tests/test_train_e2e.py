"""End-to-end runs of ``python -m experiments.train`` as real processes (minimal sizes).

Subprocesses share a persistent compilation cache, so only the first one compiles.
"""

import glob
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from experiments.train import main
from moejax.train.checkpoint import PAUSE_ENV
from moejax.train.metrics import DEVICE_LOAD, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--preset", "tiny", "--set", "model.num_hidden_layers=2", "--set", "train.seq_len=32",
         "--set", "train.batch_size=8", "--set", "train.warmup_steps=1",
         "--set", "train.schedule_steps=6", "--set", "train.eval_every=3",
         "--set", "train.eval_batches=1", "--set", "train.log_every=1", "--seed", "3"]
COMPARED = ("loss", "mtp_loss", "aux_loss", "grad_norm", "lr", "eval_loss",
            "expert_load_max_over_mean")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env():
    """The CLI runs share the session's compilation cache (conftest), every compile kept:
    many of them compile the same programs as the straight run."""
    return {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _train(env, run_dir, *extra, popen=False, extra_env=None):
    cmd = [sys.executable, "-m", "experiments.train", *SMALL, "--run-dir", str(run_dir), *extra]
    kwargs = dict(cwd=ROOT, env={**env, **(extra_env or {})}, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    if popen:
        return subprocess.Popen(cmd, **kwargs)
    result = subprocess.run(cmd, timeout=400, **kwargs)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def _history(run_dir):
    records = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: {k: r.get(k) for k in COMPARED} for r in records}


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
    """An uninterrupted 6-step run: the reference every interrupted run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight")
    result = _train(env, run_dir, "--steps", "6", "--set", "checkpoint.every=3")
    assert result.returncode == 0, result.stderr
    return run_dir


def test_resumed_run_logs_identical_losses(env, straight, tmp_path):
    reference = _history(straight)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert reference[6]["loss"] < reference[1]["loss"]
    first = _train(env, tmp_path, "--steps", "3", "--set", "checkpoint.every=3")
    assert first.returncode == 0, first.stderr
    second = _train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=3", "--resume")
    assert second.returncode == 0, second.stderr
    assert "from step 3" in second.stdout
    assert _history(tmp_path) == reference


def test_process_killed_mid_save_resumes_from_last_complete_step(env, straight, tmp_path):
    proc = _train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=2", popen=True,
                  extra_env={PAUSE_ENV: "4"})
    deadline = time.time() + 300
    while not glob.glob(str(tmp_path / "checkpoints" / "4.*" / "**" / "paused"),
                        recursive=True):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "the save of step 4 never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (tmp_path / "checkpoints" / "2").is_dir()
    assert not (tmp_path / "checkpoints" / "4").exists()  # only a temporary directory
    resumed = _train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "from step 2" in resumed.stdout
    assert _history(tmp_path) == _history(straight)
    assert (tmp_path / "checkpoints" / "6").is_dir()


def test_nonfinite_loss_stops_with_the_step_and_keeps_the_last_good_state(env, tmp_path):
    result = _train(env, tmp_path, "--steps", "6", "--set", "train.lr=1e30",
                    "--set", "checkpoint.every=100")
    assert result.returncode == 3
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: non-finite loss at step ")
    bad = int(message.split("at step ")[1].split()[0])
    assert bad >= 2 and (tmp_path / "checkpoints" / str(bad - 1)).is_dir()


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--set", "train.lr=abc"], "train.lr='abc': expected a value of type float"),
    (["--set", "train.bogus=1"], "unknown field train.bogus"),
    (["--data", "/nonexistent/shards"], "not a shard folder"),
    (["--mesh", "data=2"], "multiply to 2, but there are 8 devices"),
    (["--mesh", "pipe=2,data=2,tensor=2"], "mesh.tensor=2"),
    (["--mesh", "pipe=2,data=4", "--schedule", "dualpipev", "--microbatches", "2"],
     "train.microbatches=2"),
    (["--coordinator", "localhost:1"], "needs --num-processes and --process-id"),
    (["--microbatches", "3"],  # gradient accumulation needs equal micro-batches
     "train.batch_size=16: must divide over the data x expert mesh axes (1 x 1) x 3 "
     "micro-batches (train.microbatches)"),
    (["--mesh", "data=4", "--microbatches", "8"],  # named with the mesh it runs on
     "train.batch_size=16: must divide over the data x expert mesh axes (4 x 1) x 8"),
    (["--mesh", "data=8", "--schedule", "dualpipe"],  # not silently a whole-batch run
     "--schedule dualpipe: applies to a pipelined run"),
    (["--profile-steps", "5"], "--profile-steps 5: applies to a traced run; add --profile"),
    (["--set", "model.n_group=3"], "model.n_routed_experts=16: must be divisible by n_group=3"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_out_of_device_memory_is_named_with_what_to_change(monkeypatch, tmp_path, capsys):
    """An allocator failure (4 x H100, session 38: a 20.83 GiB temp block on a fragmented
    heap) ends with what failed and what to change, and exit status 4; any other runtime
    error keeps its traceback."""
    import jax
    from experiments import train

    def fail(message):
        def run(self):
            raise jax.errors.JaxRuntimeError(message)
        return run

    monkeypatch.setattr(train.Trainer, "run", fail(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 20.83GiB with allocator "
        "GPU_0_bfc on device 0. [executable_name='jit_train_step']\nmore"))
    assert main([*SMALL, "--run-dir", str(tmp_path)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: out of device memory: RESOURCE_EXHAUSTED: Out of memory "
                          "while trying to allocate 20.83GiB with allocator GPU_0_bfc on "
                          "device 0.\n") and "train.remat" in err
    monkeypatch.setattr(train.Trainer, "run", fail("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        main([*SMALL, "--run-dir", str(tmp_path / "other")])


def test_run_dir_of_another_config_is_refused_and_left_intact(straight, capsys):
    before = sorted(p.name for p in (straight / "checkpoints").iterdir())
    args = [*SMALL, "--run-dir", str(straight), "--steps", "6"]
    assert main(args) == 2  # checkpoints there, no --resume
    assert "pass --resume" in capsys.readouterr().err
    assert main([*args, "--resume", "--set", "model.hidden_size=64"]) == 2
    err = capsys.readouterr().err
    assert "another configuration" in err and "model.hidden_size: 128 -> 64" in err
    assert err.rstrip().endswith("or set the recorded values back: --set model.hidden_size=128")
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == before


def _assert_same_history(got, reference):
    assert sorted(got) == sorted(reference)
    for step, row in reference.items():
        for key, value in row.items():
            expected = value if value is None else pytest.approx(value, rel=1e-4, abs=1e-6)
            assert got[step][key] == expected, (step, key)


def test_expert_parallel_run_logs_the_losses_of_one_device(env, straight, tmp_path):
    """8 simulated devices, expert=8, vs the single-device run. ``data=2,expert=4`` with
    ZeRO-3 runs in the two-process test below, and with ZeRO-1 in the resume test."""
    result = _train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=3", "--mesh",
                    "expert=8")
    assert result.returncode == 0, result.stderr
    assert "mesh pipe=1,data=1,expert=8" in result.stdout
    _assert_same_history(_history(tmp_path), _history(straight))
    # the summary reads the step time beside the load it waited for
    loads = [r[DEVICE_LOAD] for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 1]
    assert f"median device load max/mean {statistics.median(loads):.2f}" in result.stdout


def test_checkpoint_restores_onto_another_mesh(env, straight, tmp_path):
    first = _train(env, tmp_path, "--steps", "3", "--set", "checkpoint.every=3")
    assert first.returncode == 0, first.stderr
    second = _train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=3", "--resume",
                    "--mesh", "data=2,expert=4", "--set", "train.zero_stage=1")
    assert second.returncode == 0, second.stderr
    assert "from step 3" in second.stdout
    _assert_same_history(_history(tmp_path), _history(straight))


def test_two_processes_log_the_losses_of_one(env, straight, tmp_path):
    """Two real processes with 4 CPU devices each, joined by jax.distributed (gloo)."""
    port = 20000 + os.getpid() % 20000
    # the suite's XLA flags (conftest) with 4 devices a process
    four = {"XLA_FLAGS": re.sub(r"device_count=\d+", "device_count=4", env["XLA_FLAGS"])}
    procs = [_train(env, tmp_path, "--steps", "6", "--set", "checkpoint.every=3",
                    "--mesh", "data=2,expert=4", "--coordinator", f"localhost:{port}",
                    "--num-processes", "2", "--process-id", str(i), popen=True,
                    extra_env=four) for i in range(2)]
    outputs = [p.communicate(timeout=400) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    assert "in 2 process(es)" in outputs[0][0]
    _assert_same_history(_history(tmp_path), _history(straight))

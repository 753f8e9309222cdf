"""``experiments.train --mesh pipe=4,data=2 --schedule S`` logs the losses of ``--mesh
data=1``, and a checkpoint written under one schedule and pipe size resumes under another.

Oracle: the same CLI on one device (the whole-batch step), same seed and data order.
One chain of two runs, one step each (every run compiles its schedule's step and saves a
checkpoint, the bulk of the time), 9 layers (DualPipeV on 4 ranks needs 8 stages). The 8
MoE blocks are stored split over the pipe; the 1 dense block is padded to 4 rows on pipe=4
and 2 on pipe=2, so resuming moves the layers between schedules' stages and restores the
dense stack with other padding. DualPipe's step on 4 ranks is checked against the same
oracle in tests/test_pipeline_executor.py (a third run here took 40 s of the CPU suite).
"""

from __future__ import annotations

import json

import pytest

from experiments import train

COMMON = ["--preset", "tiny", "--set", "model.num_hidden_layers=9", "--set", "train.seq_len=16",
          "--set", "train.batch_size=16", "--set", "train.warmup_steps=0",
          "--set", "train.schedule_steps=3",  # the same LR per step whatever --steps says
          "--set", "train.eval_every=0", "--set", "checkpoint.every=2",
          "--set", "checkpoint.async_save=false"]


def _losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _train(run_dir, *args: str) -> dict[int, float]:
    assert train.main([*COMMON, "--run-dir", str(run_dir), *args]) == 0
    return _losses(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    return _train(tmp_path_factory.mktemp("one_device"), "--mesh", "data=1", "--steps", "2")


def _assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert got and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got), (got, want)


def test_schedules_resume_each_other_and_log_the_one_device_losses(reference, tmp_path):
    """DualPipeV on pipe=4 runs step 1; 1F1B on pipe=2 resumes its checkpoint for step 2."""
    _assert_same(_train(tmp_path, "--mesh", "pipe=4,data=2", "--schedule", "dualpipev",
                        "--microbatches", "8", "--steps", "1"), reference)
    resumed = _train(tmp_path, "--mesh", "pipe=2,data=4", "--schedule", "1f1b", "--steps", "2",
                     "--resume")
    assert set(resumed) == {1, 2}
    _assert_same(resumed, reference)


def test_bad_pipeline_layout_is_rejected_before_any_work(tmp_path, capsys):
    assert train.main([*COMMON, "--run-dir", str(tmp_path), "--mesh", "pipe=4,data=2",
                       "--schedule", "dualpipev", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "train.microbatches=4" in err and "M >= 2P = 8" in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.gpu
def test_gpu_pipelined_training_compiles_with_the_default_attention(tmp_path, capsys):
    """On the host's GPUs, ``--mesh pipe=2`` with BF16 compute and ``train.attention=auto``
    runs XLA's attention and logs the whole-batch step's loss. With cuDNN's attention in
    it, XLA:GPU (jax 0.11.2) segfaulted compiling this step, for every schedule (session
    42)."""
    import jax

    n = jax.device_count()
    if n not in (2, 4, 8):  # the batch of 16 splits over 4 micro-batches x n/2 devices
        pytest.skip(f"needs 2, 4 or 8 GPUs, this host has {n}")
    bf16 = ["--set", "train.compute_dtype=bfloat16", "--set", "train.attention=auto"]
    want = _train(tmp_path / "whole", "--mesh", f"data={n}", "--steps", "1", *bf16)
    capsys.readouterr()
    got = _train(tmp_path / "pipe", "--mesh", f"pipe=2,data={n // 2}", "--steps", "1", *bf16)
    assert "attention core xla" in capsys.readouterr().out
    assert got and all(got[s] == pytest.approx(want[s], rel=2e-2) for s in got), (got, want)

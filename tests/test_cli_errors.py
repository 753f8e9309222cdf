"""The experiment entrypoints refuse a bad flag value at once, in one line naming the flag,
the value and what is allowed (argparse's usage error, exit status 2), where they used to
fail with a traceback deep in a run or after minutes of work. Nothing here measures."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax
import pytest

from experiments import (bench_gemm, bench_moe, bench_movement, cli, pipeline_study,
                         precision_study, train)

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")


def refused(main: Callable[[list[str]], object], argv: list[str], capsys) -> str:
    """The one error line ``main(argv)`` exits with (status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not captured.out
    return captured.err.strip().splitlines()[-1]


def test_shared_types_read_the_defaults_and_refuse_the_rest():
    assert cli.integers(1)("4096,,16384") == [4096, 16384] and cli.integers(1)("") == []
    assert cli.shapes("GxKxN")(bench_movement.WEIGHT_SHAPES)[0] == (64, 1024, 704)
    assert cli.number(0)("0") == 0.0 and cli.float_dtype("bfloat16") == "bfloat16"
    for parse, text in [(cli.integer(1), "1.5"), (cli.number(0, above=True), "0"),
                        (cli.number(0), "inf"), (cli.shapes("MxI"), "4x0"),
                        (cli.float_dtype, "int32")]:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{text}: (must|'{text}' is not)"):
            parse(text)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "abc"], "argument --tokens: abc: must be comma-separated integers >= 1"),
    (["--tokens", "0"], "argument --tokens: 0: must be comma-separated integers >= 1"),
    (["--tokens", "-64"], "argument --tokens: -64: must be comma-separated integers >= 1"),
    (["--moe-tokens", "8192,0"], "argument --moe-tokens: 8192,0: must be comma-separated"),
    (["--weights", "2x3"], "argument --weights: 2x3: '2x3' is not a GxKxN shape of sizes"),
    (["--swiglu", "98304x0"], "argument --swiglu: 98304x0: '98304x0' is not a MxI shape"),
    (["--repeats", "0"], "argument --repeats: 0: must be an integer >= 1"),
    (["--tune-tokens", "-1"], "argument --tune-tokens: -1: must be an integer >= 1"),
    (["--moe-tokens", "8192,1536"], "--moe-tokens 1536: must be <= 1024 or a multiple of 1024"),
])
def test_bench_movement_refuses_bad_sizes(argv, message, capsys):
    assert message in refused(bench_movement.main, argv, capsys)


@on_cpu
def test_bench_movement_refuses_compiled_kernels_on_cpu_before_measuring(capsys):
    """It used to time a 1 GiB copy (55 s) first, then fail every row."""
    line = refused(bench_movement.main, ["--tokens", "64"], capsys)
    assert "--interpret not given, and this process runs on cpu" in line


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "argument --seq-len: 0: must be an integer >= 1"),
    (["--seq-len", "-64"], "argument --seq-len: -64: must be an integer >= 1"),
    (["--tokens-per-device", "0"], "argument --tokens-per-device: 0: must be an integer >= 1"),
    (["--tokens-per-device", "-8"], "argument --tokens-per-device: -8: must be an integer"),
    (["--repeats", "0"], "argument --repeats: 0: must be an integer >= 1"),
    (["--dtype", "bogus"], "argument --dtype: bogus: must be a floating dtype"),
    (["--dtype", "int32"], "argument --dtype: int32: must be a floating dtype"),
    (["--preset", "bogus"], "--preset: unknown model preset 'bogus'; known: ["),
    (["--local-device-ids", "0"], "--local-device-ids 0: applies to a multi-process run; "
                                  "add --coordinator"),
])
def test_bench_moe_refuses_bad_values(argv, message, capsys):
    assert message in refused(bench_moe.main, ["--preset", "tiny", *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "bogus"], "--preset: unknown preset 'bogus'; known: ["),
    (["--set", "bogus"], "--set 'bogus': expected SECTION.FIELD=VALUE"),
    (["--set", "train.bogus=1"], "--set 'train.bogus=1': unknown field train.bogus"),
    (["--fit-seq", "-5"], "argument --fit-seq: -5: must be an integer >= 0"),
    (["--fit-seq", "5000"], "--fit-seq 5000 with --fit-cases none:bf16: train.seq_len=5000: "
                            "must be <= model.max_position_embeddings=1024"),
    (["--device-memory", "-1"], "argument --device-memory: -1: must be a finite number > 0"),
    (["--device-memory", "0"], "argument --device-memory: 0: must be a finite number > 0"),
    (["--device-memory", "nan"], "argument --device-memory: nan: must be a finite number > 0"),
])
def test_precision_study_refuses_bad_values_before_any_run(argv, message, capsys):
    line = refused(precision_study.main, ["--preset", "tiny", "--steps", "0", *argv], capsys)
    assert message in line


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"key": "bytes"}'])
def test_precision_study_refuses_a_file_that_is_not_a_fit_cache(text, tmp_path, capsys):
    path = tmp_path / "fit.json"
    path.write_text(text)
    line = refused(precision_study.main, ["--preset", "tiny", "--steps", "0", "--fit-seq", "32",
                                          "--fit-cache", str(path)], capsys)
    assert f"--fit-cache {path}: not a fit cache (" in line


@pytest.mark.parametrize("argv, message", [
    (["--f", "-1"], "argument --f: -1: must be a finite number >= 0"),
    (["--b", "-2"], "argument --b: -2: must be a finite number >= 0"),
    (["--comm", "-0.5"], "argument --comm: -0.5: must be a finite number >= 0"),
    (["--fb", "-3"], "argument --fb: -3: must be a finite number >= 0"),
    (["--f", "nan"], "argument --f: nan: must be a finite number >= 0"),
    (["--w", "inf"], "argument --w: inf: must be a finite number >= 0"),
    (["--w", "3"], "--w: w=3.0: W is part of B, so w <= b=2.0"),
    (["--layers", "0"], "argument --layers: 0: must be an integer >= 1"),
    (["--batch", "-1"], "argument --batch: -1: must be an integer >= 1"),
    (["--seq", "0"], "argument --seq: 0: must be an integer >= 1"),
    (["--repeats", "0"], "argument --repeats: 0: must be an integer >= 1"),
    (["--dtype", "bogus"], "argument --dtype: bogus: must be a floating dtype"),
    (["--measure", "--preset", "bogus"], "--preset: unknown model preset 'bogus'"),
    (["--measure", "--mesh", "bogus"], "--mesh 'bogus': 'bogus' must be AXIS=N"),
    (["--measure", "--mesh", "data=8"], "--mesh data=8: its pipe axis must equal --ranks 4"),
    (["--measure", "--batch", "12"], "--batch 12: must be a multiple of 8 (8 micro-batch(es) "
                                     "x the 1 data x expert devices of --mesh pipe=4,"),
    (["--fb-pair", "--batch", "1"], "--batch 1: must be a multiple of 2 (1 micro-batch(es) "
                                    "x the 2 data x expert devices of --mesh pipe=1,"),
    (["--fb-pair", "--mesh", "pipe=2"], "--fb-pair --mesh pipe=2: runs without a pipe axis"),
    (["--fb-pair", "--transport", "bogus"], "--transport: transport='bogus': must be one of"),
])
def test_pipeline_study_refuses_bad_values_by_name(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # --fb-pair adds to it
    assert message in refused(pipeline_study.main, argv, capsys)


@on_cpu
def test_bench_gemm_refuses_cpu_before_the_torch_worker_starts(capsys, monkeypatch):
    def no_torch(*args):
        raise AssertionError("the torch worker ran before the platform check")

    monkeypatch.setattr(bench_gemm, "run_torch", no_torch)
    assert bench_gemm.CPU_REFUSAL in refused(bench_gemm.main, ["--quick"], capsys)


def test_train_refuses_local_device_ids_without_coordinator(capsys):
    """distributed.initialize ignores them without --coordinator."""
    assert train.main(["--preset", "tiny", "--local-device-ids", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --local-device-ids 0: applies to a multi-process run; add "
                          "--coordinator HOST:PORT") and err.count("\n") == 1


def test_train_names_a_run_dir_it_cannot_create(tmp_path, capsys):
    run_dir = tmp_path / "a_file" / "run"
    run_dir.parent.write_text("")
    assert train.main(["--preset", "tiny", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run dir {run_dir} (--run-dir): [Errno 20] Not a directory")
    assert err.count("\n") == 1 and "Traceback" not in err

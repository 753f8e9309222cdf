"""The expert-parallel bench runs on CPU (8 simulated devices), so a change that breaks it
shows here rather than in a GPU session's device minutes."""

import math

import pytest

from experiments import bench_moe


def test_bench_prints_a_measured_row_per_configuration(capsys):
    bench_moe.main(["--preset", "tiny", "--expert", "1,2", "--tokens-per-device", "128",
                    "--seq-len", "64", "--dtype", "float32", "--repeats", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line and not line.startswith(("#", "expert"))]
    assert [row[:3] for row in rows] == [["1", "-", "-"], ["2", "padded", "compute"]]
    layer_ms, exchange_ms, exchange_rate, raw_rate = (float(rows[1][i]) for i in (3, 6, 7, 8))
    assert layer_ms > 0 and exchange_ms > 0 and exchange_rate > 0 and raw_rate > 0
    assert math.isnan(float(rows[0][6]))  # expert=1 exchanges nothing


@pytest.mark.parametrize("expert, message", [
    ("3", "--expert 3: [3] do not divide the 8 devices"),
    ("1,x", "--expert '1,x': expected a comma list of integers"),
])
def test_expert_sizes_that_make_no_mesh_are_refused_by_name(expert, message, capsys):
    with pytest.raises(SystemExit):
        bench_moe.main(["--preset", "tiny", "--expert", expert])
    assert message in capsys.readouterr().err

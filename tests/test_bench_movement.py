"""The movement bench's command line, checked on CPU before any device minute is spent."""

import pytest

from experiments import bench_movement


def test_an_only_that_names_no_op_is_refused_before_anything_is_measured(capsys):
    with pytest.raises(SystemExit):
        bench_movement.main(["--only", "nope"])
    captured = capsys.readouterr()
    assert "--only 'nope': no op's name contains it" in captured.err
    assert "combine (fwd)" in captured.err and "copy bandwidth" not in captured.out

"""Whole-file writes: a failure mid-write leaves the old file whole and no temporary."""

import pytest

from moejax.atomic_file import atomic_writer, write_atomically


def test_a_write_that_fails_midway_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.bin"
    write_atomically(path, b"old contents")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_writer(path) as f:
            f.write(b"new con")
            raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    write_atomically(path, "new contents")
    assert path.read_text() == "new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]

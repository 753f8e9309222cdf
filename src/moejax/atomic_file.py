"""Whole-file writes that a crash cannot half-do.

``open(path, "w")`` empties the old file before the new bytes arrive, so a process killed
mid-write loses both. Here the bytes go to a temporary file beside ``path`` (the same file
system, so the rename is atomic), are flushed to disk, and only then replace ``path``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends; an exception in the block
    leaves ``path`` as it was and removes the temporary file."""
    path = pathlib.Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    """``path`` holds ``data`` (text as UTF-8), or, after a crash, what it held before."""
    with atomic_writer(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)

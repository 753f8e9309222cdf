"""The embedded default corpus: the Python standard library's own source files.

Every machine that runs moejax has them, so ``--preset tiny`` trains from a fresh clone
with no download. The test suites are left out (they hold odd binary-ish fixtures). The
shards are built once per Python version and tokenizer and cached under ``data_cache/``.
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig
from typing import Iterator

from moejax.data.shards import META, DataError, iter_text_files, write_shards
from moejax.data.tokenizer import ByteTokenizer

EMBEDDED = "embedded"
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files minus tests, in a fixed (sorted) order."""
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIP_PARTS & set(p.relative_to(root).parts))


def stdlib_documents() -> Iterator[str]:
    for path in stdlib_files():
        yield path.read_text(encoding="utf-8", errors="replace")


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MOEJAX_DATA_CACHE", "data_cache"))


def embedded_shards(cache_dir: pathlib.Path | None = None, *,
                    heldout_every: int = 50) -> pathlib.Path:
    """The shard folder of the embedded corpus (byte tokenizer), built on first use."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    out = (cache_dir or default_cache_dir()) / f"stdlib-{version}-byte-h{heldout_every}"
    if not (out / META).is_file():
        if not stdlib_files():
            raise DataError(f"no standard-library sources under {stdlib_root()}")
        try:
            write_shards(stdlib_documents(), out, ByteTokenizer(),
                         source=f"python{sys.version_info.major}.{sys.version_info.minor} "
                                f"stdlib ({stdlib_root()})", heldout_every=heldout_every)
        except OSError as err:
            if not (out / META).is_file():  # else a concurrent writer finished it first
                raise DataError(f"{out}: cannot build the embedded corpus shards ({err}); "
                                "set MOEJAX_DATA_CACHE to a writable folder") from err
    return out


def resolve_data_dir(data_dir: str) -> pathlib.Path:
    """``embedded`` means the stdlib corpus; anything else is a shard folder path."""
    return embedded_shards() if data_dir == EMBEDDED else pathlib.Path(data_dir)


def text_folder_documents(folder: pathlib.Path, suffixes: tuple[str, ...]) -> Iterator[str]:
    """Documents of a user's text folder, or a DataError if it is missing or empty."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise DataError(f"data folder {folder} does not exist")
    if not any(p.is_file() and p.suffix in suffixes for p in folder.rglob("*")):
        raise DataError(f"data folder {folder} holds no files ending in {', '.join(suffixes)}")
    return iter_text_files(folder, suffixes)

"""Token shards on disk: flat ``.npy`` token arrays, memory-mapped when read.

A shard folder holds ``train-NNNNN.npy`` and ``val-NNNNN.npy`` (documents joined by EOS),
``tokenizer.json`` and ``meta.json`` (sizes, split, provenance). Writing goes to a
temporary folder renamed into place at the end, so a reader never sees half a folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import shutil
from typing import Iterable, Iterator

import numpy as np

from moejax.data.tokenizer import EOS_ID, Tokenizer, load_tokenizer

META = "meta.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "val")


class DataError(ValueError):
    """Input data is missing, empty or malformed; the message says which and where."""


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What ``meta.json`` records about a shard folder."""

    tokenizer: str
    vocab_size: int
    documents: dict[str, int]
    tokens: dict[str, int]
    source: str
    source_bytes: int


def is_heldout(index: int, every: int) -> bool:
    """Document ``index`` goes to the validation split when it is one of every ``every``."""
    return every > 0 and index % every == every - 1


def _sibling(out_dir: pathlib.Path, tag: str) -> pathlib.Path:
    """A fresh hidden path next to ``out_dir``, so renames between them stay on one disk."""
    return out_dir.parent / f".{out_dir.name}.{tag}-{secrets.token_hex(8)}"


def _install(tmp: pathlib.Path, out_dir: pathlib.Path, replace: bool) -> None:
    """Renames the finished ``tmp`` to ``out_dir``. With ``replace`` an old ``out_dir`` is
    moved aside first and deleted only once the new one is in place."""
    if not (replace and out_dir.exists()):
        os.rename(tmp, out_dir)  # fails if another writer got there first: theirs stands
        return
    old = _sibling(out_dir, "old")
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old)


def write_shards(documents: Iterable[str], out_dir: pathlib.Path, tokenizer: Tokenizer, *,
                 source: str, heldout_every: int = 50, shard_tokens: int = 1 << 24,
                 replace: bool = False) -> ShardInfo:
    """Tokenises ``documents`` (in order) into train/val shards under a new ``out_dir``;
    ``replace`` swaps out an existing ``out_dir``, which stays intact if this fails."""
    out_dir = pathlib.Path(out_dir)
    if replace and out_dir.exists() and not (out_dir / META).is_file():
        raise DataError(f"{out_dir} is not a shard folder (no {META}): only a folder of shards "
                        "is replaced, never other files")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A plain mkdir, not mkdtemp (mode 0700): the folder gets the umask's mode like any other.
    tmp = _sibling(out_dir, "tmp")
    tmp.mkdir()
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    buffers: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    filled = dict.fromkeys(SPLITS, 0)
    shard_ids = dict.fromkeys(SPLITS, 0)
    docs = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    source_bytes = 0

    def flush(split: str) -> None:
        if buffers[split]:
            path = tmp / f"{split}-{shard_ids[split]:05d}.npy"
            np.save(path, np.concatenate(buffers[split]).astype(dtype))
            shard_ids[split] += 1
            buffers[split], filled[split] = [], 0

    try:
        for i, text in enumerate(documents):
            ids = tokenizer.encode(text)
            if not len(ids):
                continue
            source_bytes += len(text.encode("utf-8", errors="replace"))
            split = "val" if is_heldout(i, heldout_every) else "train"
            buffers[split] += [ids, np.array([EOS_ID], np.int32)]
            filled[split] += len(ids) + 1
            docs[split] += 1
            tokens[split] += len(ids) + 1
            if filled[split] >= shard_tokens:
                flush(split)
        for split in SPLITS:
            flush(split)
        if not tokens["train"]:
            raise DataError(f"{source}: no text to train on (all documents empty)")
        info = ShardInfo(tokenizer=tokenizer.kind, vocab_size=tokenizer.vocab_size,
                         documents=docs, tokens=tokens, source=source,
                         source_bytes=source_bytes)
        (tmp / TOKENIZER).write_text(json.dumps(tokenizer.to_json()))
        (tmp / META).write_text(json.dumps(dataclasses.asdict(info), indent=1))
        _install(tmp, out_dir, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def read_info(shard_dir: pathlib.Path) -> ShardInfo:
    """The folder's metadata, or a DataError saying why it is not a shard folder."""
    meta = pathlib.Path(shard_dir) / META
    if not meta.is_file():
        raise DataError(f"{shard_dir}: not a shard folder (no {META}); "
                        "make one with `python -m experiments.prepare_data`")
    return ShardInfo(**json.loads(meta.read_text()))


def shard_tokenizer(shard_dir: pathlib.Path) -> Tokenizer:
    return load_tokenizer(pathlib.Path(shard_dir) / TOKENIZER)


def open_split(shard_dir: pathlib.Path, split: str) -> list[np.ndarray]:
    """The split's shards as read-only memory maps, in order."""
    paths = sorted(pathlib.Path(shard_dir).glob(f"{split}-*.npy"))
    return [np.load(p, mmap_mode="r") for p in paths]


def iter_text_files(folder: pathlib.Path, suffixes: tuple[str, ...]) -> Iterator[str]:
    """Text of every file under ``folder`` with one of ``suffixes``, in sorted path order."""
    for path in sorted(p for p in pathlib.Path(folder).rglob("*")
                       if p.is_file() and p.suffix in suffixes):
        yield path.read_text(encoding="utf-8", errors="replace")


def unigram_entropy(shard_dir: pathlib.Path, split: str = "train") -> float:
    """Entropy in nats/token of the split's token frequencies: what a context-free model
    can reach, so a model that learns must go well below it."""
    vocab = read_info(shard_dir).vocab_size
    counts = sum(np.bincount(np.asarray(s), minlength=vocab) for s in open_split(shard_dir, split))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

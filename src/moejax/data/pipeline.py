"""The Grain input pipeline: packed windows over memory-mapped shards.

Packing: documents are already joined by EOS in the shards, so the token stream is cut
into fixed windows of ``seq_len + 1`` tokens (inputs and shifted labels overlap by one),
with no padding. Windows never straddle two shards. The order is a Grain index shuffle
seeded by the run seed (reshuffled each epoch), the stream is sliced per data-parallel
process, and the iterator's position is a small dict that goes into every checkpoint.
"""

from __future__ import annotations

import dataclasses
import pathlib

import grain
import numpy as np

from moejax.data.shards import DataError, open_split


class PackedWindows:
    """Random-access source: window ``i`` is ``seq_len + 1`` consecutive tokens of a shard."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self._shards = shards
        self._seq_len = seq_len
        per_shard = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self._starts = np.cumsum([0] + per_shard)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        begin = (index - int(self._starts[shard])) * self._seq_len
        return np.asarray(self._shards[shard][begin:begin + self._seq_len + 1], dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
    """Everything that fixes the sequence of batches a process sees."""

    shard_dir: pathlib.Path
    split: str
    seq_len: int
    global_batch: int
    seed: int
    process_index: int = 0
    process_count: int = 1


def windows(spec: LoaderSpec) -> PackedWindows:
    shards = open_split(spec.shard_dir, spec.split)
    source = PackedWindows(shards, spec.seq_len)
    if len(source) < 1:  # a window never spans two shards
        raise DataError(f"{spec.shard_dir}: the {spec.split!r} split has no window of "
                        f"seq_len + 1 = {spec.seq_len + 1} tokens in one shard (it holds "
                        f"{sum(len(s) for s in shards)} tokens in {len(shards)} shard(s))")
    return source


def make_dataset(spec: LoaderSpec, *, shuffle: bool = True,
                 repeat: bool = True) -> grain.IterDataset:
    """Batches of ``(global_batch / process_count, seq_len + 1)`` int32 tokens."""
    if spec.global_batch % spec.process_count:
        raise DataError(f"global batch {spec.global_batch} does not split over "
                        f"{spec.process_count} processes")
    ds = grain.MapDataset.source(windows(spec))
    if shuffle:
        ds = ds.shuffle(seed=spec.seed)
    if repeat:
        ds = ds.repeat()
    ds = ds[spec.process_index::spec.process_count]
    ds = ds.batch(spec.global_batch // spec.process_count, drop_remainder=True)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))

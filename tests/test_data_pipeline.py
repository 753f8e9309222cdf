"""Shards and the Grain pipeline: packing, seeded order, per-process slices, resumption."""

import os
import random

import numpy as np
import pytest

from moejax.data import corpus
from moejax.data.corpus import embedded_shards, stdlib_files
from moejax.data.pipeline import LoaderSpec, make_dataset
from moejax.data.shards import (DataError, open_split, read_info, unigram_entropy,
                                write_shards)
from moejax.data.tokenizer import EOS_ID, ByteTokenizer


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    rng = random.Random(3)
    docs = ["".join(rng.choices("abcdefgh \n", k=rng.randint(50, 400))) for _ in range(60)]
    out = tmp_path_factory.mktemp("shards") / "s"
    # Small shards so windows must not straddle shard boundaries.
    write_shards(docs, out, ByteTokenizer(), source="random", heldout_every=10,
                 shard_tokens=2000)
    return out, docs


def _take(spec, n, **kw):
    it = iter(make_dataset(spec, **kw))
    return [next(it) for _ in range(n)]


def test_shards_hold_every_document_with_eos_and_the_heldout_split(shard_dir):
    out, docs = shard_dir
    info = read_info(out)
    assert info.documents == {"train": 54, "val": 6}
    train = np.concatenate(open_split(out, "train"))
    val = np.concatenate(open_split(out, "val"))
    assert len(open_split(out, "train")) > 1
    expect_val = [d for i, d in enumerate(docs) if i % 10 == 9]
    expect_train = [d for i, d in enumerate(docs) if i % 10 != 9]
    assert ByteTokenizer().decode(train) == "".join(expect_train)
    assert ByteTokenizer().decode(val) == "".join(expect_val)
    assert (train == EOS_ID).sum() == 54 and info.tokens["train"] == len(train)
    p = np.bincount(train, minlength=256) / len(train)
    p = p[p > 0]
    assert unigram_entropy(out) == pytest.approx(-(p * np.log(p)).sum())


def test_windows_are_packed_stream_slices_in_a_seeded_order(shard_dir):
    out, _ = shard_dir
    spec = LoaderSpec(out, "train", seq_len=16, global_batch=4, seed=5)
    shards = [np.asarray(s) for s in open_split(out, "train")]
    stream_windows = {tuple(s[i:i + 17]) for s in shards for i in range(0, len(s) - 16, 16)}
    batches = _take(spec, 6)
    assert all(b.shape == (4, 17) and b.dtype == np.int32 for b in batches)
    assert all(tuple(row) in stream_windows for b in batches for row in b)
    again = _take(spec, 6)
    other = _take(LoaderSpec(out, "train", 16, 4, seed=6), 6)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    assert not all(np.array_equal(a, b) for a, b in zip(batches, other))


def test_processes_see_disjoint_slices_of_the_global_stream(shard_dir):
    out, _ = shard_dir
    whole = np.concatenate(_take(LoaderSpec(out, "train", 16, 4, seed=1), 4))
    parts = [np.concatenate(_take(LoaderSpec(out, "train", 16, 4, seed=1, process_index=p,
                                             process_count=2), 4)) for p in range(2)]
    interleaved = np.stack(parts, axis=1).reshape(-1, 17)  # element i -> process i % 2
    np.testing.assert_array_equal(interleaved, whole)


def test_iterator_state_resumes_the_exact_sequence(shard_dir):
    out, _ = shard_dir
    spec = LoaderSpec(out, "train", 16, 4, seed=2)
    ds = make_dataset(spec)
    it = iter(ds)
    for _ in range(rng_steps := random.Random().randint(1, 50)):  # past one epoch too
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = iter(make_dataset(spec))
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed), want)
    assert rng_steps > 0


def test_too_little_data_and_a_non_shard_folder_are_clear_errors(tmp_path):
    write_shards(["tiny"], tmp_path / "small", ByteTokenizer(), source="x", heldout_every=0)
    with pytest.raises(DataError, match=r"'train' split has no window of seq_len \+ 1 = 65 "
                                        r"tokens in one shard \(it holds 5 tokens in 1 shard"):
        make_dataset(LoaderSpec(tmp_path / "small", "train", 64, 2, 0))
    with pytest.raises(DataError, match="no text"):
        write_shards(["", ""], tmp_path / "empty", ByteTokenizer(), source="x")
    with pytest.raises(DataError, match="not a shard folder"):
        read_info(tmp_path)


def test_embedded_corpus_is_the_stdlib_without_tests():
    files = stdlib_files()
    assert len(files) > 100
    assert not any("test" in p.parts or "site-packages" in p.parts for p in files)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_shard_folders_get_the_mode_of_a_plain_mkdir(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_shards(["text"], tmp_path / "s", ByteTokenizer(), source="x", heldout_every=0)
    finally:
        os.umask(old)
    assert (tmp_path / "s").stat().st_mode & 0o777 == mode


def test_embedded_corpus_build_errors_name_the_folder_and_the_os_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"file/cache/stdlib-.*cannot build.*Not a directory") as e:
        embedded_shards(tmp_path / "file" / "cache")
    assert isinstance(e.value.__cause__, NotADirectoryError)


def test_embedded_corpus_keeps_a_folder_a_concurrent_writer_finished_first(tmp_path,
                                                                          monkeypatch):
    def racing_write(docs, out, tokenizer, **kw):
        write_shards(["theirs"], out, tokenizer, source="other writer", heldout_every=0)
        return write_shards(["mine"], out, tokenizer, source="x", heldout_every=0)

    monkeypatch.setattr(corpus, "write_shards", racing_write)
    assert read_info(embedded_shards(tmp_path)).source == "other writer"

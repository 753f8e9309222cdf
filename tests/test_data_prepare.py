"""``python -m experiments.prepare_data``: text folder -> shards, and its error messages."""

import random

import numpy as np
import pytest

from experiments.prepare_data import main
from moejax.data.shards import open_split, read_info, shard_tokenizer


@pytest.fixture
def text_dir(tmp_path):
    rng = random.Random()
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    docs = {}
    for i in range(12):
        name = f"sub/doc{i:02d}.txt" if i % 2 else f"doc{i:02d}.txt"
        docs[name] = " ".join(rng.choice(["alpha", "beta", "gamma", "délta", "(x)", "42"])
                              for _ in range(rng.randint(20, 60)))
        (folder / name).write_text(docs[name])
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    return folder, [docs[k] for k in sorted(docs)]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_folder_becomes_shards_that_decode_to_the_files(text_dir, tmp_path, tokenizer, capsys):
    folder, docs = text_dir
    out = tmp_path / f"shards-{tokenizer}"
    assert main([str(folder), str(out), "--tokenizer", tokenizer, "--vocab-size", "300",
                 "--heldout-every", "4"]) == 0
    assert "held-out tokens (3 documents)" in capsys.readouterr().out
    info, tok = read_info(out), shard_tokenizer(out)
    assert info.tokenizer == tokenizer and info.documents == {"train": 9, "val": 3}
    train = np.concatenate(open_split(out, "train"))
    assert tok.decode(train) == "".join(d for i, d in enumerate(docs) if i % 4 != 3)
    if tokenizer == "bpe":
        # Six distinct words run out of repeated pairs before 300 ids.
        assert 256 < tok.vocab_size <= 300 and len(train) < 0.6 * sum(len(d) for d in docs)


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "exists").mkdir()
    for argv, message in [([str(tmp_path / "missing"), str(tmp_path / "o1")], "does not exist"),
                          ([str(tmp_path / "empty"), str(tmp_path / "o2")], "holds no files"),
                          ([str(tmp_path / "empty"), str(tmp_path / "exists")], "--overwrite")]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err
    assert (tmp_path / "exists").is_dir()


def test_overwrite_swaps_in_the_new_folder_and_keeps_the_old_one_if_the_build_fails(
        text_dir, tmp_path, capsys):
    folder, _ = text_dir
    out = tmp_path / "shards"
    assert main([str(folder), str(out), "--heldout-every", "0"]) == 0
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    assert main([str(tmp_path / "blank"), str(out), "--overwrite"]) == 2
    assert "no text to train on" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert main([str(folder), str(out), "--overwrite", "--heldout-every", "4"]) == 0
    assert read_info(out).documents == {"train": 9, "val": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank", "shards", "texts"]


def test_overwrite_never_deletes_what_is_not_a_shard_folder(text_dir, tmp_path, capsys):
    """--overwrite replaced whatever OUT named: the source folder itself (its text gone), an
    unrelated folder, or a file (moved aside, then a traceback)."""
    folder, _ = text_dir
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    plain = tmp_path / "plain.txt"
    plain.write_text("a file")
    for out, message in [(folder, "is or holds the source folder"),
                         (tmp_path, "is or holds the source folder"),
                         (other, "is not a shard folder"),
                         (plain, "is not a shard folder"),
                         (plain / "under", "plain.txt")]:
        assert main([str(folder), str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert (other / "keep.txt").read_text() == "mine" and plain.read_text() == "a file"
    assert main([str(folder), str(tmp_path / "s"), "--tokenizer", "bpe",
                 "--bpe-sample-mb", "0"]) == 2
    assert "--bpe-sample-mb=0.0: must be > 0" in capsys.readouterr().err

"""Tokenizers that need no download: raw bytes, or a byte-level BPE trained locally.

Both reserve id 0 as the document separator (EOS): text files never hold NUL bytes, so
the byte tokenizer keeps all 256 ids and still has an unambiguous separator.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
from typing import Iterable, Protocol

import numpy as np

EOS_ID = 0
# Words for BPE: runs of letters, of digits, of other symbols, each with its leading space.
_WORD_RE = re.compile(r" ?[A-Za-z_]+| ?[0-9]+| ?[^\sA-Za-z_0-9]+|\s+")


class Tokenizer(Protocol):
    """What the shard writer and the trainer need from a tokenizer."""

    kind: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> dict: ...


def _text_bytes(text: str) -> bytes:
    return text.encode("utf-8", errors="replace").replace(b"\x00", b"")


def _text_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The ids to decode (EOS left out), each checked against the vocabulary: a model whose
    head is wider than its tokenizer can sample ids no piece stands for, and a negative id
    would index a piece list from its end."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the tokenizer's vocabulary "
                         f"0..{vocab_size - 1} ({len(bad)} such ids of {len(ids)})")
    return [i for i in ids if i != EOS_ID]


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 (NUL) doubles as EOS."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(_text_bytes(text), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(_text_ids(ids, self.vocab_size)).decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.kind}


class BPETokenizer:
    """Byte-level BPE: ids 0..255 are bytes, each later id merges the pair ``merges[id-256]``."""

    kind = "bpe"

    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = [tuple(m) for m in merges]
        self.vocab_size = 256 + len(self.merges)
        self._rank = {pair: 256 + i for i, pair in enumerate(self.merges)}
        self._cache: dict[bytes, list[int]] = {}
        self._pieces: list[bytes] = [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            self._pieces.append(self._pieces[a] + self._pieces[b])

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Learns ``vocab_size - 256`` merges, updating pair counts only where a merge lands."""
        if vocab_size <= 256:
            raise ValueError(f"vocab_size={vocab_size}: BPE needs more than the 256 byte ids")
        freq: collections.Counter[bytes] = collections.Counter()
        for text in texts:
            freq.update(w.encode() for w in _WORD_RE.findall(_text_bytes(text).decode()))
        words = [list(w) for w in freq]
        counts = list(freq.values())
        pairs: collections.Counter[tuple[int, int]] = collections.Counter()
        where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
        for i, w in enumerate(words):
            for pair in zip(w, w[1:]):
                pairs[pair] += counts[i]
                where[pair].add(i)
        merges: list[tuple[int, int]] = []
        while len(merges) < vocab_size - 256 and pairs:
            best = max(pairs, key=lambda p: (pairs[p], p))
            if pairs[best] < 2:
                break
            new_id = 256 + len(merges)
            merges.append(best)
            for i in where.pop(best):
                w, c = words[i], counts[i]
                for pair in zip(w, w[1:]):
                    pairs[pair] -= c
                words[i] = w = _merge(w, best, new_id)
                for pair in zip(w, w[1:]):
                    pairs[pair] += c
                    where[pair].add(i)
            pairs = +pairs  # drop the pairs whose count fell to zero
        return cls(merges)

    def _encode_word(self, word: bytes) -> list[int]:
        if word not in self._cache:
            ids = list(word)
            while len(ids) > 1:
                ranked = [(self._rank.get(p, 1 << 30), p) for p in zip(ids, ids[1:])]
                rank, pair = min(ranked)
                if rank == 1 << 30:
                    break
                ids = _merge(ids, pair, rank)
            self._cache[word] = ids
        return self._cache[word]

    def encode(self, text: str) -> np.ndarray:
        words = _WORD_RE.findall(_text_bytes(text).decode())
        ids = [i for w in words for i in self._encode_word(w.encode())]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self._pieces[i] for i in _text_ids(ids, self.vocab_size)).decode(
            "utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"kind": self.kind, "merges": [list(m) for m in self.merges]}


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def tokenizer_from_json(spec: dict) -> Tokenizer:
    """Rebuilds the tokenizer a shard folder was written with."""
    if spec["kind"] == "byte":
        return ByteTokenizer()
    if spec["kind"] == "bpe":
        return BPETokenizer([tuple(m) for m in spec["merges"]])
    raise ValueError(f"unknown tokenizer kind {spec['kind']!r}")


def load_tokenizer(path: pathlib.Path) -> Tokenizer:
    return tokenizer_from_json(json.loads(path.read_text()))

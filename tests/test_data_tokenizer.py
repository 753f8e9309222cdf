"""Tokenizers: exact round trips on fresh random text, BPE actually compresses."""

import random
import string

import numpy as np
import pytest

from moejax.data.tokenizer import (EOS_ID, BPETokenizer, ByteTokenizer,
                                   tokenizer_from_json)


def _vocabulary(rng: random.Random) -> list[str]:
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7)))
            for _ in range(40)] + ["def", "return", "(", ")", "é", "→", "42", "\n", "    "]


def _random_text(rng: random.Random, words: int, vocab: list[str] | None = None) -> str:
    vocab = vocab or _vocabulary(rng)
    return " ".join(rng.choice(vocab) for _ in range(words))


def test_byte_round_trip_and_eos_is_never_a_text_token():
    text = _random_text(random.Random(1), 300) + "\x00tail"
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < tok.vocab_size
    assert EOS_ID not in ids
    assert tok.decode(ids) == text.replace("\x00", "")


def test_bpe_round_trips_compresses_and_survives_json():
    rng = random.Random(7)
    words = _vocabulary(rng)
    train = [_random_text(rng, 400, words) for _ in range(5)]
    tok = BPETokenizer.train(train, vocab_size=400)
    assert tok.vocab_size == 400
    unseen = _random_text(random.Random(99), 300, words)  # same words, new sequence
    ids = tok.encode(unseen)
    assert tok.decode(ids) == unseen
    assert len(ids) < 0.5 * len(unseen.encode())  # merges learnt on similar text apply
    again = tokenizer_from_json(tok.to_json())
    np.testing.assert_array_equal(again.encode(unseen), ids)
    assert EOS_ID not in ids


@pytest.mark.parametrize("make", [ByteTokenizer, lambda: BPETokenizer([(104, 105)])])
def test_decode_names_an_id_outside_the_vocabulary(make):
    """A model's head may be wider than its tokenizer; a negative id must not wrap around."""
    tokenizer = make()
    assert tokenizer.decode([104, 105]) == "hi"
    for bad in (tokenizer.vocab_size, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the tokenizer's "
                                             rf"vocabulary 0..{tokenizer.vocab_size - 1}"):
            tokenizer.decode([104, bad])

"""The byte-level BPE tokenizer: exact round trip on held-out code, special tokens, plain template."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer
from vllm_hybridspec.train.reference.corpus import build_split
from vllm_hybridspec.train.reference.tokenizer import EOS, MASK, encode_documents, train_tokenizer
from ..seeds import fresh_seed


@pytest.fixture(scope="module")
def split_and_tokenizer(tmp_path_factory):
    split = build_split(heldout_percent=5)
    rng = random.Random(0)
    train = rng.sample(split.texts("train"), 40)
    tok = train_tokenizer(train, vocab_size=600)
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return split, AutoTokenizer.from_pretrained(path)


def test_round_trip_on_heldout_code(split_and_tokenizer):
    split, tok = split_and_tokenizer
    rng = random.Random(fresh_seed("reference_tokenizer_round_trip_on_heldou"))
    for text in rng.sample(split.texts("heldout"), 5):
        start = rng.randrange(max(1, len(text) - 2000))
        piece = text[start : start + 2000]
        ids = tok(piece, add_special_tokens=False).input_ids
        assert tok.decode(ids) == piece
        assert len(ids) < len(piece.encode())  # merges compress code
    odd = "x = '\u00e9\u4e2d\U0001f600'\t\r\n"
    assert tok.decode(tok(odd, add_special_tokens=False).input_ids) == odd


def test_special_tokens_and_template(split_and_tokenizer):
    _, tok = split_and_tokenizer
    assert len(tok) == 600
    assert tok.eos_token == EOS and tok.pad_token == EOS and tok.mask_token == MASK
    assert tok.convert_tokens_to_ids([EOS, MASK]) == [0, 1]
    text = "def f(x):\n    return x\n"
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    assert rendered == text
    docs = encode_documents(tok, ["a = 1\n", "b = 2\n"])
    assert [d[-1] for d in docs] == [0, 0] and tok.decode(docs[0][:-1]) == "a = 1\n"

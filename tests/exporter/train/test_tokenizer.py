"""The tokenizer: byte-level BPE that gives back every text exactly, special tokens first."""

from __future__ import annotations

import json

import pytest

from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.exporter.train.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    save_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus.train[:40], vocab_size=512)


def test_every_heldout_file_round_trips(tokenizer, corpus):
    for path, text in zip(corpus.heldout_paths, corpus.heldout):
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text, path


def test_text_it_never_saw_round_trips(tokenizer):
    text = "café 中文 🙂 \t\r\n  trailing  "
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_come_first(tokenizer):
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.get_vocab_size() == 512


def test_training_is_deterministic(tokenizer, corpus):
    assert train_tokenizer(corpus.train[:40], vocab_size=512).to_str() == tokenizer.to_str()


def test_saved_in_hugging_face_layout(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["eos_token"], config["pad_token"]) == ("<|endoftext|>", "<|pad|>")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


@pytest.mark.parametrize("texts, vocab_size, seed, message", [
    (["x"], 100, 0, "vocab_size 100: expected an integer of at least 259"),
    (["x"], 512, "0", "seed '0': expected an integer"),
    ("text", 512, 0, "texts: expected a non-empty sequence of strings"),
    ([], 512, 0, "texts: expected"),
])
def test_bad_arguments_are_named(texts, vocab_size, seed, message):
    with pytest.raises(ValueError, match=message):
        train_tokenizer(texts, vocab_size, seed)

"""Engram's token map from a tokenizer.json, against an expectation written with unicodedata.

The tokenizer is a byte-level BPE built here (no file is downloaded): GPT-2's 256 byte
symbols, then tokens that differ only by case, accents, compatibility form or surrounding
whitespace (which must share a compressed id), whitespace-only tokens, lone bytes of a
multi-byte character (each keyed by its raw token string), and added special tokens.
"""

from __future__ import annotations

import re
import unicodedata

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from b12x_toolchain.exporter.model.engram_token_map import (
    check_token_map,
    compressed_token_map,
    identity_token_map,
)

WORDS = ["hello", "Hello", " hello", "HELLO", " Hello ", "café", "cafe", " CAFÉ", "ﬁne", "fine", "Ｈello",
         " ", "  ", "\n", " \t\n", "é"]
SPECIAL = ["<|begin|>", "<|end|>"]
LONE_BYTES = ["\u00c3", "\u00a9"]  # byte-level symbols of 0xC3 and 0xA9: half of "é" each


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table, the one byte-level BPE stores tokens in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def encode_symbols(text: str) -> str:
    table = byte_symbols()
    return "".join(table[b] for b in text.encode())


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    symbols = byte_symbols()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbols[b]: b for b in range(256)}
    for word in WORDS:
        vocab.setdefault(encode_symbols(word), len(vocab))
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def expected_key(raw: str, text: str) -> str:
    """DeepSeek's rule, written with unicodedata and re (not the tokenizers normalizers)."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = " " if s == " " else s.strip()
    return s or text


def expected_map(path) -> list[int]:
    tok = Tokenizer.from_file(str(path))
    inverse = {symbol: byte for byte, symbol in byte_symbols().items()}
    ids: dict[str, int] = {}
    out = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        raw = tok.id_to_token(token_id)
        text = raw if raw in SPECIAL else bytes(inverse[c] for c in raw).decode("utf-8", errors="replace")
        out.append(ids.setdefault(expected_key(raw, text), len(ids)))
    return out


def test_map_matches_the_rule(tokenizer_json):
    want = expected_map(tokenizer_json)
    size = max(want) + 1
    got = compressed_token_map(tokenizer_json, len(want) + 5, size, pad_id=2)
    assert got.dtype == torch.int64 and got.tolist() == want + [2] * 5
    check_token_map(got, len(want) + 5, size)

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = {w: tok.token_to_id(encode_symbols(w)) for w in WORDS}

    def same(*words):
        return len({int(got[ids[w]]) for w in words}) == 1

    assert same("hello", "Hello", " hello", "HELLO", " Hello ", "Ｈello")
    assert same("café", "cafe", " CAFÉ") and same("ﬁne", "fine")
    assert same(" ", "  ", "\n", " \t\n") and not same(" ", "hello")
    # "é" is whole UTF-8: its key is "e", the byte symbol "e"'s. Its two bytes alone are not:
    # each keeps its raw symbol as key, so neither joins "e" nor the other.
    assert int(got[ids["é"]]) == int(got[ord("e")])
    halves = [int(got[tok.token_to_id(s)]) for s in LONE_BYTES]
    assert len(set(halves)) == 2 and int(got[ord("e")]) not in halves
    assert int(got[tok.token_to_id(SPECIAL[0])]) != int(got[tok.token_to_id(SPECIAL[1])])


def test_refusals(tokenizer_json, tmp_path):
    size = max(expected_map(tokenizer_json)) + 1
    length = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    with pytest.raises(ValueError, match=f"normalise to {size} distinct keys; .* compressed_vocab_size is {size + 1}"):
        compressed_token_map(tokenizer_json, length, size + 1)
    with pytest.raises(ValueError, match=f"the tokenizer has {length} ids; the model's vocab_size is {length - 1}"):
        compressed_token_map(tokenizer_json, length - 1, size)
    with pytest.raises(ValueError, match="no pad_id"):
        compressed_token_map(tokenizer_json, length + 1, size)
    with pytest.raises(ValueError, match="does not exist"):
        compressed_token_map(tmp_path / "tokenizer.json", length, size)
    assert compressed_token_map(tokenizer_json, length, size).tolist() == expected_map(tokenizer_json)


def test_identity_map():
    assert identity_token_map(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    check_token_map(identity_token_map(7, 3), 7, 3)


@pytest.mark.parametrize("tensor, message", [
    (torch.tensor([0, 1, 2], dtype=torch.int32), r"int32 \[3\]; expected int64 \[4\]"),
    (torch.tensor([0, 1, 2], dtype=torch.int64), r"int64 \[3\]; expected int64 \[4\]"),
    (torch.tensor([0, 1, 3, 2]), r"token 2 maps to 3; expected 0 <= id < compressed_vocab_size 3"),
    (torch.tensor([0, -1, 1, 2]), r"token 1 maps to -1"),
    (torch.tensor([0, 0, 2, 2]), r"no token maps to compressed id 1 \(1 unused\)"),
])
def test_malformed_maps_refused(tensor, message):
    with pytest.raises(ValueError, match=f"model.engram.token_map: {message}"):
        check_token_map(tensor, 4, 3)

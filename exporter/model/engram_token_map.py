"""Engram's token map: token id -> compressed id, the ids Engram hashes into n-grams.

DeepSeek V4.1 hashes n-grams of *compressed* ids: tokens whose text differs only by case,
accents, Unicode compatibility form or surrounding whitespace share one id. DeepSeek's
reference derives the map from the tokenizer (`build_compressed_token_map`), and
`compressed_token_map` does the same from a tokenizer.json with the `tokenizers` library:

- walk the ids 0 .. len(tokenizer)-1 and decode each alone (`skip_special_tokens=False`);
- a text holding U+FFFD (a byte-level token that is not whole UTF-8) is keyed by its raw
  token string, so each such piece keeps its own id;
- otherwise the key is the text normalised NFKC -> NFD -> strip accents -> lowercase ->
  runs of `[ \\t\\r\\n]` to one space -> a text that is just one space kept as " " ->
  strip; a key that comes out empty is the raw text;
- compressed ids are given to keys in first-seen order.

The embedding may have more rows than the tokenizer has ids (DeepSeek pads 128,815-odd
ids to 129,280). No tokenizer produces those ids, and decoding them gives nothing, so the
reference has no key for them; here they map to `pad_id`, the compressed id Engram's
hashing already uses for "no token" (a caller without one is refused when there are
such ids). The number of distinct keys must be the recipe's compressed_vocab_size.

Random-weight exports use `identity_token_map`, id mod compressed_vocab_size.
`check_token_map` refuses a map that cannot be one (a b12x-layout checkpoint may store it).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["check_token_map", "compressed_token_map", "identity_token_map", "token_map_keys"]

REPLACEMENT = "\ufffd"
SENTINEL = "\ue000"  # keeps a lone space through Strip


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(SENTINEL, " "),
    ])


def _tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("the Engram token map is derived with the `tokenizers` library, which is not installed "
                         "(pip install tokenizers)") from None
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: " + ("not a regular file" if path.exists() else "does not exist") +
                         "; the Engram token map is derived from the tokenizer")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{path}: not readable as a tokenizer ({exc})") from None


def token_map_keys(tokenizer) -> list[str]:
    """Each id's key (the text compressed ids are given by), in id order: DeepSeek's rule."""
    normalizer = _normalizer()
    keys = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT in text:
            keys.append(tokenizer.id_to_token(token_id))
        else:
            keys.append(normalizer.normalize_str(text) or text)
    return keys


def compressed_token_map(tokenizer_json_path, vocab_size: int, compressed_vocab_size: int, *,
                         pad_id: int | None = None) -> torch.Tensor:
    """int64 [vocab_size]: each token id's compressed id, from a tokenizer.json (module docstring).

    Ids from the tokenizer's length up to vocab_size map to `pad_id`; a ValueError when there
    are such ids and no pad_id, when the tokenizer has more ids than vocab_size, or when its
    distinct keys are not compressed_vocab_size."""
    path = Path(tokenizer_json_path)
    keys = token_map_keys(_tokenizer(path))
    if len(keys) > vocab_size:
        raise ValueError(f"{path}: the tokenizer has {len(keys)} ids; the model's vocab_size is {vocab_size}")
    first_seen: dict[str, int] = {}
    ids = [first_seen.setdefault(key, len(first_seen)) for key in keys]
    if len(first_seen) != compressed_vocab_size:
        raise ValueError(f"{path}: the tokenizer's {len(keys)} ids normalise to {len(first_seen)} distinct keys; "
                         f"the recipe's engram compressed_vocab_size is {compressed_vocab_size}")
    padded = vocab_size - len(keys)
    if padded:
        if pad_id is None:
            raise ValueError(f"{path}: the tokenizer has {len(keys)} ids, fewer than vocab_size {vocab_size}, and no "
                             "pad_id was given for the other ids")
        if not 0 <= pad_id < compressed_vocab_size:
            raise ValueError(f"pad_id: {pad_id} is out of range; expected < compressed_vocab_size "
                             f"{compressed_vocab_size}")
        ids += [pad_id] * padded
    return torch.tensor(ids, dtype=torch.int64)


def identity_token_map(vocab_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: id mod compressed_vocab_size (random-weight exports; `token_map: identity`)."""
    if not 0 < compressed_vocab_size <= vocab_size:
        raise ValueError(f"compressed_vocab_size: {compressed_vocab_size}; expected 1 .. vocab_size {vocab_size}")
    return torch.arange(vocab_size, dtype=torch.int64) % compressed_vocab_size


def check_token_map(tensor: torch.Tensor, vocab_size: int, compressed_vocab_size: int,
                    name: str = "model.engram.token_map") -> None:
    """Refuse (ValueError naming `name`) a map that is not int64 [vocab_size] onto every id in
    [0, compressed_vocab_size)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: a {type(tensor).__name__}; expected an int64 tensor")
    if tensor.dtype != torch.int64 or tuple(tensor.shape) != (vocab_size,):
        raise ValueError(f"{name}: {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}; "
                         f"expected int64 [{vocab_size}]")
    if vocab_size == 0:
        return
    low, high = tensor.min().item(), tensor.max().item()
    if low < 0 or high >= compressed_vocab_size:
        bad = low if low < 0 else high
        token = int((tensor == bad).nonzero()[0])
        raise ValueError(f"{name}: token {token} maps to {bad}; expected 0 <= id < compressed_vocab_size "
                         f"{compressed_vocab_size}")
    used = torch.bincount(tensor, minlength=compressed_vocab_size)
    unused = (used == 0).nonzero().flatten()
    if len(unused):
        raise ValueError(f"{name}: no token maps to compressed id {int(unused[0])} ({len(unused)} unused); expected "
                         f"every id in [0, {compressed_vocab_size}) to be used")

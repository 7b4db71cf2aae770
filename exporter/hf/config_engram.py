"""DeepSeek V4.1's Engram keys in a config.json, read as the recipe's `model.engram` section."""

from __future__ import annotations

from typing import Any

from b12x_toolchain.exporter.errors import HfConfigError
from b12x_toolchain.exporter.hf.config_values import as_int, as_list, has_key, required

# DeepSeek V4.1's Engram keys -> the recipe's model.engram fields, with each value's minimum.
# engram_vocab_size is where the prime search starts, not a row count.
ENGRAM_KEYS = (
    ("max_ngram", "engram_max_ngram_size", 2), ("heads_per_order", "engram_n_heads", 1),
    ("head_dim", "engram_head_dim", 32), ("prime_search_start", "engram_vocab_size", 2),
    ("compressed_vocab_size", "engram_compressed_vocab_size", 1), ("pad_id", "engram_pad_token_id", 0),
)
ENGRAM_IDS, ENGRAM_ROWS = "engram_layer_ids", "engram_num_embeddings"


def engram_section(config: dict) -> dict[str, Any] | None:
    """The recipe's `model.engram` for a DeepSeek V4.1 config.json with Engram layers, or None
    for a config without any Engram key.

    The token map is `tokenizer`: DeepSeek's compressed ids come from the checkpoint's
    tokenizer.json. When the config states `engram_num_embeddings`, each layer's table rows,
    it must be the sum of that layer's primes (exporter/model/engram_hashing.py), or the
    hashes the exporter rebuilds would index another table than the checkpoint's.
    """
    keys = [ENGRAM_IDS, ENGRAM_ROWS, *(key for _, key, _ in ENGRAM_KEYS)]
    given = [key for key in keys if has_key(config, key)]
    if not given:
        return None
    why = f"; the config has Engram keys ({given[0]})"
    ids = as_list(required(config, ENGRAM_IDS, why), ENGRAM_IDS)
    section: dict[str, Any] = {"layer_ids": [as_int(v, f"{ENGRAM_IDS}[{i}]", 0) for i, v in enumerate(ids)]}
    if not ids or section["layer_ids"] != sorted(set(section["layer_ids"])):
        raise HfConfigError(f"{ENGRAM_IDS}: {ids!r}; expected distinct layer ids in increasing order")
    for field, key, minimum in ENGRAM_KEYS:
        section[field] = as_int(required(config, key, why), key, minimum)
    if section["head_dim"] % 32:
        raise HfConfigError(f"engram_head_dim: {section['head_dim']} is not a multiple of 32 (the tables' scale blocks)")
    section["token_map"] = "tokenizer"
    if has_key(config, ENGRAM_ROWS):
        _check_engram_rows(config[ENGRAM_ROWS], section)
    return section


def _check_engram_rows(rows: Any, e: dict[str, Any]) -> None:
    from b12x_toolchain.exporter.model.engram_hashing import layer_primes

    rows = as_list(rows, ENGRAM_ROWS)
    if len(rows) != len(e["layer_ids"]):
        raise HfConfigError(f"{ENGRAM_ROWS}: has {len(rows)} entries; {ENGRAM_IDS} names {len(e['layer_ids'])} layers")
    primes = layer_primes(e["prime_search_start"], e["layer_ids"], e["max_ngram"] - 1, e["heads_per_order"])
    for i, (layer, given) in enumerate(zip(e["layer_ids"], rows)):
        expected = sum(primes[layer])
        if as_int(given, f"{ENGRAM_ROWS}[{i}]") != expected:
            raise HfConfigError(f"{ENGRAM_ROWS}[{i}]: layer {layer}'s table has {given} rows; the sum of its "
                                f"{len(primes[layer])} primes from engram_vocab_size {e['prime_search_start']} "
                                f"is {expected}")

"""The closed vocabulary of what a buffer IS, as the manifest records it (format 3).

A server, the snapshot codec and `b12x verify` act on a buffer by its kind, never by
parsing its name: names are labels, kinds are the contract. A manifest naming a kind
outside this table is refused, so a runtime never guesses what an unknown buffer holds.
Adding a kind is a format minor bump (an older runtime refuses it by name).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    role: str  # the calling-convention role every buffer of this kind has
    owner: str | None = None  # "layer" (a target layer), "stage" (a draft stage) or None
    # How rows are addressed. Caches: "ring" (row = position % rows_per_slot) or "append"
    # (row = position // ratio). Staging: "paged" (history snapshot + appended rows, in
    # pages) or "per_position" (one row per position of the pass). None: not row-encoded.
    rows: str | None = None
    count_min: int | None = None  # inputs: a per-row count of tokens, at least this many
    # Paged caches and their block tables: the page pool (also the shape symbol of its
    # page count). A paged cache is [pool, page_bytes]; its block table is int32
    # [rows, pages_per_slot], one page id (or -1) per page of a row's tokens.
    pool: str | None = None


POOLS = ("entry_pages", "index_key_pages")
# A token id is an int32: the token_ids input's dtype, and the little-endian bytes the prefix
# caches store and compare prompts as (runtime/prefix/keys.py).
TOKEN_BYTES = 4


KINDS: dict[str, Kind] = {
    # Persistent caches: paged (entries and index keys, in the caller's pages) or per slot.
    "compressed_entries": Kind("cache", "layer", "append", pool="entry_pages"),  # one entry per `ratio` positions
    "index_keys": Kind("cache", "layer", "append", pool="index_key_pages"),  # the indexer's key per entry
    "window_ring": Kind("cache", "layer", "ring"),  # the last `history` window rows of a layer
    "compressor_state": Kind("cache", "layer", "ring"),  # raw [kv | gate] rows of open groups
    "index_compressor_state": Kind("cache", "layer", "ring"),  # the same for the indexer's keys
    "draft_window": Kind("cache", "stage", "ring"),  # a draft stage's window ring
    "draft_hidden": Kind("cache", "stage", "ring"),  # streams of the last committed position (one row)
    "seq_len": Kind("cache"),  # int32 per slot: the committed length
    "token_history": Kind("cache", None, "ring"),  # Engram: compressed ids of the last committed tokens
    # Staging, per pass row: written by verify/draft, made persistent by commit.
    "window_staging": Kind("staging", "layer", "paged"),
    "entry_staging": Kind("staging", "layer", "per_position"),
    "index_key_staging": Kind("staging", "layer", "per_position"),
    "state_staging": Kind("staging", "layer", "per_position"),
    "index_state_staging": Kind("staging", "layer", "per_position"),
    "draft_context_staging": Kind("staging", "stage", "per_position"),  # a stage's window rows to commit
    "draft_hidden_staging": Kind("staging", "stage", "per_position"),
    "draft_window_staging": Kind("staging", "stage", "paged"),  # the draft pass's own window
    "token_history_staging": Kind("staging", None, "per_position"),  # a verify row's compressed ids
    # Per-pass row inputs.
    "token_ids": Kind("input"),
    "slot_ids": Kind("input"),  # the slot each row runs in (padding rows: the scratch slot)
    "positions": Kind("input"),  # each row's first absolute position: its committed length
    "entry_block_table": Kind("input", pool="entry_pages"),  # pages of a row's compressed entries
    "index_key_block_table": Kind("input", pool="index_key_pages"),  # pages of a row's index keys
    "new_tokens": Kind("input", count_min=1),  # prefill: how many of the chunk's tokens are real
    "accepted_tokens": Kind("input", count_min=0),  # commit: how many staged rows become persistent
}

# What a pass output is. The manifest records no kind for outputs: an output's name is its
# kind (the exporter names outputs from this table; PassInfo.output_kinds reads them back).
OUTPUT_KINDS = {
    "logits": "float32 [rows, width, vocab]: next-token scores at each position of a row",
    "confidence": "float32 [rows, width]: the drafter's confidence in each drafted token",
    "next_positions": "int32 [rows]: each row's committed length after the pass",
}

BUFFER_ROLES = ("cache", "staging")  # described in the manifest's top-level `buffers` table
ENCODED_ROWS = ("ring", "append", "paged", "per_position")  # kinds whose rows are in a format


def block_table_kind(pool: str) -> str:
    return next(name for name, kind in KINDS.items() if kind.role == "input" and kind.pool == pool)


def kinds_for(role: str) -> tuple[str, ...]:
    return tuple(name for name, kind in KINDS.items() if kind.role == role)

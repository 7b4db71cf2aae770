"""How the exporter names the buffers, row inputs and outputs of its passes: one table.

A pass's modules must agree on every name — buffers.py declares a buffer, cache_io.py,
layers.py, the drafters and pass_modules.py look it up in the dicts a pass is handed —
so each name is made here and nowhere else. Names are labels for binding a graph's
inputs: what a buffer is travels in the manifest as its kind (runtime/package/kinds.py),
and the runtime goes by kind, never by these names.

A cache or staging buffer belongs to an owner, target layer i (`layer(i)`) or draft stage
s (`stage(s)`), and is called by its part within the owner (`local`):

    cache.<owner>.<part>            persistent, per slot or paged
    staging.<pass>.<owner>.<part>   what <pass> writes, for commit or to read back itself
"""

from __future__ import annotations

from b12x_toolchain.runtime.package.kinds import OUTPUT_KINDS

WINDOW = "window"  # the part of every window: a layer's or a stage's ring, and their staging

PARTS = {  # the part of an owner's buffer of each kind; a cache's staging has the cache's part
    "window_ring": WINDOW, "window_staging": WINDOW, "draft_window": WINDOW, "draft_window_staging": WINDOW,
    "compressed_entries": "compressed", "entry_staging": "compressed",
    "index_keys": "index", "index_key_staging": "index",
    "compressor_state": "state", "state_staging": "state",
    "index_compressor_state": "index_state", "index_state_staging": "index_state",
    "draft_hidden": "hidden", "draft_hidden_staging": "hidden",
    "draft_context_staging": "context",
}

SEQ_LEN = "cache.seq_len"  # caches without an owner: the committed length,
ENGRAM_HISTORY = "engram.history"  # and Engram's token history (local name: its staging shares it)

ROW_INPUTS = {  # the name of a pass's row input of each kind
    "token_ids": "tokens",
    "slot_ids": "row_ids",
    "positions": "positions",
    "new_tokens": "lengths",
    "accepted_tokens": "accept_len",
    "entry_block_table": "entry_block_table",
    "index_key_block_table": "index_key_block_table",
}


def layer(i: int) -> str:
    return f"layer{i}"


def stage(s: int) -> str:
    return f"draft{s}"


def local(kind: str, owner: str) -> str:
    """An owner's buffer of `kind`, without the cache or staging prefix."""
    return f"{owner}.{PARTS[kind]}"


def window(owner: str) -> str:
    """An owner's window ring, or its staging: a layer's and a draft stage's are named alike
    (every window kind has the part WINDOW), so the same code reads either."""
    return local("window_ring", owner)


def cache(local_name: str) -> str:
    return f"cache.{local_name}"


def staging(pass_name: str, local_name: str) -> str:
    return f"staging.{pass_name}.{local_name}"


def stage_cache(kind: str, s: int) -> str:
    return cache(local(kind, stage(s)))


def stage_staging(pass_name: str, kind: str, s: int) -> str:
    return staging(pass_name, local(kind, stage(s)))


def row_input(kind: str) -> str:
    return ROW_INPUTS[kind]


def row_inputs(inputs: dict, *kinds: str) -> tuple:
    """A pass's row input tensors of `kinds`, in that order."""
    return tuple(inputs[ROW_INPUTS[kind]] for kind in kinds)


def output(kind: str) -> str:
    """The manifest records no kind for outputs, so an output is named by its kind: the
    runtime reads it back by that name (PassInfo.output_kinds)."""
    if kind not in OUTPUT_KINDS:
        raise KeyError(f"output kind {kind!r} is not one of {sorted(OUTPUT_KINDS)} (runtime/package/kinds.py)")
    return kind

"""Op set v6 (namespace `b12x_toolchain`): every op that reads or writes a cache, the quantized linears and Engram.

Each op is a `torch.library` op (define.py) whose schema declares what it mutates, with a
plain-torch reference implementation (used on CPU, and on any device until a kernel is
registered for it) and a fake implementation so passes can be captured on the meta
device. On a machine with CUDA, `cuda_kernels` registers Triton kernels for CUDA tensors. Ops never validate indices: the session validates every input before a replay,
so a replay does no host work beyond the copies themselves.

Window rows live in a ring addressed by absolute position (`pos % capacity`). Verify and
draft build a staging buffer per layer: `history` rows snapshotted from the ring, then
the rows the pass computed. Commit copies accepted staging rows back into the ring.

Compressed entries and index keys live in pages [pages, page_bytes] that the caller owns;
a pass addresses them through per-row block tables, reads in the sparse ops and writes
through `write_slots`, whose slot mapping names the entry slot (page * entries_per_page +
record) of every row to write, -1 for none.
"""

from __future__ import annotations

import importlib.util

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import history_offsets, ring_index, token_view
from b12x_toolchain.runtime.ops.define import fake_for, reference_op
from b12x_toolchain.runtime.ops.namespace import NAMESPACE, OPSET_VERSION  # noqa: F401 (re-exported)
from b12x_toolchain.runtime.ops.sparse_ops import page_view

RAW_BYTES = "bytes"  # write_rows format for rows that are already encoded


def _encode(values: torch.Tensor, fmt: str) -> torch.Tensor:
    return values if fmt == RAW_BYTES else get_format(fmt).encode(values)


# ---------------------------------------------------------------- window staging ops


@reference_op(("staging",))
def window_snapshot(
    ring: torch.Tensor, staging: torch.Tensor, row_ids: torch.Tensor, positions: torch.Tensor,
    history: int, layout: str, page_size: int,
) -> None:
    """staging[r, :history] = ring[row_ids[r], positions[r]-history .. positions[r]-1]."""
    idx = ring_index(positions, history_offsets(history, ring.device), ring.shape[1])
    token_view(staging)[:, :history] = ring[row_ids.long()[:, None], idx]


@reference_op(("staging",))
def cache_append(
    staging: torch.Tensor, kv: torch.Tensor, history: int, layout: str, page_size: int, fmt: str,
) -> None:
    """Encode kv [rows, width, dim] and write it into staging after the history rows."""
    width = kv.shape[1]
    token_view(staging)[:, history : history + width] = get_format(fmt).encode(kv)


@reference_op(("staging",))
def window_snapshot_append(
    ring: torch.Tensor, staging: torch.Tensor, kv: torch.Tensor, row_ids: torch.Tensor,
    positions: torch.Tensor, history: int, layout: str, page_size: int, fmt: str,
) -> None:
    """window_snapshot then cache_append in one op; byte-identical to the pair."""
    view = token_view(staging)
    idx = ring_index(positions, history_offsets(history, ring.device), ring.shape[1])
    view[:, :history] = ring[row_ids.long()[:, None], idx]
    view[:, history : history + kv.shape[1]] = get_format(fmt).encode(kv)


@reference_op(())
def window_read(staging: torch.Tensor, tokens: int, dim: int, fmt: str) -> torch.Tensor:
    """Decode the first `tokens` staging rows of every pass row: [rows, tokens, dim] fp32."""
    return get_format(fmt).decode(token_view(staging)[:, :tokens], dim)


@reference_op(("ring",))
def window_commit(
    ring: torch.Tensor, staging: torch.Tensor, row_ids: torch.Tensor, positions: torch.Tensor,
    accept_len: torch.Tensor, history: int, width: int,
) -> None:
    """Copy the first accept_len[r] appended staging rows into the ring, byte for byte."""
    offsets = torch.arange(width, device=ring.device)
    keep = offsets[None, :] < accept_len.long()[:, None]
    slots = row_ids.long()[:, None].expand_as(keep)
    idx = ring_index(positions, offsets, ring.shape[1])
    ring[slots[keep], idx[keep]] = token_view(staging)[:, history : history + width][keep]


# ---------------------------------------------------------------- generic row ops


@reference_op(("cache",))
def write_rows(
    cache: torch.Tensor, values: torch.Tensor, row_ids: torch.Tensor, index: torch.Tensor,
    valid: torch.Tensor, fmt: str,
) -> None:
    """cache[row_ids[r], index[r, t]] = encode(values[r, t]) where valid[r, t].

    Callers guarantee the valid (slot, index) pairs are unique, so the write order does
    not matter. fmt "bytes" copies already-encoded rows (commit from staging).
    """
    r, t = valid.nonzero(as_tuple=True)  # one nonzero, then plain index gathers
    cache[row_ids.long()[r], index.long()[r, t]] = _encode(values[r, t], fmt)


@reference_op(("cache",))
def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Paged cache [pages, page_bytes]: entry slot slot_mapping[r, t] = encode(values[r, t]), where >= 0.

    A slot s is record s % entries_per_page of page s // entries_per_page. Callers
    guarantee the slots written are unique. fmt "bytes" copies already-encoded records.
    """
    record_bytes = values.shape[-1] if fmt == RAW_BYTES else get_format(fmt).row_bytes(values.shape[-1])
    pages = page_view(cache, record_bytes)
    r, t = (slot_mapping >= 0).nonzero(as_tuple=True)
    slots = slot_mapping.long()[r, t]
    pages[slots // pages.shape[1], slots % pages.shape[1]] = _encode(values[r, t], fmt)


@reference_op(())
def gather_rows(
    cache: torch.Tensor, row_ids: torch.Tensor, index: torch.Tensor, dim: int, fmt: str,
) -> torch.Tensor:
    """Decode cache[row_ids[r], index[r, t] % rows]: [R, T, dim] fp32 (callers mask)."""
    idx = torch.remainder(index.long(), cache.shape[1])
    return get_format(fmt).decode(cache[row_ids.long()[:, None], idx], dim)


@reference_op(("staging",))
def stage_rows(staging: torch.Tensor, values: torch.Tensor, fmt: str) -> None:
    """Encode values [rows, width, dim] into a flat staging buffer [rows, width, bytes]."""
    staging[:, : values.shape[1]] = get_format(fmt).encode(values)


@reference_op(())
def read_rows(staging: torch.Tensor, dim: int, fmt: str) -> torch.Tensor:
    return get_format(fmt).decode(staging, dim)


@reference_op(())
def round_trip(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """decode(encode(values)): what a later read of these rows from a cache returns."""
    return get_format(fmt).decode(get_format(fmt).encode(values), values.shape[-1])


@reference_op(("seq_len",))
def set_seq_len(seq_len: torch.Tensor, row_ids: torch.Tensor, values: torch.Tensor) -> None:
    seq_len[row_ids.long()] = values.to(seq_len.dtype)


# ---------------------------------------------------------------- fake implementations

for _op in (window_snapshot, cache_append, window_snapshot_append, window_commit, write_rows, write_slots,
            stage_rows, set_seq_len):
    fake_for(_op)(lambda *args, **kwargs: None)


@fake_for(window_read)
def _(staging, tokens, dim, fmt):
    return staging.new_empty((staging.shape[0], tokens, dim), dtype=torch.float32)


@fake_for(gather_rows)
def _(cache, row_ids, index, dim, fmt):
    return cache.new_empty((index.shape[0], index.shape[1], dim), dtype=torch.float32)


@fake_for(read_rows)
def _(staging, dim, fmt):
    return staging.new_empty((staging.shape[0], staging.shape[1], dim), dtype=torch.float32)


@fake_for(round_trip)
def _(values, fmt):
    return torch.empty_like(values, dtype=torch.float32)


from b12x_toolchain.runtime.ops.engram_ops import ENGRAM_OPS  # noqa: E402  (registers the Engram ops)
from b12x_toolchain.runtime.ops.mhc_ops import MHC_OPS  # noqa: E402  (registers the mHC op)
from b12x_toolchain.runtime.ops.quant_ops import QUANT_OPS  # noqa: E402  (registers the quantized linears)
from b12x_toolchain.runtime.ops.sparse_ops import SPARSE_OPS  # noqa: E402  (registers the sparse ops)

ops = getattr(torch.ops, NAMESPACE)
"""The registered namespace: modules that call the ops import this name, which guarantees
the registration above has run before any graph is built or loaded."""

OPS = {
    name: getattr(ops, name).default
    for name in ("window_snapshot", "cache_append", "window_snapshot_append", "window_read",
                 "window_commit", "write_rows", "write_slots", "gather_rows", "stage_rows", "read_rows",
                 "round_trip", "set_seq_len") + SPARSE_OPS + MHC_OPS + QUANT_OPS + ENGRAM_OPS
}
"""Every op of the op set by name; a graph using anything else in the namespace is refused."""

# Only where CUDA exists, and only for CUDA tensors: the CPU path never imports Triton.
CUDA_KERNELS = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
if CUDA_KERNELS:
    from b12x_toolchain.runtime.ops.cuda_kernels import register as _register_cuda_kernels

    _register_cuda_kernels()

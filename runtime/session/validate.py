"""Validation of bound buffers and replay inputs, before anything is written.

Ops do no bounds checks (a replay must not sync or branch on the host), so every value a
caller hands in is checked here first; an error names the buffer or input, the value
and what was expected, and leaves every cache untouched.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.errors import BufferError, InputError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.kinds import KINDS


def check_buffer(spec: BufferSpec, tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise BufferError(f"{spec.name}: expected a tensor, got {type(tensor).__name__}")
    if tensor.dtype != spec.torch_dtype:
        raise BufferError(f"{spec.name}: dtype {tensor.dtype} does not match the expected {spec.torch_dtype}")
    if tuple(tensor.shape) != tuple(shape):
        raise BufferError(f"{spec.name}: shape {tuple(tensor.shape)} does not match the expected {tuple(shape)} "
                          f"(symbolic {list(spec.shape)})")
    if tensor.device != device:
        raise BufferError(f"{spec.name}: on device {tensor.device}; the session runs on {device}")
    if not tensor.is_contiguous():
        raise BufferError(f"{spec.name}: strides {tensor.stride()} are not contiguous")


def _as_tensor(name: str, value, spec: BufferSpec, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype != spec.torch_dtype:
            raise InputError(f"{name}: dtype {value.dtype} does not match the expected {spec.torch_dtype}")
        if value.device != device:
            raise InputError(f"{name}: on device {value.device}; the session runs on {device}")
        return value
    try:
        return torch.tensor(value, dtype=spec.torch_dtype, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise InputError(f"{name}: cannot be read as {spec.dtype} values ({exc})") from None


def _in_range(name: str, values: torch.Tensor, low: int, high: int, what: str) -> None:
    bad = (values < low) | (values >= high)
    if bool(bad.any()):
        first = values[bad].flatten()[0].item()
        raise InputError(f"{name}: value {first} is out of range; expected {what} in [{low}, {high})")


def validate_inputs(session, info, values: dict) -> dict[str, torch.Tensor]:
    """Check a replay's values against the pass; inputs are found by their recorded kind
    (slot ids, positions, token ids, the count that `advances` names), not by name."""
    specs = {s.name: s for s in info.inputs if s.role == "input"}
    tables = set(info.block_tables.values())
    given_tables = tables & set(values)
    if given_tables and given_tables != tables:
        raise InputError(f"pass {info.name}: block tables {sorted(given_tables)} given without {sorted(tables - given_tables)}; "
                         "give every block table (caller-owned pages) or none (the session's pages)")
    if not given_tables:  # the session fills them from its own pages
        specs = {n: s for n, s in specs.items() if n not in tables}
    unknown, missing = set(values) - set(specs), set(specs) - set(values)
    if unknown or missing:
        raise InputError(f"pass {info.name}: inputs {sorted(specs)} expected; "
                         f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    tensors = {name: _as_tensor(name, values[name], specs[name], session.device) for name in specs}
    slots, positions = info.input_of("slot_ids"), info.input_of("positions")
    n = tensors[slots].shape[0] if tensors[slots].dim() == 1 else -1
    largest = max(session.buckets[info.name])
    if not 1 <= n <= largest:
        raise InputError(f"{slots}: {n} rows given; expected a 1-D list of 1 to {largest} rows")
    for name, tensor in tensors.items():
        expected = specs[name].resolve({"rows": n})
        if tuple(tensor.shape) != expected:
            raise InputError(f"{name}: shape {tuple(tensor.shape)} does not match the expected {expected}")
    row_ids = tensors[slots]
    _in_range(slots, row_ids, 0, session.slots, "a slot")
    if row_ids.unique().numel() != n:
        raise InputError(f"{slots}: {row_ids.tolist()} repeats a slot; each row needs its own slot")
    expected_pos = torch.tensor([session.seq_lens[s] for s in row_ids.tolist()], dtype=torch.int32)
    if not torch.equal(tensors[positions].cpu(), expected_pos):
        raise InputError(f"{positions}: {tensors[positions].tolist()} do not continue the slots' committed "
                         f"lengths {expected_pos.tolist()}")
    model = session.package.manifest["model"]
    for name in info.inputs_of("token_ids"):
        _in_range(name, tensors[name], 0, model["vocab_size"], "a token id")
    step = info.advances
    if step is not None:
        low = KINDS[specs[step].info.kind].count_min
        _in_range(step, tensors[step], low, info.width + 1, f"a row count of the {info.width}-wide pass")
    reach = tensors[positions].long() + (tensors[step].long() if step else info.width)
    _in_range(positions, reach, 0, model["max_seq_len"] + 1,
              f"{positions} + {step or 'width'} within max_seq_len")
    for pool, name in info.block_tables.items():
        if name in tensors:
            _check_block_table(name, tensors[name], session.pools[pool], tensors[positions].long(),
                               tensors[step].long() if step else torch.zeros_like(reach))
    return tensors


def _check_block_table(name: str, table: torch.Tensor, pool, positions, counts) -> None:
    """Caller-owned pages: ids in [-1, pages), and a page wherever the pass reads or writes."""
    _in_range(name, table, -1, pool.count, f"a page id of pool {pool.name} (or -1)")
    needed = -(-(positions + counts) // pool.tokens_per_page)
    columns = torch.arange(table.shape[1], device=table.device)[None, :]
    missing = (columns < needed.to(table.device)[:, None]) & (table < 0)
    if bool(missing.any()):
        row, column = (int(v) for v in missing.nonzero()[0])
        raise InputError(f"{name}: row {row} has no page at column {column}; the pass reads or writes its tokens "
                         f"up to {int(positions[row] + counts[row])} ({pool.tokens_per_page} per page)")

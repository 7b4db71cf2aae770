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
from b12x_toolchain.runtime.session.device import session_device


def concrete_device(device) -> torch.device:
    """`device` as tensors on it report theirs: a bare "cuda" is the current CUDA device,
    cuda:N (a tensor made on "cuda" says cuda:0, and torch.device("cuda") != "cuda:0").
    A device the runtime cannot run on here is refused (device.py: the one check for the
    loader API, `b12x run` and `b12x serve`)."""
    return session_device(device)


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
    """Check a replay's values, given by input kind (kinds.py), against the pass; returns
    them as tensors by kind. Errors name the kind the caller gave, never an input's name."""
    specs = {s.info.kind: s for s in info.inputs if s.role == "input"}  # one per kind (contract.py)
    unknown = [kind for kind in values if kind not in specs]
    if unknown:
        raise InputError(f"pass {info.name}: no input of kind {unknown[0]!r}{_named(info, unknown[0])}; "
                         f"it takes kinds {list(specs)}")
    tables = {kind for kind in specs if KINDS[kind].pool is not None}
    given_tables = tables & set(values)
    if given_tables and given_tables != tables:
        raise InputError(f"pass {info.name}: block tables {sorted(given_tables)} given without {sorted(tables - given_tables)}; "
                         "give every block table (caller-owned pages) or none (the session's pages)")
    if not given_tables:  # the session fills them from its own pages
        specs = {k: s for k, s in specs.items() if k not in tables}
    missing = [kind for kind in specs if kind not in values]
    if missing:
        raise InputError(f"pass {info.name}: inputs of kinds {list(specs)} expected; missing {missing}")
    tensors = {kind: _as_tensor(kind, values[kind], specs[kind], session.device) for kind in specs}
    n = tensors["slot_ids"].shape[0] if tensors["slot_ids"].dim() == 1 else -1
    largest = max(session.buckets[info.name])
    if not 1 <= n <= largest:
        raise InputError(f"slot_ids: {n} rows given; expected a 1-D list of 1 to {largest} rows")
    for kind, tensor in tensors.items():
        expected = specs[kind].resolve({"rows": n})
        if tuple(tensor.shape) != expected:
            raise InputError(f"{kind}: shape {tuple(tensor.shape)} does not match the expected {expected}")
    slots, positions = tensors["slot_ids"], tensors["positions"]
    _in_range("slot_ids", slots, 0, session.slots, "a slot")
    if slots.unique().numel() != n:
        raise InputError(f"slot_ids: {slots.tolist()} repeats a slot; each row needs its own slot")
    expected_pos = torch.tensor([session.seq_lens[s] for s in slots.tolist()], dtype=torch.int32)
    if not torch.equal(positions.cpu(), expected_pos):
        raise InputError(f"positions: {positions.tolist()} do not continue the slots' committed "
                         f"lengths {expected_pos.tolist()}")
    model = session.package.manifest.model
    if "token_ids" in tensors:
        _in_range("token_ids", tensors["token_ids"], 0, model.vocab_size, "a token id")
    step = info.advances_kind
    if step is not None:
        _in_range(step, tensors[step], KINDS[step].count_min, info.width + 1,
                  f"a row count of the {info.width}-wide pass")
    reach = positions.long() + (tensors[step].long() if step else info.width)
    _in_range("positions", reach, 0, model.max_seq_len + 1, f"positions + {step or 'width'} within max_seq_len")
    for kind in sorted(tables & set(tensors)):
        _check_block_table(kind, tensors[kind], session.pools[KINDS[kind].pool], positions.long(),
                           tensors[step].long() if step else torch.zeros_like(reach))
    return tensors


def _named(info, given: str) -> str:
    """A hint for a caller who gave an input's name where its kind belongs."""
    kind = info.input_kinds.get(given)
    return f" ({given!r} is the name of its {kind} input; a replay takes inputs by kind)" if kind else ""


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

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


class OnDevice:
    """A replay value the caller computed on the session's device from a pass's outputs (the
    engine builds verify's token block from the draft pass's this way). The session checks its
    device and shape, never its values: reading them would wait for the device. Taken for
    token_ids only: slots, positions, counts and block tables drive host-side bookkeeping."""

    ACCEPTED_KINDS = ("token_ids",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _host(kind: str, value, spec: BufferSpec, device) -> list:
    """`value` as nested Python lists of ints, read on the host: lists as given, CPU tensors by
    value. A tensor on a CUDA session's device is read too (one wait for the device: callers
    that care pass host values, or OnDevice); any other device is refused."""
    if isinstance(value, torch.Tensor):
        if value.dtype != spec.torch_dtype:
            raise InputError(f"{kind}: dtype {value.dtype} does not match the expected {spec.torch_dtype}")
        if value.device.type != "cpu" and value.device != device:
            raise InputError(f"{kind}: on device {value.device}; the session runs on {device}")
        return value.tolist()
    try:  # ints of the input's dtype, ragged or non-numeric values refused alike
        return value if _nested_ints(value) is None else torch.tensor(value, dtype=spec.torch_dtype).tolist()
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise InputError(f"{kind}: cannot be read as {spec.dtype} values ({exc})") from None


def _nested_ints(value):
    """None when `value` is a list (of lists) of plain ints, else the first thing that is not."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif not isinstance(item, int) or isinstance(item, bool):
            return item
    return None if isinstance(value, (list, tuple)) else value


def _shape(value) -> tuple:
    """The shape of nested lists; a ragged one has none (-1 in place of the ragged size)."""
    if not isinstance(value, (list, tuple)):
        return ()
    inner = {_shape(item) for item in value}
    if len(inner) > 1:
        return (len(value), -1)
    return (len(value), *(inner.pop() if inner else ()))


def _flat(value) -> list[int]:
    if value and isinstance(value[0], (list, tuple)):
        return [v for row in value for v in _flat(row)]
    return list(value)


def _in_range(name: str, values: list[int], low: int, high: int, what: str) -> None:
    bad = next((v for v in values if not low <= v < high), None)
    if bad is not None:
        raise InputError(f"{name}: value {bad} is out of range; expected {what} in [{low}, {high})")


def validate_inputs(session, info, values: dict) -> dict[str, list | OnDevice]:
    """Check a replay's values, given by input kind (kinds.py), against the pass, on the host:
    nothing here reads the device. Returns them by kind as nested lists of ints (OnDevice
    values as given). Errors name the kind the caller gave, never an input's name."""
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
    host = {kind: values[kind] if isinstance(values[kind], OnDevice) else _host(kind, values[kind], specs[kind],
                                                                                   session.device)
            for kind in specs}
    slots = host["slot_ids"]
    n = len(slots) if _shape(slots) == (len(slots),) else -1
    largest = max(session.buckets[info.name])
    if not 1 <= n <= largest:
        raise InputError(f"slot_ids: {n} rows given; expected a 1-D list of 1 to {largest} rows")
    for kind, value in host.items():
        expected = specs[kind].resolve({"rows": n})
        shape = _device_value(kind, value, session.device) if isinstance(value, OnDevice) else _shape(value)
        if tuple(shape) != expected:
            raise InputError(f"{kind}: shape {tuple(shape)} does not match the expected {expected}")
    positions = host["positions"]
    _in_range("slot_ids", slots, 0, session.slots, "a slot")
    if len(set(slots)) != n:
        raise InputError(f"slot_ids: {slots} repeats a slot; each row needs its own slot")
    expected_pos = [session.seq_lens[s] for s in slots]
    if positions != expected_pos:
        raise InputError(f"positions: {positions} do not continue the slots' committed lengths {expected_pos}")
    model = session.package.manifest.model
    if "token_ids" in host and not isinstance(host["token_ids"], OnDevice):
        _in_range("token_ids", _flat(host["token_ids"]), 0, model.vocab_size, "a token id")
    step = info.advances_kind
    if step is not None:
        _in_range(step, host[step], KINDS[step].count_min, info.width + 1,
                  f"a row count of the {info.width}-wide pass")
    counts = host[step] if step else [0] * n
    reach = [p + (c if step else info.width) for p, c in zip(positions, counts)]
    _in_range("positions", reach, 0, model.max_seq_len + 1, f"positions + {step or 'width'} within max_seq_len")
    for kind in sorted(tables & set(host)):
        _check_block_table(kind, host[kind], session.pools[KINDS[kind].pool], positions, counts)
    return host


def _device_value(kind: str, value: OnDevice, device) -> tuple:
    """The shape of an OnDevice value, after checking what can be checked without reading it."""
    tensor = value.tensor
    if kind not in OnDevice.ACCEPTED_KINDS:
        raise InputError(f"{kind}: given OnDevice; only {list(OnDevice.ACCEPTED_KINDS)} may be (the session reads "
                         f"{kind} on the host)")
    if not isinstance(tensor, torch.Tensor) or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise InputError(f"{kind}: OnDevice holds {getattr(tensor, 'dtype', type(tensor).__name__)}; "
                         "expected an integer tensor")
    if tensor.device != device:
        raise InputError(f"{kind}: on device {tensor.device}; the session runs on {device}")
    return tuple(tensor.shape)


def _named(info, given: str) -> str:
    """A hint for a caller who gave an input's name where its kind belongs."""
    kind = info.input_kinds.get(given)
    return f" ({given!r} is the name of its {kind} input; a replay takes inputs by kind)" if kind else ""


def _check_block_table(name: str, table: list, pool, positions: list, counts: list) -> None:
    """Caller-owned pages: ids in [-1, pages), and a page wherever the pass reads or writes."""
    _in_range(name, _flat(table), -1, pool.count, f"a page id of pool {pool.name} (or -1)")
    for row, (ids, position, count) in enumerate(zip(table, positions, counts)):
        needed = -(-(position + count) // pool.tokens_per_page)
        column = next((c for c in range(min(needed, len(ids))) if ids[c] < 0), None)
        if column is not None:
            raise InputError(f"{name}: row {row} has no page at column {column}; the pass reads or writes its "
                             f"tokens up to {position + count} ({pool.tokens_per_page} per page)")

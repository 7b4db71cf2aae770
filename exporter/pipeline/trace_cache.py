"""Captured passes kept by a process that exports one model again and again, so it traces once.

Tracing is nearly all of an export (fake-tensor dispatch and symbolic shapes, seconds even
for a toy pass), and the graph depends on nothing but the pass module, which the recipe's
Dims, the pass and the rank define, and on the weights' names, shapes and dtypes: never
on their values (the weights are graph inputs). So a process that exports the same model
again -- with other weights, unfused, into another folder -- copies the captured program
instead of tracing it. Real and fake (structural) weights are kept apart, though they
give the same graph today, so that their agreement stays something a test can check.

Keeping costs a copy of every program traced (a quarter to half a second for a toy pass),
which a one-off export would pay for nothing, so it is off until a process asks for it
with `reuse_traces()` (the test suite does: it exports the same toy models many times).
A copy is a deep copy with the original's node names put back: fx's copy renames a node
called after a Python keyword (`and` becomes `and_1`), and names are part of the bytes.
The oldest entries are dropped beyond `NODE_BUDGET` nodes in all (a toy pass has one or
two thousand, a full-size one tens of thousands; a kept node costs about a kilobyte), so a
process that alternates between many models still finds the ones it exported a while ago.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

NODE_BUDGET = 300_000
_entries: OrderedDict[tuple, torch.export.ExportedProgram] = OrderedDict()
_enabled = [False]
counts = {"hits": 0, "misses": 0}


def trace_key(dims, pass_name: str, rank: int | None, weights: dict[str, torch.Tensor], **options) -> tuple:
    """Everything the captured graph depends on."""
    signature = tuple((name, tuple(t.shape), t.dtype, is_fake(t)) for name, t in sorted(weights.items()))
    return dims, pass_name, rank, signature, tuple(sorted(options.items()))


def copy_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        # Copying the calling spec trips a deprecation inside torch's own pytree code.
        warnings.simplefilter("ignore", FutureWarning)
        copied = copy.deepcopy(program)
    for original, node in zip(program.graph.nodes, copied.graph.nodes):
        if node.name != original.name:
            node.name = original.name
    return copied


def traced(key: tuple, trace: Callable[[], torch.export.ExportedProgram]) -> torch.export.ExportedProgram:
    """A program of its own for `key`: a copy of the kept one, or traced now (and a copy kept)."""
    if not _enabled[0]:
        return trace()
    kept = _entries.get(key)
    if kept is not None:
        counts["hits"] += 1
        _entries.move_to_end(key)
        return copy_program(kept)
    counts["misses"] += 1
    program = trace()
    if len(program.graph.nodes) > NODE_BUDGET:
        return program
    _entries[key] = copy_program(program)
    while sum(len(p.graph.nodes) for p in _entries.values()) > NODE_BUDGET:
        _entries.popitem(last=False)
    return program


def reuse_traces(on: bool = True) -> None:
    """From now on, keep captured passes and copy them for a later export of the same pass (or stop)."""
    _enabled[0] = on
    if not on:
        _entries.clear()


@contextmanager
def tracing_every_time():
    """Trace every pass inside the block: for timing an export, or checking that two traces agree."""
    saved, _enabled[0] = _enabled[0], False
    try:
        yield
    finally:
        _enabled[0] = saved

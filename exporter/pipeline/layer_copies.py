"""Trace each kind of layer once and copy its graph for every later layer of that kind.

A full-size pass is a handful of layer kinds repeated forty times, and torch.export pays
for every op it traces (fake tensors, symbolic shapes, node metadata): that was most of a
structural export. So during capture the first layer of a kind is traced between two
markers, and each later layer of the kind is one stub op whose fake outputs take the
template's shapes. After export, the stitch_layer_copies rewrite replaces each stub by a copy
of the template's nodes (stitch_layer_copies.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import sympy
import torch

NAMESPACE = "b12x_capture"
_TEMPLATE_OUTPUTS: dict[int, list[torch.Tensor]] = {}  # tag -> the template's outputs, for the stubs' shapes


# The markers declare their inputs mutated only so that nothing drops them as dead code.
@torch.library.custom_op(f"{NAMESPACE}::layer_begin", mutates_args=("inputs",))
def layer_begin(inputs: list[torch.Tensor], tag: int) -> None:
    pass


@torch.library.custom_op(f"{NAMESPACE}::layer_end", mutates_args=("outputs",))
def layer_end(outputs: list[torch.Tensor], tag: int) -> None:
    pass


@torch.library.custom_op(f"{NAMESPACE}::layer_copy", mutates_args=())
def layer_copy(inputs: list[torch.Tensor], tag: int) -> list[torch.Tensor]:
    raise RuntimeError("layer_copy only stands in for a layer while a pass is captured")


@layer_copy.register_fake
def _(inputs, tag):
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in _TEMPLATE_OUTPUTS[tag]]


MARKERS = (torch.ops.b12x_capture.layer_begin.default, torch.ops.b12x_capture.layer_end.default)
COPY = torch.ops.b12x_capture.layer_copy.default


class LayerCopies:
    """The tracing half: runs a layer's body the first time its key is seen, stubs it afterwards."""

    def __init__(self):
        self.templates: dict[tuple, tuple[int, list, object]] = {}  # key -> tag, output layout, note

    def run(self, key: tuple, inputs: list[torch.Tensor], body: Callable[[], tuple[list, object]]) -> tuple[list, object]:
        """(outputs, note) of body(), which reads only `inputs` and pass-wide values.

        `key` must tell apart every layer whose graph differs; the inputs' shapes and dtypes
        are added to it here. The note (the body's own bookkeeping) is the template's.
        """
        key = (key, tuple((tuple(map(_size, t.shape)), t.dtype) for t in inputs))
        if key in self.templates:
            tag, layout, note = self.templates[key]
            made = iter(layer_copy(inputs, tag))
            return [inputs[index] if source == "input" else next(made) for source, index in layout], note
        tag = len(self.templates)
        layer_begin(inputs, tag)
        outputs, note = body()
        # An output that is one of the inputs (a cache handed on) is passed through, not copied.
        by_id = {id(t): k for k, t in enumerate(inputs)}
        layout, made = [], []
        for t in outputs:
            if id(t) in by_id:
                layout.append(("input", by_id[id(t)]))
            else:
                layout.append(("output", len(made)))
                made.append(t)
        layer_end(made, tag)
        _TEMPLATE_OUTPUTS[tag] = made
        self.templates[key] = (tag, layout, note)
        return outputs, note


@contextmanager
def copying_layers():
    """A fresh LayerCopies for one capture; its stubs' shapes are forgotten afterwards."""
    _TEMPLATE_OUTPUTS.clear()
    try:
        yield LayerCopies()
    finally:
        _TEMPLATE_OUTPUTS.clear()


def _size(size) -> str:
    """A size with each symbol written as its range: every input has its own symbol while
    tracing (export equates those of one dynamic dimension only afterwards), and the
    dimensions a layer's shapes use differ in range (rows, slots, pages)."""
    if not isinstance(size, torch.SymInt):
        return str(size)
    expr, ranges = size.node.expr, size.node.shape_env.var_to_range
    return str(expr.subs({s: sympy.Symbol(f"[{ranges[s].lower},{ranges[s].upper}]") for s in expr.free_symbols}))

"""Trace each kind of layer once and copy its graph for every later layer of that kind.

A full-size pass is a handful of layer kinds repeated forty times, and torch.export pays
for every op it traces (fake tensors, symbolic shapes, node metadata): that was most of a
structural export. So during capture the first layer of a kind is traced between two
markers, and each later layer of the kind is one stub op whose fake outputs take the
template's shapes. After export, `stitch` replaces each stub by a copy of the template's
nodes, with the template's inputs (its streams, its own weights and caches, what earlier
layers handed on) swapped for the stub's. The result is the graph a direct capture
gives, node for node (tests compare the two on every recipe kind).

A template may read other nodes only where every layer reads the same value: pass-wide
inputs and tables, and symbolic sizes. Anything else it reads must be among its inputs;
`stitch` refuses a template that reaches into another layer's nodes or buffers.
"""

from __future__ import annotations

import collections
import operator
import re
from contextlib import contextmanager
from typing import Callable

import sympy
import torch
import torch.fx

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


class StitchError(RuntimeError):
    pass


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


def _symbolic(node: torch.fx.Node) -> bool:
    """A size computed from shapes: the same value wherever a layer of the same key reads it."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool))


def _base_name(node: torch.fx.Node) -> str:
    return re.sub(r"_\d+$", "", node.name)


def stitch(program: torch.export.ExportedProgram) -> int:
    """Replace every layer stub by a copy of its template; returns the number of copies."""
    graph = program.graph_module.graph
    begins, ends, regions, copies, current = {}, {}, {}, [], None
    for node in graph.nodes:
        if node.target == MARKERS[0]:
            current = node.args[1]
            begins[current], regions[current] = node, []
        elif node.target == MARKERS[1]:
            ends[node.args[1]], current = node, None
        elif node.target == COPY:
            copies.append(node)
        elif current is not None:
            regions[current].append(node)
    inside = {node: tag for tag, region in regions.items() for node in region}
    layer_inputs = {x for node in (*begins.values(), *copies) for x in node.args[0]}
    stand_ins = set(copies) | {user for node in copies for user in node.users}
    for tag, region in regions.items():
        own, inputs = set(region), set(begins[tag].args[0])
        for node in region:
            for x in node.all_input_nodes:
                if x in own or x in inputs or _symbolic(x):
                    continue
                if x in stand_ins or x in inside or x in layer_inputs:
                    raise StitchError(f"layer template {tag}: node {node.name} reads {x.name}, which belongs to "
                                      f"another layer and is not among the template's inputs")
    replaced = {}  # a stub output's name -> the name of the copied node standing for it
    for stub in copies:
        tag = stub.args[1]
        env = {}
        for template_input, stub_input in zip(begins[tag].args[0], stub.args[0], strict=True):
            if env.setdefault(template_input, stub_input) is not stub_input:
                raise StitchError(f"layer copy {stub.name}: template {tag} reads {template_input.name} twice, "
                                  f"the copy two different nodes")
        with graph.inserting_before(stub):
            for node in regions[tag]:
                if _symbolic(node):
                    env[node] = node
                    continue
                copy = graph.create_node(node.op, node.target, *torch.fx.map_arg((node.args, node.kwargs),
                                                                                 lambda x: env.get(x, x)),
                                         name=_base_name(node), type_expr=node.type)
                copy.meta = dict(node.meta)
                env[node] = copy
        made = ends[tag].args[0]
        for user in list(stub.users):
            if user.target is not operator.getitem:
                raise StitchError(f"layer copy {stub.name} is read by {user.name}, not through its outputs")
            value = env.get(made[user.args[1]], made[user.args[1]])
            replaced[user.name] = value.name
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(stub)
    for node in (*begins.values(), *ends.values()):
        graph.erase_node(node)
    renamed = _renumber(graph)
    for spec in program.graph_signature.output_specs:
        name = getattr(spec.arg, "name", None)
        name = replaced.get(name, name)
        if name in renamed:
            spec.arg.name = renamed[name]
    for node in graph.nodes:
        # Which torch function made a node, numbered per trace: a copy could only repeat its template's.
        node.meta.pop("torch_fn", None)
    graph.lint()
    program.graph_module.recompile()
    return len(copies)


def _renumber(graph: torch.fx.Graph) -> dict[str, str]:
    """Name the op nodes by kind and place (add, add_1, ... in graph order), as one trace of the
    whole pass would: the names, and so the package bytes, do not depend on which layers were
    traced and which copied. Returns old name -> new name."""
    taken = {node.name for node in graph.nodes if node.op != "call_function"}
    counts, renamed = collections.Counter(), {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        base = _base_name(node)
        while True:
            k = counts[base]
            counts[base] += 1
            name = base if k == 0 else f"{base}_{k}"
            if name not in taken:
                break
        renamed[node.name] = name
    namespace = torch.fx.graph._Namespace()
    for node in graph.nodes:
        if node.op == "call_function":
            node.name = renamed[node.name]
        namespace.create_name(node.name, node)
    graph._graph_namespace = namespace
    return renamed

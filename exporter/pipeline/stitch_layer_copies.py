"""stitch_layer_copies: each layer stub becomes a copy of its template's nodes.

Capture traces the first layer of a kind between two markers and stands one stub op in
for every later layer of the kind (layer_copies.py). This rewrite copies the template's
nodes in place of each stub, with the template's inputs (its streams, its own weights and
caches, what earlier layers handed on) swapped for the stub's, and removes the markers.
The result is the graph a direct capture gives, node for node (tests compare the two on
every recipe kind); its matches are the copies made.

A template may read other nodes only where every layer reads the same value: pass-wide
inputs and tables, and symbolic sizes. Anything else it reads must be among its inputs;
the rewrite refuses a template that reaches into another layer's nodes or buffers.
"""

from __future__ import annotations

import collections
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx

from b12x_toolchain.exporter.pipeline.layer_copies import COPY, MARKERS
from b12x_toolchain.runtime.rewrite import Rewrite, RewriteResult, named_args, run_rewrites
from b12x_toolchain.runtime.rewrite.exported_names import output_names_follow_graph, rename_nodes

BEGIN, END = MARKERS


class StitchError(RuntimeError):
    pass


def _symbolic(node: torch.fx.Node) -> bool:
    """A size computed from shapes: the same value wherever a layer of the same key reads it."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool))


def _base_name(node: torch.fx.Node) -> str:
    return re.sub(r"_\d+$", "", node.name)


@dataclass
class Layers:
    """The captured graph's layer markers and stubs, by template tag."""

    begins: dict  # tag -> layer_begin (its `inputs`: the template's inputs)
    ends: dict  # tag -> layer_end (its `outputs`: what the template made)
    regions: dict  # tag -> the template's nodes between its markers
    stubs: list

    @classmethod
    def find(cls, graph: torch.fx.Graph) -> Layers:
        layers, current = cls({}, {}, {}, []), None
        for node in graph.nodes:
            if node.target == BEGIN:
                current = named_args(node)["tag"]
                layers.begins[current], layers.regions[current] = node, []
            elif node.target == END:
                layers.ends[named_args(node)["tag"]], current = node, None
            elif node.target == COPY:
                layers.stubs.append(node)
            elif current is not None:
                layers.regions[current].append(node)
        return layers

    # Read from the markers when asked: copying a stub rewires the later markers that read its outputs.
    def inputs(self, tag: int) -> list:
        return named_args(self.begins[tag])["inputs"]

    def outputs(self, tag: int) -> list:
        return named_args(self.ends[tag])["outputs"]

    def check_self_contained(self) -> None:
        inside = {node: tag for tag, region in self.regions.items() for node in region}
        layer_inputs = {x for node in (*self.begins.values(), *self.stubs) for x in named_args(node)["inputs"]}
        stand_ins = set(self.stubs) | {user for stub in self.stubs for user in stub.users}
        for tag, region in self.regions.items():
            own, inputs = set(region), set(self.inputs(tag))
            for node in region:
                for x in node.all_input_nodes:
                    if x in own or x in inputs or _symbolic(x):
                        continue
                    if x in stand_ins or x in inside or x in layer_inputs:
                        raise StitchError(f"layer template {tag}: node {node.name} reads {x.name}, which belongs to "
                                          f"another layer and is not among the template's inputs")


def copy_template(graph: torch.fx.Graph, layers: Layers, stub: torch.fx.Node) -> None:
    """Copy the stub's template before it, then route the stub's outputs to the copies."""
    tag, stub_inputs = named_args(stub)["tag"], named_args(stub)["inputs"]
    env = {}
    for template_input, stub_input in zip(layers.inputs(tag), stub_inputs, strict=True):
        if env.setdefault(template_input, stub_input) is not stub_input:
            raise StitchError(f"layer copy {stub.name}: template {tag} reads {template_input.name} twice, "
                              f"the copy two different nodes")
    with graph.inserting_before(stub):
        for node in layers.regions[tag]:
            if _symbolic(node):
                env[node] = node
                continue
            copy = graph.create_node(node.op, node.target, *torch.fx.map_arg((node.args, node.kwargs),
                                                                             lambda x: env.get(x, x)),
                                     name=_base_name(node), type_expr=node.type)
            copy.meta = dict(node.meta)
            env[node] = copy
    made = layers.outputs(tag)
    for user in list(stub.users):
        if user.target is not operator.getitem:
            raise StitchError(f"layer copy {stub.name} is read by {user.name}, not through its outputs")
        _, index = user.args  # getitem(stub, index)
        user.replace_all_uses_with(env.get(made[index], made[index]))
        graph.erase_node(user)
    graph.erase_node(stub)


def renumbered(graph: torch.fx.Graph) -> dict[str, str]:
    """Old name -> new name for the op nodes, named by kind and place (add, add_1, ... in graph
    order) as one trace of the whole pass would: the names, and so the package bytes, do not
    depend on which layers were traced and which copied."""
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
    return renamed


class StitchLayerCopies(Rewrite):
    """Runs on an exported program's graph module; its signature's output names follow the graph."""

    name = "stitch_layer_copies"

    def __init__(self, signature: torch.export.ExportGraphSignature):
        self.signature = signature

    def rewrite(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        layers = Layers.find(graph)
        layers.check_self_contained()
        for stub in layers.stubs:
            copy_template(graph, layers, stub)
        for marker in (*layers.begins.values(), *layers.ends.values()):
            graph.erase_node(marker)
        rename_nodes(graph, renumbered(graph))
        output_names_follow_graph(self.signature, graph)
        for node in graph.nodes:
            # Which torch function made a node, numbered per trace: a copy could only repeat its template's.
            node.meta.pop("torch_fn", None)
        gm.recompile()
        return len(layers.stubs)


def stitch(program: torch.export.ExportedProgram, graph_name: str) -> RewriteResult:
    """Run the rewrite over a captured program, through the kit (invariants checked after it)."""
    (result,) = run_rewrites(program.graph_module, [StitchLayerCopies(program.graph_signature)], graph_name)
    return result

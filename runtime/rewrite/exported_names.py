"""Renaming the nodes of an exported program's graph.

Node names are package bytes, so a rewrite that copies nodes may have to name them as one
trace would have. FX keeps the names it has handed out in a namespace of its own, and has
no public way to rename many nodes at once: `rename_nodes` is the one place that rebuilds
it, so that a node a later rewrite creates never takes a name a renamed node already has.
An exported program names its outputs in its signature as well; those follow the output
node (`output_names_follow_graph`) rather than being patched one rename at a time.
"""

from __future__ import annotations

import torch.fx


def rename_nodes(graph: torch.fx.Graph, renamed: dict[str, str]) -> None:
    """Give the nodes named in `renamed` (old name -> new name) their new names, all at once."""
    namespace = torch.fx.graph._Namespace()
    for node in graph.nodes:
        node.name = renamed.get(node.name, node.name)
        namespace.create_name(node.name, node)
    graph._graph_namespace = namespace


def output_names_follow_graph(signature: torch.export.ExportGraphSignature, graph: torch.fx.Graph) -> None:
    """Name each output in the signature after the node the graph returns in its place."""
    output = next(node for node in graph.nodes if node.op == "output")
    for spec, value in zip(signature.output_specs, output.args[0], strict=True):
        if isinstance(value, torch.fx.Node) and getattr(spec.arg, "name", None) not in (None, value.name):
            spec.arg.name = value.name

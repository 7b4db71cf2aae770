"""Dependency graph of an fx graph: data edges plus memory-effect edges on mutated buffers.

Custom ops mutate their inputs in place and have no users, so data edges alone do not
order them. For every root buffer (a placeholder, through views) we add read-after-write,
write-after-read and write-after-write edges in program order, from the op schemas'
mutation annotations. Rewrites ask this graph whether moving a node is legal.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch.fx


def _schema(node: torch.fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _nodes_in(arg) -> list[torch.fx.Node]:
    """Every node inside an argument, including those nested in lists (`cat([a, b])`)."""
    found = []
    torch.fx.node.map_arg(arg, found.append)
    return found


def tensor_args(node: torch.fx.Node) -> list[tuple[torch.fx.Node, bool]]:
    """(argument node, is_written) for every node argument, from the op schema."""
    schema = _schema(node)
    out = []
    for i, arg in enumerate(node.args):
        written = False
        if schema is not None and i < len(schema.arguments):
            info = schema.arguments[i].alias_info
            written = bool(info and info.is_write)
        out += [(n, written) for n in _nodes_in(arg)]
    if schema is not None:
        by_name = {a.name: a for a in schema.arguments}
        for name, arg in node.kwargs.items():
            info = by_name[name].alias_info if name in by_name else None
            out += [(n, bool(info and info.is_write)) for n in _nodes_in(arg)]
    else:
        for arg in node.kwargs.values():
            out += [(n, False) for n in _nodes_in(arg)]
    return out


def _aliases_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input a view op's result aliases (schema `Tensor(a) self -> Tensor(a)`).

    Pieces of a multi-output view (`split`, `unbind`, `chunk`) are taken with
    `operator.getitem`, which has no schema: a piece aliases what it was taken from.
    """
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    schema = _schema(node)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    for arg, info in zip(node.args, schema.arguments):
        if info.alias_info is not None and isinstance(arg, torch.fx.Node):
            return arg
    return None


def dependency_graph(graph: torch.fx.Graph) -> nx.DiGraph:
    dag = nx.DiGraph()
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    last_write: dict[torch.fx.Node, torch.fx.Node] = {}
    reads_since_write: dict[torch.fx.Node, list] = {}
    for order, node in enumerate(graph.nodes):
        dag.add_node(node, order=order)
        aliased = _aliases_input(node)
        root[node] = root.get(aliased, aliased) if aliased is not None else node
        args = tensor_args(node) if node.op != "output" else [(n, False) for n in _nodes_in(node.args)]
        for arg, written in args:
            dag.add_edge(arg, node, kind="data")
            base = root.get(arg, arg)
            if base in last_write and last_write[base] is not node:
                dag.add_edge(last_write[base], node, kind="after-write", buffer=base.name)
            if written:
                for reader in reads_since_write.get(base, []):
                    if reader is not node:
                        dag.add_edge(reader, node, kind="write-after-read", buffer=base.name)
                last_write[base] = node
                reads_since_write[base] = []
            else:
                reads_since_write.setdefault(base, []).append(node)
    return dag


def order(dag: nx.DiGraph, node: torch.fx.Node) -> int:
    return dag.nodes[node]["order"]

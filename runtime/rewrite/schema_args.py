"""An op node's arguments by the names its schema gives them, never by position.

Positions shift when an op gains an argument; names are what the schema promises. Only
ops with a schema (OpOverloads) are looked up this way.
"""

from __future__ import annotations

import torch.fx


def named_args(node: torch.fx.Node) -> dict:
    """Every argument the node passes, positional or keyword, by schema name."""
    schema = node.target._schema
    values = dict(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def replace_args(node: torch.fx.Node, **changes) -> None:
    """Set the named arguments, wherever the node passes them (positionally or by keyword)."""
    names = [a.name for a in node.target._schema.arguments]
    unknown = set(changes) - set(names)
    if unknown:
        raise KeyError(f"{node.target} has no argument {sorted(unknown)[0]!r}")
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in changes.items():
        at = names.index(name)
        if at < len(args):
            args[at] = value
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs

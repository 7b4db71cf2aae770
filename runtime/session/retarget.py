"""A package graph retargeted to the session's device.

`torch.export` burns the export device into the graph: `arange`/`ones` carry
`device=cpu` and `_assert_tensor_metadata` checks that inputs are on the CPU. A package
exported on the CPU (or the meta device) would therefore fail, or mix devices, when a
session replays it on a GPU. The session replays a copy whose device constants name its
own device; the package's program is shared by every session and stays untouched.
"""

from __future__ import annotations

import copy

import torch
import torch.fx


def graph_on(program, device) -> torch.fx.GraphModule:
    """The program's graph module with every burnt-in device replaced by `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        return program.graph_module
    # Imported here: the rewrite kit imports networkx, which a CPU session never needs.
    from b12x_toolchain.runtime.rewrite import named_args, replace_args

    module = copy.deepcopy(program.graph_module)
    for sub in module.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            # The device argument by its schema name, wherever the op takes it: a keyword of
            # `arange` and `_assert_tensor_metadata`, the second argument of `to.device`.
            if node.op == "call_function" and hasattr(node.target, "_schema") and "device" in named_args(node):
                replace_args(node, device=device)
        sub.recompile()
    return module

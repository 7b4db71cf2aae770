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
    module = copy.deepcopy(program.graph_module)
    for sub in module.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": device}
            if node.target is torch.ops.aten.to.device:
                node.args = (node.args[0], device, *node.args[2:])
        sub.recompile()
    return module

"""Graph invariants checked after every rewrite.

A rewrite may change how a pass computes, never what a server binds: the placeholders
(the calling convention) and the outputs stay the same, every `b12x` op is in the op set,
and every mutation lands on a graph input.
"""

from __future__ import annotations

import torch.fx

from b12x_toolchain.runtime.ops.opset import NAMESPACE, OPS, OPSET_VERSION
from b12x_toolchain.runtime.rewrite.dependency import tensor_args

KNOWN_OPS = set(OPS.values())


def signature(graph: torch.fx.Graph) -> tuple:
    placeholders = tuple(n.name for n in graph.nodes if n.op == "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    return placeholders, len(results) if isinstance(results, (tuple, list)) else 1


def check_invariants(gm: torch.fx.GraphModule, before: tuple) -> list[str]:
    problems = []
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises plain RuntimeError with the reason
        problems.append(f"graph lint failed: {exc}")
    if signature(gm.graph) != before:
        problems.append("calling convention changed (placeholders or outputs differ)")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        namespace = getattr(node.target, "namespace", None)
        if namespace == NAMESPACE and node.target not in KNOWN_OPS:
            problems.append(f"{node.name}: {node.target} is not in op set v{OPSET_VERSION}")
        for arg, written in tensor_args(node):
            if written and arg.op != "placeholder":
                problems.append(f"{node.name} mutates {arg.name}, which is not a graph input")
    return problems

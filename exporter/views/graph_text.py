"""Text views of a pass graph: one node per line with its op and shape, or Graphviz.

Placeholders are named after the calling convention (`cache.layer0.window`, not
`caches_cache_layer0_window`) and shape symbols after the convention's symbols (`rows`,
`slots`, not `s35`), so a view reads like the manifest and two packages' views diff
cleanly. Ops that write a buffer say so: in-place custom ops have no users, and without
that mark nothing would show why they are in the graph.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from b12x_toolchain.exporter.pipeline.capture import group_inputs
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.rewrite.dependency import tensor_args

SYMBOL = re.compile(r"\bs\d+\b")


class GraphNames:
    """Display names of a graph's placeholders and shape symbols, from its calling convention."""

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[BufferSpec], outputs: list[BufferSpec]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ordered = [spec for group in group_inputs(inputs) for spec in group.values()]
        if len(placeholders) != len(ordered):
            raise ValueError(f"graph has {len(placeholders)} inputs; the calling convention lists {len(ordered)}")
        self.specs = dict(zip(placeholders, ordered))
        self.outputs = outputs
        self.symbols: dict[str, str] = {}
        for node, spec in self.specs.items():
            for dim, symbol in zip(getattr(node.meta.get("val"), "shape", ()), spec.shape):
                if isinstance(symbol, str) and isinstance(dim, torch.SymInt):
                    self.symbols[str(dim.node.expr)] = symbol

    def node(self, node: torch.fx.Node) -> str:
        spec = self.specs.get(node)
        return spec.name if spec is not None else node.name

    def dim(self, dim) -> str:
        return SYMBOL.sub(lambda m: self.symbols.get(m.group(0), m.group(0)), str(dim))

    def value(self, val) -> str:
        """`float32[rows, 8, 512]`, `int` for a symbolic size, a tuple for several results."""
        if isinstance(val, torch.Tensor):
            return f"{str(val.dtype).removeprefix('torch.')}[{', '.join(self.dim(d) for d in val.shape)}]"
        if isinstance(val, torch.SymInt):
            return f"int({self.dim(val)})"
        if isinstance(val, (tuple, list)):
            return "(" + ", ".join(self.value(v) for v in val) + ")"
        return "" if val is None else type(val).__name__

    def arg(self, arg) -> str:
        if isinstance(arg, torch.fx.Node):
            return "%" + self.node(arg)
        if isinstance(arg, (tuple, list)):
            return "[" + ", ".join(self.arg(a) for a in arg) + "]"
        if isinstance(arg, torch.dtype):
            return str(arg).removeprefix("torch.")
        if isinstance(arg, torch.device):
            return str(arg)
        return repr(arg)


def target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # aten.add.Tensor, b12x_toolchain.window_snapshot.default
    return f"{getattr(target, '__module__', None) or 'builtins'}.{getattr(target, '__name__', repr(target))}"


def written(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [arg for arg, is_written in tensor_args(node) if is_written]


def graph_lines(gm: torch.fx.GraphModule, names: GraphNames) -> list[str]:
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = names.specs[node]
            lines.append(f"%{spec.name} : {names.value(node.meta.get('val'))}  ({spec.role})")
        elif node.op == "call_function":
            args = [names.arg(a) for a in node.args] + [f"{k}={names.arg(v)}" for k, v in node.kwargs.items()]
            line = f"%{node.name} = {target_name(node.target)}({', '.join(args)})"
            kind = names.value(node.meta.get("val"))
            line += f" : {kind}" if kind else ""
            writes = written(node)
            if writes:
                line += "  # writes " + ", ".join("%" + names.node(w) for w in writes)
            lines.append(line)
        elif node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            pairs = zip((s.name for s in names.outputs), results)
            lines.append("return {" + ", ".join(f"{n}: {names.arg(r)}" for n, r in pairs) + "}")
        else:
            lines.append(f"%{node.name} = {node.op} {node.target}")
    return lines


def graph_text(gm: torch.fx.GraphModule, inputs, outputs, title: str) -> str:
    names = GraphNames(gm, inputs, outputs)
    nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    header = f"# {title}: {nodes} op nodes; symbols: " + (", ".join(sorted(set(names.symbols.values()))) or "none")
    return "\n".join([header, *graph_lines(gm, names)]) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_dot(gm: torch.fx.GraphModule, inputs, outputs, title: str) -> str:
    """Graphviz: data edges black, writes red (from the op back to the buffer it writes)."""
    names = GraphNames(gm, inputs, outputs)
    ids = {node: f"n{i}" for i, node in enumerate(gm.graph.nodes)}
    out = [f"digraph {_quote(title)} {{", "  node [shape=box, fontname=monospace, fontsize=10];"]
    for node, ident in ids.items():
        if node.op == "placeholder":
            label, style = f"{names.node(node)}\n{names.value(node.meta.get('val'))}", ", style=filled, fillcolor=lightgrey"
        elif node.op == "output":
            label, style = "return", ", shape=oval"
        else:
            label, style = f"{node.name}\n{target_name(node.target)}\n{names.value(node.meta.get('val'))}", ""
        out.append(f"  {ident} [label={_quote(label)}{style}];")
    for node, ident in ids.items():
        for arg in dict.fromkeys(node.all_input_nodes):
            out.append(f"  {ids[arg]} -> {ident};")
        for buffer in written(node) if node.op == "call_function" else []:
            out.append(f"  {ident} -> {ids[buffer]} [color=red, style=dashed, constraint=false, label=writes];")
    out.append("}")
    return "\n".join(out) + "\n"

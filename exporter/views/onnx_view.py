"""An ONNX view of a pass graph, for Netron and for diffing; never the package itself.

Each fx node becomes one ONNX node in the domain of its op: op-set ops in the op set's namespace as domain
at the op-set version, ATen ops in `org.pytorch.aten`, Python-level size arithmetic in
`org.python`. Non-tensor arguments become attributes named after the schema's arguments.
ONNX values are immutable, so a b12x op that writes a buffer in place yields the buffer's
next version (`staging.verify.layer0.window@1`) as an output, later readers take that
version, and the last version of every written buffer is a graph output — the order of
in-place writes stays visible. No weights are embedded: weights are graph inputs, as in
the package. The result passes `onnx.checker.check_model`; ONNX has no schemas for the
custom domains, so it checks the graph's structure, not the ops.
"""

from __future__ import annotations

import operator

import onnx
import torch
import torch.fx
from onnx import TensorProto, helper

import b12x_toolchain
from b12x_toolchain.exporter.views.graph_text import GraphNames, written
from b12x_toolchain.runtime.ops.opset import NAMESPACE, OPSET_VERSION

ATEN_DOMAIN = "org.pytorch.aten"
PYTHON_DOMAIN = "org.python"
IR_VERSION = 10  # fixed, so the bytes of a view do not move with the installed onnx
DEFAULT_OPSET = 21
ELEMENT_TYPES = {
    torch.float32: TensorProto.FLOAT, torch.float64: TensorProto.DOUBLE, torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
    torch.int16: TensorProto.INT16, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64,
    torch.bool: TensorProto.BOOL,
}


def _op(target) -> tuple[str, str]:
    """(domain, op_type) of an fx target."""
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.name().split("::")
        domain = NAMESPACE if namespace == NAMESPACE else ATEN_DOMAIN if namespace == "aten" else f"org.pytorch.{namespace}"
        return domain, name if target._overloadname == "default" else f"{name}.{target._overloadname}"
    return PYTHON_DOMAIN, getattr(target, "__name__", str(target))


class _Values:
    """ONNX value names and types; versions of in-place written buffers."""

    def __init__(self, names: GraphNames):
        self.names, self.current, self.versions, self.info = names, {}, {}, {}

    def type_of(self, name: str, val) -> None:
        if isinstance(val, torch.Tensor):
            shape = [d if isinstance(d, int) else self.names.dim(d) for d in val.shape]
            self.info[name] = helper.make_tensor_value_info(name, ELEMENT_TYPES.get(val.dtype, TensorProto.UNDEFINED),
                                                            shape)
        elif isinstance(val, (int, torch.SymInt)):
            self.info[name] = helper.make_tensor_value_info(name, TensorProto.INT64, [])

    def define(self, node: torch.fx.Node, name: str) -> str:
        self.current[node] = name
        self.type_of(name, node.meta.get("val"))
        return name

    def write(self, node: torch.fx.Node) -> str:
        """A new version of `node` (a written buffer): later readers see it."""
        self.versions[node] = self.versions.get(node, 0) + 1
        name = f"{self.names.node(node)}@{self.versions[node]}"
        self.current[node] = name
        self.type_of(name, node.meta.get("val"))
        return name


def _attribute(value):
    """An ONNX attribute value for a constant argument (None: leave the attribute out)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
        return list(value)
    return repr(value)


def _arguments(node: torch.fx.Node, values: _Values, names: GraphNames) -> tuple[list[str], dict]:
    """Tensor inputs (every node inside an argument, in order) and attributes (the rest)."""
    schema = getattr(node.target, "_schema", None)
    arg_names = [a.name for a in schema.arguments] if schema is not None else []
    pairs = [(arg_names[i] if i < len(arg_names) else f"arg{i}", a) for i, a in enumerate(node.args)]
    inputs, attributes = [], {}
    for name, arg in [*pairs, *node.kwargs.items()]:
        found = []
        torch.fx.node.map_arg(arg, found.append)
        inputs += [values.current[n] for n in found]
        if isinstance(arg, torch.fx.Node):
            continue
        # A structured argument that mixes nodes and constants (`view(x, [s0, 8])`) keeps its shape as text.
        value = names.arg(arg) if found else _attribute(arg)
        if value is not None:
            attributes[name] = value
    return inputs, attributes


def graph_to_onnx(gm: torch.fx.GraphModule, inputs, outputs, title: str) -> onnx.ModelProto:
    names = GraphNames(gm, inputs, outputs)
    values = _Values(names)
    graph_inputs, nodes, graph_outputs, domains = [], [], [], {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            graph_inputs.append(values.define(node, names.node(node)))
        elif node.op == "call_function" and node.target is operator.getitem:
            # A piece of a multi-result op: that op already named its results `name.i`.
            values.define(node, f"{values.current[node.args[0]]}.{node.args[1]}")
        elif node.op == "call_function":
            domain, op_type = _op(node.target)
            domains[domain] = OPSET_VERSION if domain == NAMESPACE else 1
            node_inputs, attributes = _arguments(node, values, names)
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                results = [f"{node.name}.{i}" for i in range(len(val))]
                for i, (name, piece) in enumerate(zip(results, val)):
                    values.type_of(name, piece)
                values.current[node] = node.name
            else:
                results = [values.define(node, node.name)] if val is not None else []
            results += [values.write(buffer) for buffer in written(node)]
            nodes.append(helper.make_node(op_type, node_inputs, results, name=node.name, domain=domain, **attributes))
        elif node.op == "output":
            # Named after the calling convention (`logits`), not after the node that computed it.
            results = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for spec, result in zip(outputs, results):
                nodes.append(helper.make_node("Identity", [values.current[result]], [spec.name], name=f"output.{spec.name}"))
                values.type_of(spec.name, result.meta.get("val"))
                graph_outputs.append(spec.name)
    graph_outputs += [values.current[buffer] for buffer in values.versions]  # final version of each written buffer
    info = values.info
    graph = helper.make_graph(
        nodes, title,
        [info[n] for n in graph_inputs], [info[n] for n in graph_outputs],
        value_info=[v for n, v in info.items() if n not in set(graph_inputs) | set(graph_outputs)],
    )
    opsets = [helper.make_opsetid("", DEFAULT_OPSET)] + [helper.make_opsetid(d, v) for d, v in sorted(domains.items())]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="b12x", producer_version=b12x_toolchain.__version__)
    model.ir_version = IR_VERSION
    model.doc_string = (f"b12x pass {title}: view for inspection. In-place writes are new versions NAME@k; "
                        f"b12x ops are op set {OPSET_VERSION}.")
    return model

"""Build a pass's program straight from its checked graph document.

The program is the one `torch.export.load` gives (same nodes, names, arguments, metadata,
described values, signature, calling spec, ranges and guards; a test compares them node
for node and replays every pass through both), built without torch's deserialiser:

- `torch._export.serde.serialize` imports torch._dynamo, seconds before the first graph;
- its JSON goes through schema dataclasses (type hints resolved per object) before a node
  is made, and its graph module is generated and compiled twice (once for the
  deserialiser's module, again when ExportedProgram wraps it): here the JSON is read as
  it is and the code is generated once;
- symbolic sizes and fake tensors are made once per distinct value (graph_symbols.py);
- a session's replay needs none of them: `replay_graph` builds the same graph module and
  calling spec without described values (ReplayGraph says why).

Only what graph_json.py lets through is built: aten, op-set and collective calls, getitem,
plain-data arguments, user inputs and outputs. Anything else is a PackageError; nothing is
unpickled and no string is evaluated. graph_arguments.py reads the nodes' arguments and the
program's signature; this module builds the nodes and the program.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import operator

import torch
from torch._export.verifier import load_verifier
from torch.export import exported_program as ep
from torch.utils._pytree import TreeSpec

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.graph_arguments import ArgumentReader, one
from b12x_toolchain.runtime.package.graph_enums import KEYWORD, POSITIONAL

ST_DELIMITER = ";"  # torch's separator of stacked node metadata
# Ops on symbolic scalars, which torch deserialises by position and names after their output.
# graph_json.py lets only aten's `item` of them through; the rest are listed to keep torch's rule.
SYM_OPS = {operator.eq, operator.ne, operator.le, operator.ge, operator.lt, operator.gt, operator.neg, operator.pos,
           math.trunc, operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.pow,
           operator.truediv, operator.and_, operator.or_, operator.lshift, operator.rshift, torch.sym_not,
           torch.sym_int, torch.sym_float, torch.sym_ite, torch.sym_max, torch.sym_min, torch.sym_sqrt,
           torch.ops.aten.item.default}


def exported_program(document: dict) -> torch.export.ExportedProgram:
    """The program of a checked graph document (archive entry models/model.json)."""
    return _Builder(document, describe=True).program()


@dataclasses.dataclass(frozen=True)
class CallSpec:
    in_spec: TreeSpec
    out_spec: TreeSpec


@dataclasses.dataclass(frozen=True)
class ReplayGraph:
    """What a replay runs of a pass: the program's graph module and calling spec, with the same
    nodes, arguments and generated code, but no described values (`meta["val"]`). Those are
    fake tensors over symbolic sizes, which need a ShapeEnv, and a ShapeEnv imports
    torch._dynamo (seconds); a replay runs the module's code on real tensors and never reads
    them. Inspecting, compiling and checking read `PassGraph.program`, which has them."""

    graph_module: torch.fx.GraphModule
    call_spec: CallSpec


def replay_graph(document: dict) -> ReplayGraph:
    """The replayed part of a checked graph document's program (ReplayGraph)."""
    return _Builder(document, describe=False).replay()


# The graph schema the builder reads: major 8, any minor (torch 2.13's serialiser writes 8.20;
# torch 2.11's an older minor of 8). torch bumps the minor only to add (fields with defaults, enum
# values) and the major for anything else, and its own deserialiser reads every minor of its major.
# This builder reads the JSON itself, so it needs neither the running torch's SCHEMA_VERSION nor
# its deserialiser: fields added within major 8 are read with their defaults (a node's `name`, an
# argument's `kind`, `is_single_tensor_return`, `guards_code`), and keys, argument kinds and enum
# values it does not know are refused (graph_json.py, graph_enums.py). So a package's graphs read
# alike on every torch the runtime supports (torch_versions.py), older minors and newer ones.
GRAPH_SCHEMA_MAJOR = 8


def _check_schema_version(version) -> None:
    """Refuse a graph document of a schema major the builder does not read, naming both versions."""
    if not (isinstance(version, dict) and type(version.get("major")) is int and type(version.get("minor")) is int):
        raise PackageError(f"graph schema_version {str(version)[:80]!r}: expected {{'major': int, 'minor': int}}")
    if version["major"] != GRAPH_SCHEMA_MAJOR:
        raise PackageError(f"graph schema version {version['major']}.{version['minor']} is not one this runtime "
                           f"reads ({GRAPH_SCHEMA_MAJOR}.x, any minor)")


class _Builder:
    def __init__(self, document: dict, describe: bool):
        _check_schema_version(document.get("schema_version"))
        self.document, self.module = document, document["graph_module"]
        self.symbols = None
        if describe:  # imported here: sympy and symbolic shapes take a second, and only values need them
            from b12x_toolchain.runtime.package.graph_symbols import Symbols

            self.symbols = Symbols(document.get("range_constraints", {}))
        self.graph = torch.fx.Graph()
        self.nodes: dict[str, torch.fx.Node] = {}
        self.arguments = ArgumentReader(self.nodes)
        graph = self.module["graph"]
        self.values = {**graph.get("tensor_values", {}), **graph.get("sym_int_values", {})}
        self.tensor_names = set(graph.get("tensor_values", {}))
        self._stacks: dict[str, list] = {}
        for kind in ("sym_bool_values", "sym_float_values", "custom_obj_values"):
            if graph.get(kind):
                raise PackageError(f"graph_module.graph.{kind}: b12x graphs have none")

    def _built(self) -> tuple[ep.ExportGraphSignature, list[ep.ModuleCallEntry]]:
        signature = ep.ExportGraphSignature(
            input_specs=[self.arguments.input_spec(s) for s in self.module["signature"]["input_specs"]],
            output_specs=[self.arguments.output_spec(s) for s in self.module["signature"]["output_specs"]])
        self._graph(self.module["graph"], signature)
        calls = [ep.ModuleCallEntry(fqn=e["fqn"], signature=self.arguments.call_signature(e.get("signature")))
                 for e in self.module["module_call_graph"]]
        return signature, calls

    def replay(self) -> ReplayGraph:
        signature, calls = self._built()
        if not calls or calls[0].fqn != "" or calls[0].signature is None:
            raise PackageError("module_call_graph: expected the root module's calling spec first")
        module = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        # What ExportedProgram does to the graph it wraps, so that the code is the program's; the
        # code is generated again only if that removed a node (a duplicate getitem).
        nodes = len(self.graph.nodes)
        ep._common_getitem_elimination_pass(module, signature, calls)
        if len(self.graph.nodes) != nodes:
            module.recompile()
        return ReplayGraph(module, CallSpec(calls[0].signature.in_spec, calls[0].signature.out_spec))

    def program(self) -> torch.export.ExportedProgram:
        signature, calls = self._built()
        ranges = {self.symbols.by_name[name]: bounds for name, bounds in self.symbols.ranges.items()
                  if name in self.symbols.by_name}
        # The root holds no attributes: the module's code is generated once, here.
        program = ep.ExportedProgram(root=torch.nn.Module(), graph=self.graph, graph_signature=signature,
                                     state_dict={}, range_constraints=ranges, module_call_graph=calls,
                                     example_inputs=None, constants={},
                                     verifiers=[load_verifier(v) for v in self.document.get("verifiers", [])])
        program.graph_module.meta.update(treespec_namedtuple_fields={})
        program._guards_code = self.document.get("guards_code", [])
        return program

    # -- values -----------------------------------------------------------------------

    def _name(self, name: str, node: torch.fx.Node) -> None:
        """Name a node as the document does and give it its described value."""
        if name in self.nodes:
            raise PackageError(f"value {name!r} is defined twice")
        node.name = name
        self.nodes[name] = node
        if self.symbols is not None:
            node.meta["val"] = self._value(name)

    def _describe(self, node: torch.fx.Node, val) -> None:
        if self.symbols is not None:
            node.meta["val"] = val

    def _value(self, name: str):
        if name not in self.values:
            raise PackageError(f"value {name!r} has no description")
        if name in self.tensor_names:
            return self.symbols.fake_tensor(self.values[name])
        return self.symbols.sym_int(self.values[name])

    # -- the graph --------------------------------------------------------------------

    def _graph(self, graph: dict, signature: ep.ExportGraphSignature) -> None:
        for i, argument in enumerate(graph["inputs"]):
            kind, value = one(argument)
            if kind == "as_tensor" or (kind == "as_sym_int" and one(value)[0] == "as_name"):
                name = value["name"] if kind == "as_tensor" else value["as_name"]
                self._name(name, self.graph.placeholder(name))
            elif kind in ("as_int", "as_float", "as_bool", "as_none", "as_string"):
                placeholder = self.graph.placeholder(signature.input_specs[i].arg.name or f"arg{i}")
                self._describe(placeholder, self.arguments.read(argument))
            else:
                raise PackageError(f"graph input {i} of kind {kind!r}")
        for node in graph["nodes"]:
            self._call(node)
        outputs = [self._output(o) for o in graph["outputs"]]
        if graph.get("is_single_tensor_return"):
            if len(outputs) != 1:
                raise PackageError(f"a single tensor return of {len(outputs)} outputs")
            output = self.graph.output(outputs[0])
        else:
            output = self.graph.output(tuple(outputs))
        if self.symbols is None:
            return
        if graph.get("is_single_tensor_return"):
            output.meta["val"] = outputs[0].meta["val"]
        else:
            output.meta["val"] = tuple(o.meta["val"] if isinstance(o, torch.fx.Node) else o for o in outputs)
        if self.symbols.unbacked:  # values defined by data, bound where they are first produced
            from torch.fx.experimental.symbolic_shapes import _free_unbacked_symbols_with_path

            pending, env = set(self.symbols.unbacked), self.symbols.shape_env
            for node in self.graph.nodes:
                val = node.meta.get("val")
                bindings = None if val is None else _free_unbacked_symbols_with_path(val, (), shape_env=env,
                                                                                      pending=pending, simplify=True)
                if bindings:
                    node.meta["unbacked_bindings"] = bindings
            if pending:
                raise PackageError(f"unbacked symbols {sorted(map(str, pending))} are never produced")

    def _output(self, argument: dict):
        kind, value = one(argument)
        if kind == "as_tensor":
            return self.arguments.node(value["name"])
        if kind in ("as_sym_int", "as_sym_bool", "as_sym_float"):
            return self.arguments.node(value["as_name"])
        if kind in ("as_int", "as_float", "as_bool", "as_none"):
            return None if kind == "as_none" else value
        raise PackageError(f"a graph output of kind {kind!r}")

    def _call(self, node: dict) -> None:
        target = _target(node["target"])
        name = node.get("name") or None
        if target in SYM_OPS:
            args = tuple(self.arguments.read(a["arg"]) for a in node["inputs"])
            made = self.graph.create_node("call_function", target, args, {}, name or one(node["outputs"][0])[1]["as_name"])
            self._name(one(node["outputs"][0])[1]["as_name"], made)
        elif isinstance(target, torch._ops.OpOverload):
            if name is None and _single_tensor_return(target):
                name = node["outputs"][0]["as_tensor"]["name"]
            args, kwargs = self._inputs(target, node["inputs"])
            made = self.graph.create_node("call_function", target, args, kwargs, name)
            self._outputs(node, made)
        else:  # operator.getitem: arguments by position, or by name when the document names them
            args = tuple(self.arguments.read(a["arg"]) for a in node["inputs"] if a.get("kind") == POSITIONAL
                         or a["name"] == "")
            kwargs = {a["name"]: self.arguments.read(a["arg"]) for a in node["inputs"]
                      if not (a.get("kind") == POSITIONAL or a["name"] == "")}
            made = self.graph.create_node("call_function", target, args, kwargs, name)
            self._outputs(node, made)
        made.meta.update(self._metadata(node.get("metadata", {})))
        if self.symbols is None:
            pass  # a replay needs no symbolic facts
        elif target is torch.ops.aten._assert_scalar.default and not isinstance(made.args[0], bool):
            if isinstance(expr := made.args[0].meta["val"], torch.SymBool):
                self.symbols.shape_env.guard_or_defer_runtime_assert(expr.node.expr, "", made)
        elif target is torch.ops.aten.sym_constrain_range_for_size.default:
            if isinstance(sym := made.args[0].meta["val"], torch.SymInt):
                self.symbols.shape_env._constrain_range_for_size(sym.node.expr)
        if "nn_module_stack" not in made.meta:  # serialising drops empty stacks
            made.meta["nn_module_stack"] = {}

    def _inputs(self, target, inputs: list) -> tuple[tuple, dict]:
        """Arguments by the op's schema: positional or keyword as the document records them,
        or else as the schema says (torch's rule, kept for documents that record no kind)."""
        kinds = {a["name"]: a.get("kind") for a in inputs}
        given = {a["name"]: self.arguments.read(a["arg"]) for a in inputs}
        args, kwargs = [], {}
        for schema_arg in target._schema.arguments:
            name = schema_arg.name
            if name in given:
                if kinds[name] == POSITIONAL:
                    args.append(given[name])
                    continue
                if kinds[name] == KEYWORD and not keyword.iskeyword(name):
                    kwargs[name] = given[name]
                    continue
            if not schema_arg.has_default_value() and not schema_arg.kwarg_only:
                args.append(given[name])
            elif keyword.iskeyword(name):
                kwargs = {}
                args.append(given[name])
            elif name in given:
                kwargs[name] = given[name]
        return tuple(args), kwargs

    def _outputs(self, node: dict, made: torch.fx.Node) -> None:
        outputs = node["outputs"]
        if not outputs:
            return
        if len(outputs) == 1:
            kind, value = one(outputs[0])
            if kind == "as_tensor":
                return self._name(value["name"], made)
            if kind in ("as_sym_int", "as_sym_bool", "as_sym_float"):
                return self._name(value["as_name"], made)
            if kind == "as_none":
                self._describe(made, None)
                made._rename(f"{self.graph._target_to_str(made.target)}_unused")
                return None
            if kind != "as_tensors":
                raise PackageError(f"node {made.name}: an output of kind {kind!r}")
        metadata, vals = self._metadata(node.get("metadata", {})), []
        if len(outputs) == 1:
            self._getitems(vals, made, [{"as_tensor": a} for a in one(outputs[0])[1]], metadata)
        else:
            self._getitems(vals, made, outputs, metadata)
        self._describe(made, tuple(vals))
        self.nodes[made.name] = made

    def _getitems(self, vals: list, made: torch.fx.Node, outputs: list, metadata: dict) -> None:
        """One getitem node per output of a call that returns several (FX's one value per node)."""
        for i, argument in enumerate(outputs):
            kind, value = one(argument)
            if kind in ("as_tensor", "as_sym_int", "as_sym_float"):
                name = value["name"] if kind == "as_tensor" else value["as_name"]
                item = self.graph.create_node("call_function", operator.getitem, (made, i), name=name)
                self._name(name, item)
                vals.append(item.meta.get("val"))
            elif kind == "as_tensors":
                item = self.graph.create_node("call_function", operator.getitem, (made, i))
                vals.append([])
                self._getitems(vals[-1], item, [{"as_tensor": a} for a in value], metadata)
                self._describe(item, vals[-1])
            elif kind == "as_none":
                item = self.graph.create_node("call_function", operator.getitem, (made, i), name="as_none")
                vals.append(None)
                self._describe(item, None)
            else:
                raise PackageError(f"an output of kind {kind!r}")
            item.meta.update(metadata)

    def _metadata(self, metadata: dict) -> dict:
        out = {}
        if trace := metadata.get("stack_trace"):
            out["stack_trace"] = trace
        if stack := metadata.get("nn_module_stack"):
            if stack not in self._stacks:
                self._stacks[stack] = [_stack_entry(item) for item in stack.split(ST_DELIMITER)]
            out["nn_module_stack"] = dict(self._stacks[stack])  # each node its own dict, as torch makes
        if torch_fn := metadata.get("torch_fn"):
            out["torch_fn"] = tuple(torch_fn.split(ST_DELIMITER))
        return out



def _target(text: str):
    """The callable a checked target names (graph_json.py allowed the name)."""
    if text.startswith("_operator."):
        found, parts = operator, text.split(".")[1:]
    elif text.startswith("torch."):
        found, parts = torch, text.split(".")[1:]
    else:
        raise PackageError(f"target {text[:120]!r} is not an op")
    for part in parts:
        if not hasattr(found, part):
            raise PackageError(f"target {text[:120]!r} is not registered in this process")
        found = getattr(found, part)
    if not (found in SYM_OPS or isinstance(found, torch._ops.OpOverload) or found is operator.getitem):
        raise PackageError(f"target {text[:120]!r} is not an op overload")
    return found


def _single_tensor_return(target) -> bool:
    returns = target._schema.returns
    return len(returns) == 1 and isinstance(returns[0].real_type, torch.TensorType)


def _stack_entry(item: str) -> tuple[str, tuple[str, str]]:
    """key, (path, type) of one serialised nn_module_stack entry: "key,path,type", where the path
    may hold commas inside brackets."""
    parts, start, depth = [], 0, 0
    for i, char in enumerate(item):
        if char in "[(":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(item[start:i])
            start = i + 1
    parts.append(item[start:])
    if len(parts) != 3:
        raise PackageError(f"nn_module_stack entry {item[:120]!r} is not key,path,type")
    return parts[0], (parts[1], parts[2])

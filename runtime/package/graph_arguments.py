"""A graph document's serialised arguments, read as values of the graph being built from it
(graph_loader.py): plain data as itself, a name as the node that defines it, and the program's
signature and calling specs made of them. Only the argument kinds graph_json.py lets through are
read; any other is a PackageError.
"""

from __future__ import annotations

import torch
from torch.export import exported_program as ep
from torch.utils._pytree import treespec_loads

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.graph_enums import device, dtype, layout, memory_format


def one(union: dict) -> tuple[str, object]:
    """(kind, value) of a serialised union: an object with one key."""
    (kind, value), = union.items()
    return kind, value


class ArgumentReader:
    """Arguments as values of a graph being built: a name resolves to the node `nodes` holds for
    it, which the builder fills as it defines them."""

    def __init__(self, nodes: dict[str, torch.fx.Node]):
        self.nodes = nodes

    def node(self, name: str) -> torch.fx.Node:
        if name not in self.nodes:
            raise PackageError(f"value {name!r} is used before it is defined")
        return self.nodes[name]

    def read_symbolic(self, argument: dict):
        kind, value = one(argument)
        if kind == "as_name":
            return self.node(value)
        if kind in ("as_int", "as_bool"):
            return value
        if kind == "as_float":
            return float(value)
        raise PackageError(f"a symbolic argument of kind {kind!r}")

    def read(self, argument: dict):
        kind, value = one(argument)
        if kind in ("as_none",):
            return None
        if kind == "as_tensor":
            return self.node(value["name"])
        if kind in ("as_int", "as_bool", "as_string"):
            return value
        if kind == "as_float":  # JSON writes infinities and NaN as strings; torch reads them with float()
            return float(value)
        if kind in ("as_ints", "as_bools", "as_strings"):
            return list(value)
        if kind == "as_floats":
            return [float(v) for v in value]
        if kind == "as_tensors":
            return [self.node(a["name"]) for a in value]
        if kind == "as_optional_tensors":
            return [None if one(a)[0] == "as_none" else self.node(one(a)[1]["name"]) for a in value]
        if kind in ("as_sym_int", "as_sym_float", "as_sym_bool"):
            return self.read_symbolic(value)
        if kind in ("as_sym_ints", "as_sym_floats", "as_sym_bools"):
            return [self.read_symbolic(a) for a in value]
        if kind == "as_scalar_type":
            return dtype(value)
        if kind == "as_layout":
            return layout(value)
        if kind == "as_memory_format":
            return memory_format(value)
        if kind == "as_device":
            return device(value)
        if kind == "as_complex":
            return complex(float(value["real"]), float(value["imag"]))
        raise PackageError(f"an argument of kind {kind!r}")

    # -- signature --------------------------------------------------------------------

    def argument_spec(self, argument: dict):
        kind, value = one(argument)
        if kind == "as_tensor":
            return ep.TensorArgument(name=value["name"])
        if kind == "as_sym_int":
            return ep.SymIntArgument(name=value["as_name"])
        if kind == "as_sym_float":
            return ep.SymFloatArgument(name=value["as_name"])
        if kind == "as_custom_obj":
            raise PackageError("a custom object in the signature")
        return ep.ConstantArgument(name="", value=self.read(argument))

    def input_spec(self, spec: dict) -> ep.InputSpec:
        kind, value = one(spec)
        if kind != "user_input":
            raise PackageError(f"an input of kind {kind!r}; b12x graphs take every tensor as a user input")
        return ep.InputSpec(kind=ep.InputKind.USER_INPUT, arg=self.argument_spec(value["arg"]), target=None)

    def output_spec(self, spec: dict) -> ep.OutputSpec:
        kind, value = one(spec)
        if kind != "user_output":
            raise PackageError(f"an output of kind {kind!r}; b12x graphs return user outputs only")
        return ep.OutputSpec(kind=ep.OutputKind.USER_OUTPUT, arg=self.argument_spec(value["arg"]), target=None)

    def call_signature(self, signature: dict | None) -> ep.ModuleCallSignature | None:
        if not signature:
            return None
        return ep.ModuleCallSignature(
            inputs=[self.argument_spec(a) for a in signature["inputs"]],
            outputs=[self.argument_spec(a) for a in signature["outputs"]],
            in_spec=treespec_loads(signature["in_spec"]), out_spec=treespec_loads(signature["out_spec"]),
            forward_arg_names=signature.get("forward_arg_names") or None)

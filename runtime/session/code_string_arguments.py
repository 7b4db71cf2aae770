"""code_string_arguments: on the CPU, the string and int-list arguments of op calls become integers.

Inductor's C++ wrapper (compiled.CPU_CONFIG) calls an op through torch's C shim when every
argument is a tensor, an integer, a float or a bool. An op with a string argument (a cache
format, a page layout, an activation rule) or a list of ints (Engram's primes) it calls
through the boxed dispatcher instead, and the compiler then reads the dispatcher's headers
for every graph: 7.2 s of CPU of the 15 s that building a one-layer commit graph's wrapper
took here, for any graph calling one such op, and nearly every pass graph does.

So before a graph is compiled for the CPU, each such call becomes a call of the op's coded
twin (`b12x_toolchain_coded::<op>`), whose schema takes an int where the op takes a str or
an int[]: the integer is a digest of the value, and the twin turns it back and calls the op's
CPU kernel (its torch reference), so the same kernel runs on the same arguments. The twins
live in a namespace of their own: they are the lowering's, never part of the op set or of a
package. A process knows the values it has coded; a compiled graph read back from the cache
is lowered again first (CompiledGraph.compile), which codes its values in the process that
replays it.
"""

from __future__ import annotations

import hashlib

import torch

from b12x_toolchain.runtime.ops.define import REFERENCES
from b12x_toolchain.runtime.ops.namespace import NAMESPACE
from b12x_toolchain.runtime.ops.opset import OPS
from b12x_toolchain.runtime.rewrite import NodeRewrite, Rule, replace_args

TWIN_NAMESPACE = f"{NAMESPACE}_coded"
CODED_TYPES = {"str": "int", "Optional[str]": "int?", "List[int]": "int"}  # argument type -> the twin's
_LIBRARY = torch.library.Library(TWIN_NAMESPACE, "FRAGMENT")
_values: dict[int, str | tuple[int, ...]] = {}
_twins: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}


def code(value: str | list[int]) -> int:
    """The integer standing for `value` (a string, or a list of ints) in a coded call: 56 bits of
    the SHA-256 of its text, a non-negative int64."""
    kept = value if isinstance(value, str) else tuple(int(v) for v in value)
    text = f"s{value}" if isinstance(value, str) else "l" + ",".join(map(str, kept))
    number = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    if _values.setdefault(number, kept) != kept:
        raise ValueError(f"{_values[number]!r} and {kept!r} have the same code {number}")
    return number


def _value(number: int) -> str | list[int]:
    try:
        kept = _values[number]
    except KeyError:
        raise RuntimeError(f"argument code {number} was not made in this process (code_string_arguments)") from None
    return kept if isinstance(kept, str) else list(kept)


def coded_arguments(op: torch._ops.OpOverload) -> list[str]:
    """The names of `op`'s arguments that the C shim cannot carry."""
    return [a.name for a in op._schema.arguments if str(a.type) in CODED_TYPES]


def twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """`op`'s coded twin, defined the first time it is asked for."""
    if op not in _twins:
        schema = op._schema
        name = schema.name.split("::", 1)[1]
        coded = set(coded_arguments(op))
        names = [a.name for a in schema.arguments]

        reference = REFERENCES[name]  # the op's CPU kernel, called without a second dispatch

        def decoded(args, kwargs) -> tuple[list, dict]:
            return ([_value(a) if names[i] in coded and a is not None else a for i, a in enumerate(args)],
                    {k: _value(v) if k in coded and v is not None else v for k, v in kwargs.items()})

        def kernel(*args, **kwargs):
            args, kwargs = decoded(args, kwargs)
            return reference(*args, **kwargs)

        def fake(*args, **kwargs):
            args, kwargs = decoded(args, kwargs)
            return op(*args, **kwargs)  # the op's own fake

        text, returns = str(schema).split("(", 1)[1].rsplit(") -> ", 1)  # no argument has a default
        arguments = ", ".join(f"{CODED_TYPES[str(a.type)]} {a.name}" if a.name in coded else written
                              for a, written in zip(schema.arguments, text.split(", "), strict=True))
        _LIBRARY.define(f"{name}({arguments}) -> {returns}", tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(name, kernel, "CPU")  # twins are made for the CPU's wrapper only
        torch.library.register_fake(f"{TWIN_NAMESPACE}::{name}", lib=_LIBRARY)(fake)
        _twins[op] = getattr(getattr(torch.ops, TWIN_NAMESPACE), name).default
    return _twins[op]


def _to_twin(graph: torch.fx.Graph, node: torch.fx.Node, args: dict) -> None:
    values = {name: code(args[name]) for name in coded_arguments(node.target) if args.get(name) is not None}
    node.target = twin(node.target)  # the same argument names in the same places
    replace_args(node, **values)


CODE_STRING_ARGUMENTS = NodeRewrite("code_string_arguments", tuple(
    Rule(op, edit=_to_twin) for op in OPS.values() if coded_arguments(op)))

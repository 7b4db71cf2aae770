"""Deserialise a checked graph document into the program `torch.export.load` gives, at the
cost of the graph's distinct content.

`torch.export.load` spends its time on work it repeats for every JSON object and every value:
it looks up the Python type hints of a schema class for each of the ~300,000 objects of a
tiny package's graphs (half the time), parses every symbolic size with `sympy.sympify` (an
`eval` per dimension), and builds every node's fake tensor through the fake-tensor
dispatcher, where symbolic strides cost sympy arithmetic each time. A pass graph is a few
layer kinds repeated, so almost all of that work is the same work again.

Here the same deserialiser (torch's GraphModuleDeserializer: same nodes, names, arguments,
metadata and signature) is fed and helped so that repeated work is done once:

- JSON to schema dataclasses through converters built once per schema type (`_converter`);
- each symbolic expression parsed once, each symbolic size made once (sizes are immutable);
- each distinct (dtype, sizes, strides, device) described once as a meta tensor; every node
  with that description gets its own FakeTensor over it. Those fake tensors share a meta
  storage, which holds no bytes: they describe shapes and dtypes, which is all that reads
  them after loading (replay runs the graph module's code; views read shapes; Inductor
  traces the graph afresh).

The document has been checked (graph_json.py) before it gets here; nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import types
import typing
from typing import Annotated, Any, Callable

import torch
from torch._export.serde import schema, serialize
from torch._export.serde.union import _Union, _UnionTag
from torch._export.verifier import load_verifier
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import exported_program as ep
from torch.fx.experimental.symbolic_shapes import ValueRanges
from torch.utils._sympy.numbers import int_oo


def exported_program(document: dict) -> torch.export.ExportedProgram:
    """The program of a checked graph document (archive entry models/model.json)."""
    shared = _SHARED.set({})  # what this document's conversion shares lives as long as the call
    try:
        with _no_collection():
            return _deserialize(_converter(schema.ExportedProgram)(document))
    finally:
        _SHARED.reset(shared)


@contextlib.contextmanager
def _no_collection():
    """The garbage collector paused: deserialising makes a few hundred thousand objects and no
    garbage, and collections triggered by that many allocations cost as much as making them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -- JSON to schema dataclasses ------------------------------------------------------------

def _identity(value):
    return value


@functools.cache
def _converter(cls) -> Callable[[Any], Any]:
    """A function turning JSON data of schema type `cls` into what torch's `_dict_to_dataclass`
    makes of it; built once per type instead of resolving type hints for every object."""
    cls = serialize._resolve_schema_cls(cls)
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin is Annotated:
        return _converter(cls.__origin__)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = _converter(args[0])
        return lambda data: None if data is None else inner(data)
    if isinstance(cls, type) and issubclass(cls, _Union):
        return _union_converter(cls)
    if dataclasses.is_dataclass(cls):
        return _dataclass_converter(cls)
    if origin is list:
        item = _converter(args[0])
        return _identity if item is _identity else lambda data: [item(x) for x in data] if data else data
    if origin is dict:
        value = _converter(args[1])
        return _identity if value is _identity else lambda data: {k: value(v) for k, v in data.items()}
    if cls is float:
        return float
    return _identity


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, globalns=vars(schema))


def _union_converter(cls) -> Callable:
    hints = _hints(cls)
    unset = {f.name: None for f in dataclasses.fields(cls)}
    converters, tags = {}, {}  # filled on first use: a union may contain itself (an Argument's list of Arguments)

    def convert(data: dict):
        (key, value), = data.items()
        if key not in converters:
            converters[key], tags[key] = _converter(hints[key]), _UnionTag.create(key, cls)
        # What cls.create(key=value) makes, without re-checking the class's fields each time.
        union = object.__new__(cls)
        union.__dict__.update(unset)
        union.__dict__[key] = converters[key](value)
        union._type = tags[key]
        return union

    return convert


def _dataclass_converter(cls) -> Callable:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    converters = {}

    def convert(data: dict):
        if not converters:
            converters.update({name: _converter(hints[name]) for name in names})
        # Keys the dataclass does not define are ignored, as torch does (forward compatibility).
        return cls(**{name: converters[name](data[name]) for name in names if name in data})

    if cls is schema.TensorMeta:  # one per value; a pass has few distinct ones (a layer's, repeated)
        return _shared(convert)
    return convert


# Per call of exported_program (and per thread): repr of a JSON value -> what it was converted to.
_SHARED: contextvars.ContextVar[dict] = contextvars.ContextVar("b12x_graph_loader_shared")


def _shared(convert: Callable) -> Callable:
    """`convert`, made once per distinct JSON value of a document and shared: for immutable
    descriptions (a tensor's dtype, sizes, strides), which the deserialiser then recognises
    by identity."""

    def shared(data):
        made, key = _SHARED.get(), repr(data)  # equal reprs of JSON values are equal values
        if key not in made:
            made[key] = convert(data)
        return made[key]

    return shared


# -- the graph, with repeated work done once ------------------------------------------------

def _sym_key(value) -> tuple:
    """A hashable key of a serialised SymInt (an int, or an expression with its hint)."""
    if value.type == "as_expr":
        hint = value.value.hint
        return value.value.expr_str, None if hint is None else hint.value
    return (value.value,)


def _memoised(method: Callable, key: Callable) -> Callable:
    memo = {}

    def call(*args):
        k = key(*args)
        if k not in memo:
            memo[k] = method(*args)
        return memo[k]

    return call


def _graph_deserializer() -> serialize.GraphModuleDeserializer:
    """torch's deserialiser (it may not be subclassed), with its per-value steps memoised on the instance."""
    d = serialize.GraphModuleDeserializer()
    # Parsing has side effects only the first time (the symbol's hint and range in the shape env).
    d._parse_sym_expr = _memoised(d._parse_sym_expr, lambda expr, hint=None: (expr, hint))
    d.deserialize_sym_int = _memoised(d.deserialize_sym_int, lambda s: (s.type, *_sym_key(s)))
    metas = {}  # id of a shared TensorMeta (_shared) -> (it, its meta tensor, device)

    def tensor_meta(meta) -> FakeTensor:
        key = id(meta)
        if key not in metas:
            sizes = [d.deserialize_sym_int(s) for s in meta.sizes]
            strides = [d.deserialize_sym_int(s) for s in meta.strides]
            described = torch.empty_strided(sizes, strides, dtype=serialize._SERIALIZE_TO_TORCH_DTYPE[meta.dtype],
                                            device="meta")
            metas[key] = (meta, described, serialize.deserialize_device(meta.device))
        _, described, device = metas[key]
        return FakeTensor(d.fake_tensor_mode, described.detach(), device).requires_grad_(meta.requires_grad)

    d.deserialize_tensor_meta = tensor_meta
    return d


def _deserialize(program: schema.ExportedProgram) -> torch.export.ExportedProgram:
    """ExportedProgramDeserializer.deserialize with the deserialiser above; b12x archives hold
    no weights, constants or sample inputs (graph_archive.py refuses any)."""
    version = program.schema_version
    if version.major != schema.SCHEMA_VERSION[0] and (version.major, version.minor) != (0, 0):
        raise serialize.SerializeError(f"schema version {version} is not torch's {schema.SCHEMA_VERSION}")
    ranges = {name: ValueRanges(serialize._int_to_sympy_int(r.min_val, -int_oo),
                                serialize._int_to_sympy_int(r.max_val, int_oo))
              for name, r in program.range_constraints.items()}
    result = _graph_deserializer().deserialize(program.graph_module, {}, {}, None, ranges)
    loaded = ep.ExportedProgram(
        root=result.graph_module, graph=result.graph_module.graph, graph_signature=result.signature,
        state_dict=result.state_dict, range_constraints=serialize.ExportedProgramDeserializer()
        .deserialize_range_constraints(ranges, result.names_to_symbols),
        module_call_graph=result.module_call_graph, example_inputs=result.example_inputs, constants=result.constants,
        verifiers=[load_verifier(v) for v in program.verifiers])
    loaded._guards_code = program.guards_code
    return loaded

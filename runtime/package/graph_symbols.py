"""The symbolic side of a checked graph document: sizes, symbols, ranges and described tensors.

A pass graph's values are described by dtype and sizes, some of them symbolic (the rows
of a step are `s14`, a bucket of them `32*s14`). Loading gives each node the fake tensor
torch's own deserialiser gives it (same symbols, hints and ranges in a fresh ShapeEnv),
made the way graph_loader.py needs it to be cheap:

- expressions are built from the small grammar graph_json.py already checked (symbols,
  integers and a few functions), by calling the same sympy constructors that evaluating
  the text would call: no `sympify`, no `eval`;
- each expression, each symbolic size and each distinct tensor description is made once
  (a pass is a few layer kinds repeated); every node still gets its own FakeTensor, over a
  shared meta tensor that holds no bytes;
- a symbol's range is set with a fixed source location. torch's deserialiser lets the
  ShapeEnv work out the caller's frame, which imports torch._dynamo (seconds) to know
  which files to skip; the location is only ever shown in a guard's error message.
"""

from __future__ import annotations

import math

import sympy
import torch
from torch._guards import SLoc
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental import symbolic_shapes
from torch.utils._sympy import functions
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.symbol import SymT, symbol_is_type
from torch.utils._sympy.value_ranges import ValueRanges
from torch.utils._traceback import CapturedTraceback

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.graph_enums import device, dtype
from b12x_toolchain.runtime.package.graph_json import EXPR_TOKEN

# What the names of graph_json's expression grammar stand for when torch evaluates them.
FUNCTIONS = {"Mul": sympy.Mul, "Add": sympy.Add, "Pow": sympy.Pow, "Max": sympy.Max, "Min": sympy.Min,
             "Mod": functions.Mod, "FloorDiv": functions.FloorDiv, "CleanDiv": functions.CleanDiv,
             "PythonMod": functions.PythonMod, "CeilToInt": functions.CeilToInt, "FloorToInt": functions.FloorToInt}
RANGE_SOURCE = SLoc("the range constraints of a b12x package graph", None)


def sympy_int(value, default):
    """A range bound as torch's deserialiser reads it (None: unbounded)."""
    if value is None:
        return default
    if value in (math.inf, -math.inf):
        return int_oo if value > 0 else -int_oo
    return sympy.Integer(value)


def parse_expr(text: str) -> sympy.Expr:
    """The sympy expression of a checked expression string (graph_json's grammar)."""
    stack: list[list] = [[None]]  # per open call: [function, *arguments]; the bottom holds the result
    pos = 0
    while pos < len(text):
        match = EXPR_TOKEN.match(text, pos)
        if match is None:
            raise PackageError(f"symbolic expression {text[:120]!r} is outside the allowed grammar")
        symbol, integer, function, _comma, close = match.groups()
        if symbol:
            name, *flags = (part.strip() for part in symbol[len("Symbol("):-1].split(","))
            stack[-1].append(sympy.Symbol(name.strip("'"), **{flag.split("=")[0]: True for flag in flags}))
        elif integer:
            stack[-1].append(sympy.Integer(int(integer[len("Integer("):-1])))
        elif function:
            stack.append([FUNCTIONS[function]])
        elif close:
            call = stack.pop()
            stack[-1].append(call[0](*call[1:]))
        pos = match.end()
    if len(stack) != 1 or len(stack[0]) != 2:
        raise PackageError(f"symbolic expression {text[:120]!r} is not one complete expression")
    return stack[0][1]


class Symbols:
    """The ShapeEnv and fake-tensor mode of one graph, and everything made in them, made once."""

    def __init__(self, range_constraints: dict):
        self.ranges = {name: ValueRanges(sympy_int(r.get("min_val"), -int_oo), sympy_int(r.get("max_val"), int_oo))
                       for name, r in range_constraints.items()}
        self.shape_env = symbolic_shapes.ShapeEnv(assume_static_by_default=True)
        self.fake_mode = FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True,
                                        shape_env=self.shape_env)
        self.by_name: dict[str, sympy.Expr] = {}  # str(expression) -> the expression registered first
        self.unbacked: set[sympy.Symbol] = set()
        self._exprs, self._ints, self._described = {}, {}, {}

    def expr(self, text: str, hint=None) -> sympy.Expr:
        key = (text, hint)
        if key not in self._exprs:
            self._exprs[key] = self._register(parse_expr(text), hint)
        return self._exprs[key]

    def _register(self, expr: sympy.Expr, hint=None) -> sympy.Expr:
        """What torch's deserialiser records of an expression and its parts, bottom up: the
        first object of each printed form, hints, ranges of named symbols, unbacked symbols."""
        if expr.is_Integer or expr.is_Float or expr.is_Boolean:
            return expr
        text = str(expr)
        for arg in expr.args:
            self._register(arg)
        if text in self.by_name:
            expr = self.by_name[text]
        else:
            self.by_name[text] = expr
            if isinstance(expr, sympy.Symbol) and symbol_is_type(expr, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)):
                self.unbacked.add(expr)
        env = self.shape_env
        if hint is not None and expr not in env.backed_var_to_val:
            env.add_backed_var_to_val(expr, hint)
        if (bounds := self.ranges.get(text)) is not None:
            lower = sympy_int(bounds.lower, -int_oo)
            env._update_var_to_range(expr, ValueRanges(lower, bounds.upper),
                                     symbolic_shapes.ValueRangesSLoc(RANGE_SOURCE, RANGE_SOURCE))
        if isinstance(expr, sympy.Symbol):
            env.var_to_stack[expr] = CapturedTraceback.extract(skip=1)
        return expr

    def sym_int(self, value: dict):
        """A serialised SymInt ({"as_int": n} or {"as_expr": {expr_str, hint}}) as an int or SymInt."""
        (kind, body), = value.items()
        if kind == "as_int":
            return body
        if kind != "as_expr":
            raise PackageError(f"a symbolic size of kind {kind!r}")
        hint = body.get("hint")
        hint = None if hint is None else hint["as_int"]
        key = (body["expr_str"], hint)
        if key not in self._ints:
            self._ints[key] = self.shape_env.create_symintnode(self.expr(body["expr_str"], hint), hint=hint)
        return self._ints[key]

    def fake_tensor(self, meta: dict) -> FakeTensor:
        """A node's own fake tensor for a serialised TensorMeta; the description behind it is
        made once per distinct (dtype, sizes, strides, device)."""
        key = repr((meta["dtype"], meta["sizes"], meta["strides"], meta["device"]))
        if key not in self._described:
            sizes = [self.sym_int(s) for s in meta["sizes"]]
            strides = [self.sym_int(s) for s in meta["strides"]]
            described = torch.empty_strided(sizes, strides, dtype=dtype(meta["dtype"]), device="meta")
            self._described[key] = (described, device(meta["device"]))
        described, on = self._described[key]
        return FakeTensor(self.fake_mode, described.detach(), on).requires_grad_(meta["requires_grad"])


"""The pieces the graph loader keeps of torch's deserialiser agree with torch's: the enum tables,
and the sympy expressions of graph_json's grammar (built without evaluating any text)."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._export.serde import serialize
from torch.utils._sympy import functions

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package import graph_enums
from b12x_toolchain.runtime.package.graph_json import _is_expr
from b12x_toolchain.runtime.package.graph_symbols import Symbols, parse_expr

S0 = "Symbol('s0', positive=True, integer=True)"
EXPRS = [S0, "Integer(-3)", f"Mul(Integer(32), {S0})", f"Add({S0}, Integer(1))",
         f"FloorDiv(Add({S0}, Integer(63)), Integer(64))", f"Max(Integer(1), {S0})",
         f"PythonMod({S0}, Integer(8))", f"Mul(Symbol('s1', positive=True, integer=True), {S0})",
         "Symbol('u3', integer=True)", f"CeilToInt({S0})", f"Pow({S0}, Integer(2))"]


def test_a_device_is_what_torch_makes_of_it():
    # The enum tables are compared name by name in test_torch_versions.py: on torch 2.11 ours
    # hold three values its serialiser lacks, so whole-table equality holds on 2.13 only.
    assert graph_enums.device({"type": "cpu", "index": None}) == serialize.deserialize_device(
        serialize.Device(type="cpu", index=None))


@pytest.mark.parametrize("text", EXPRS)
def test_an_expression_is_what_torch_makes_of_its_text(text):
    assert _is_expr(text)  # the grammar the package check holds expressions to
    names = {name: getattr(functions, name) for name in ("FloorDiv", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
                                                        "FloorToInt")}
    expected = sympy.sympify(text, locals=names)
    built = parse_expr(text)
    assert built == expected and type(built) is type(expected) and str(built) == str(expected)


def test_a_text_outside_the_grammar_is_refused():
    for text in ("Symbol('s0'", "__import__('os')", f"Mul({S0}, Integer(2)) Integer(3)"):
        with pytest.raises(PackageError):
            parse_expr(text)


def test_symbols_are_made_once_with_their_hints_and_ranges():
    symbols = Symbols({"s0": {"min_val": 2, "max_val": 64}})
    size = {"as_expr": {"expr_str": f"Mul(Integer(4), {S0})", "hint": {"as_int": 12}}}
    first = symbols.sym_int(size)
    assert isinstance(first, torch.SymInt) and symbols.sym_int(size) is first
    s0 = symbols.by_name["s0"]
    assert symbols.shape_env.var_to_range[s0].lower == 2 and symbols.shape_env.var_to_range[s0].upper == 64
    assert symbols.sym_int({"as_int": 7}) == 7

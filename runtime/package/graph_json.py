"""Check a graph's JSON before torch deserialises it: only data, and only allowed ops.

torch's deserialiser turns strings into Python objects: a node target starting with
`torch` is resolved attribute by attribute (`torch.serialization.os.system` reaches
`os.system`), symbolic expressions go through `sympy.sympify` (an `eval`), and guard
strings are compiled when `ExportedProgram.module()` is called. So every such string is
held to an allow-list or a small grammar here first; anything else is a PackageError
naming the file, the node and the value. The check after loading stays as a second line.
"""

from __future__ import annotations

import re

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.ops.opset import NAMESPACE, OPS, OPSET_VERSION
from b12x_toolchain.runtime.parallel.group import ALLOWED_TARGETS as COLLECTIVE_TARGETS
from b12x_toolchain.runtime.strict_json import load_document

TOP_KEYS = {"graph_module", "opset_version", "range_constraints", "schema_version", "verifiers", "torch_version",
            "guards_code"}
GRAPH_KEYS = {"inputs", "outputs", "nodes", "tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values",
              "is_single_tensor_return", "custom_obj_values"}
NODE_METADATA = {"nn_module_stack", "torch_fn", "stack_trace"}  # strings torch keeps as strings
VERIFIERS = {"TRAINING", "ATEN"}
# Argument kinds that are plain data. Absent on purpose: as_graph (a nested graph module),
# as_operator (an op named by string), as_custom_obj (a TorchScript class by name).
DATA_KINDS = {
    "as_none", "as_tensor", "as_tensors", "as_optional_tensor", "as_optional_tensors", "as_int", "as_ints",
    "as_float", "as_floats", "as_bool", "as_bools", "as_string", "as_strings", "as_complex",
    "as_sym_int", "as_sym_ints", "as_sym_float", "as_sym_floats", "as_sym_bool", "as_sym_bools",
    "as_scalar_type", "as_memory_format", "as_layout", "as_device", "as_name", "as_expr",
}
_IDENT = r"[A-Za-z][A-Za-z0-9_]*"
# aten's own dunder ops are listed: any other dunder name (__class__, __dict__) would walk
# from the op namespace into plain Python objects.
_ATEN_DUNDERS = "|".join(f"__{op}__" for op in ("and", "or", "xor", "lshift", "rshift", "iand", "ior", "ixor",
                                               "ilshift", "irshift"))
ATEN_TARGET = re.compile(rf"torch\.ops\.aten\.(?:_?{_IDENT}|{_ATEN_DUNDERS})\.{_IDENT}")
OPSET_TARGETS = {f"torch.ops.{NAMESPACE}.{name}.default" for name in OPS}
PYTHON_TARGETS = {"_operator.getitem"}
SYMBOL_NAME = re.compile(r"[su]\d+")

# sympy expressions as torch prints them: Symbol('s0', positive=True, integer=True),
# Integer(4), and a few functions of those.
EXPR_TOKEN = re.compile(r"\s*(?:(Symbol\('[su]\d+'(?:, (?:positive|integer|nonnegative)=True)*\))|(Integer\(-?\d+\))"
                         r"|(Mul|Add|Pow|Mod|FloorDiv|CleanDiv|Max|Min|PythonMod|CeilToInt|FloorToInt)\(|(,)|(\)))")
# Guards as torch writes them: comparisons of sizes of named inputs and integers.
_GUARD_TOKEN = re.compile(r"\s*(?:L(?:\['[A-Za-z0-9_.]+'\])+\.size\(\)\[\d+\]|\d+|==|!=|<=|>=|<|>|\*|\+|-|//|%|\(|\)"
                          r"|and\b|or\b|not\b)")


def check_graph_json(file: str, body: bytes) -> dict:
    """The parsed graph document of archive entry model.json, or a PackageError naming what is refused."""
    document = load_document(body, f"{file}: archive/models/model.json")

    def refuse(where: str, reason: str):
        raise PackageError(f"{file}: {where}: {reason}")

    if not isinstance(document, dict) or not set(document) <= TOP_KEYS or "graph_module" not in document:
        refuse("model.json", f"expected an object with keys among {sorted(TOP_KEYS)}")
    for verifier in _list(document.get("verifiers", []), refuse, "verifiers"):
        if verifier not in VERIFIERS:
            refuse("verifiers", f"{verifier!r} is not one of {sorted(VERIFIERS)}")
    for name in _dict(document.get("range_constraints", {}), refuse, "range_constraints"):
        if not SYMBOL_NAME.fullmatch(name):
            refuse("range_constraints", f"{name!r} is not a symbol name like 's0'")
    for guard in _list(document.get("guards_code", []), refuse, "guards_code"):
        if not isinstance(guard, str) or not _tokens_cover(_GUARD_TOKEN, guard):
            refuse("guards_code", f"{str(guard)[:120]!r} is not a size comparison")
    module = _dict(document["graph_module"], refuse, "graph_module")
    for key in ("metadata", "treespec_namedtuple_fields"):
        if module.get(key):
            refuse(f"graph_module.{key}", "expected none; b12x graphs carry no module metadata or named tuples")
    graph = _dict(module.get("graph"), refuse, "graph_module.graph")
    if not set(graph) <= GRAPH_KEYS:
        refuse("graph_module.graph", f"unexpected keys {sorted(set(graph) - GRAPH_KEYS)}")
    if graph.get("custom_obj_values"):
        refuse("graph_module.graph.custom_obj_values", "custom objects are not allowed")
    for node in _list(graph.get("nodes"), refuse, "graph_module.graph.nodes"):
        _check_node(node, refuse)
    _check_exprs(document, refuse, "model.json")
    return document


def _check_node(node, refuse) -> None:
    if not isinstance(node, dict):
        refuse("node", "is not an object")
    label = f"node {str(node.get('name'))[:80]!r}"
    target = node.get("target")
    if not isinstance(target, str) or not (ATEN_TARGET.fullmatch(target) or target in OPSET_TARGETS
                                           or target in PYTHON_TARGETS or target in COLLECTIVE_TARGETS):
        refuse(label, f"target {str(target)[:120]!r} is outside op set v{OPSET_VERSION}, aten, operator.getitem "
                      "and the fixed-shape collectives")
    for key, value in _dict(node.get("metadata", {}), refuse, label).items():
        if key not in NODE_METADATA or not isinstance(value, str):
            refuse(label, f"metadata {key!r} is not one of the string fields {sorted(NODE_METADATA)}")
    _check_kinds(node.get("inputs"), refuse, label)
    _check_kinds(node.get("outputs"), refuse, label)


def _check_kinds(value, refuse, label: str) -> None:
    """Every `as_*` key in a node's arguments must be a plain-data kind."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key.startswith("as_") and key not in DATA_KINDS:
                refuse(label, f"argument kind {key!r} is not plain data")
            _check_kinds(item, refuse, label)
    elif isinstance(value, list):
        for item in value:
            _check_kinds(item, refuse, label)


def _check_exprs(value, refuse, where: str) -> None:
    """Every `expr_str` anywhere in the document must be a sympy expression of the small grammar."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            expr = item.get("expr_str")
            if "expr_str" in item and not (isinstance(expr, str) and _is_expr(expr)):
                refuse(where, f"symbolic expression {str(expr)[:120]!r} is outside the allowed grammar")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _is_expr(text: str) -> bool:
    """Symbols and integers nested in allowed functions, with balanced parentheses."""
    depth, pos, expect_value = 0, 0, True
    while pos < len(text):
        match = EXPR_TOKEN.match(text, pos)
        if not match:
            return False
        symbol, integer, function, comma, close = match.groups()
        if symbol or integer or function:
            if not expect_value:
                return False
            depth += bool(function)
            expect_value = bool(function)
        elif comma:
            if expect_value or depth == 0:
                return False
            expect_value = True
        elif close:
            if expect_value or depth == 0:
                return False
            depth -= 1
        pos = match.end()
    return depth == 0 and not expect_value


def _tokens_cover(pattern: re.Pattern, text: str) -> bool:
    pos = 0
    while pos < len(text):
        match = pattern.match(text, pos)
        if not match or match.end() == pos:
            return text[pos:].strip() == ""
        pos = match.end()
    return True


def _dict(value, refuse, where: str) -> dict:
    if not isinstance(value, dict):
        refuse(where, "expected an object")
    return value


def _list(value, refuse, where: str) -> list:
    if not isinstance(value, list):
        refuse(where, "expected a list")
    return value

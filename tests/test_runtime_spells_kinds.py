"""The runtime spells kinds, never the names the exporter gives buffers.

A server binds a package's inputs, outputs and buffers by what the manifest says they are
(runtime/package/kinds.py); names are the exporter's labels, which a re-export may change.
So no runtime source holds an exporter buffer name as a string. The names are built the
way the exporter builds them (exporter/model/buffer_names.py, the calling conventions of
every pass of every bundled recipe), and every string constant (f-string pieces included)
and keyword argument under runtime/ is checked against them and the table's name prefixes.

Where a kind and a name coincide, the string is the kind, which the runtime may spell:
`positions` and the block tables are named by their kinds, and so is every output (the
manifest records no kind for outputs; kinds.OUTPUT_KINDS). Those are not searched for.
"""

from __future__ import annotations

import ast

from b12x_toolchain.exporter.model import buffer_names
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import bundled_recipes, load_recipe
from b12x_toolchain.runtime.package.kinds import KINDS, OUTPUT_KINDS
from paths import ROOT

# Strings that equal an exporter name by coincidence, by file, and what they are instead.
NOT_BUFFER_NAMES = {
    ("runtime/prefix/snapshot_file.py", "tokens"): "the snapshot file's own entry for a prefix's token ids",
    ("runtime/serving/http/choices.py", "tokens"): "the OpenAI API's logprobs field of token strings",
    ("runtime/serving/http/tokenize.py", "tokens"): "vLLM's /tokenize and /detokenize field of token ids",
    ("runtime/serving/http/schemas.py", "tokens"): "vLLM's /detokenize field, in its request schema",
}


def exporter_names() -> tuple[set[str], tuple[str, ...]]:
    """Every cache, staging, input and output name of the bundled recipes' passes that is
    not also a kind, and the prefixes every cache and staging name starts with."""
    names, passes = set(), set()
    for recipe_name in bundled_recipes():
        recipe = load_recipe(recipe_name)
        d = Dims.from_recipe(recipe)
        for pass_name, _ in recipe.passes:
            inputs, outputs = PASSES[pass_name](d).convention()
            names |= {spec.name for spec in inputs + outputs if spec.role != "weight"}
            passes.add(pass_name)
    prefixes = (buffer_names.cache(""), *(buffer_names.staging(p, "") for p in sorted(passes)))
    return names - set(KINDS) - set(OUTPUT_KINDS), prefixes


def spelled(path):
    """(line, text) of every string constant and keyword argument name (`replay(tokens=...)`
    spells a name as surely as `values["tokens"]`)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.lineno, node.arg


def test_no_runtime_code_spells_an_exporter_buffer_name():
    names, prefixes = exporter_names()
    assert {"tokens", "row_ids", "lengths", "accept_len"} <= names  # the scan searches for something
    found = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for line, text in spelled(path):
            if (text in names or text.startswith(prefixes)) and (where, text) not in NOT_BUFFER_NAMES:
                found.append(f"{where}:{line}: {text!r}")
    assert not found, "runtime code spells exporter buffer names (use their kinds):\n" + "\n".join(found)


def test_every_kind_has_a_name():
    """A kind added to kinds.py gets its name from the one table, or nothing can declare it."""
    buffers = {kind for kind, k in KINDS.items() if k.role in ("cache", "staging")}
    assert set(buffer_names.PARTS) == buffers - {"seq_len", "token_history", "token_history_staging"}  # no owner
    assert set(buffer_names.ROW_INPUTS) == {kind for kind, k in KINDS.items() if k.role == "input"}
    assert all(buffer_names.output(kind) == kind for kind in OUTPUT_KINDS)

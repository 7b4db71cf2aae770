"""Recipe schema and loader: bundled recipes, hashing, and located errors."""

from __future__ import annotations

import copy
import hashlib
import json
from importlib.resources import files

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from b12x_toolchain.exporter.recipe.loader import (
    KNOWN_REWRITES,
    PASS_NAMES,
    Recipe,
    RecipeError,
    bundled_recipes,
    load_recipe,
    parse_recipe,
)
from b12x_toolchain.passes.pipeline import REWRITES
from paths import RECIPES
from recipe_text import TINY_TEXT, edit, line_of, parse_error

RECIPES_DIR = RECIPES


# --- bundled recipes ----------------------------------------------------------------

def test_bundled_names():
    assert bundled_recipes() == ["dsv4-tiny", "dsv41", "dsv41-mini", "dsv41-tiny"]


@pytest.mark.parametrize("name", ["dsv4-tiny", "dsv41", "dsv41-mini", "dsv41-tiny"])
def test_bundled_recipe_loads_by_name_and_by_path(name):
    by_name = load_recipe(name)
    path = RECIPES_DIR / f"{name}.yaml"
    by_path = load_recipe(path)
    by_str = load_recipe(str(path))
    assert isinstance(by_name, Recipe)
    assert by_name.name == name
    assert by_name.normalized() == by_path.normalized() == by_str.normalized()
    # The packaged resource is the same file as the one in the source tree.
    assert (files("b12x_toolchain.recipes") / f"{name}.yaml").read_text() == path.read_text()


def test_tiny_recipe_values():
    r = load_recipe("dsv41-tiny")
    m = r.model
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads) == (512, 128, 6, 2)
    assert (m.head_dim, m.rope_head_dim, m.q_lora_rank, m.moe.intermediate_size) == (64, 16, 64, 128)
    assert (m.csa2.kv_source_layer_ids, m.csa2.index_source_layer_ids) == ((2, 4), (2, 4, 5))
    assert (m.draft.markov_rank, m.draft.moe.experts_per_token, r.cache.index_format) == (16, 3, "dsv41_mxfp4")
    assert m.compress_ratios == (0, 0, 2, 2, 1, 1, 0, 0)
    assert m.target_ratios == (0, 0, 2, 2, 1, 1)
    assert {0, 1, 2} <= set(m.target_ratios)  # every layer kind present
    assert (m.window, m.max_seq_len, m.rms_norm_eps) == (128, 1024, 1e-6)
    assert (m.draft.stages, m.draft.target_layer_ids, m.draft.noise_token_id) == (2, (3, 4, 5), 1)
    assert r.cache.history == 128 and r.cache.staging.page_size == 16
    assert r.passes.verify.width == 8 and r.passes.draft.width == 7
    assert r.passes.prefill.chunk == 64 and r.passes.prefill.rows_buckets == (1, 2, 4, 8)
    assert PASS_NAMES == ("prefill", "verify", "draft", "commit")
    assert r.pass_names == PASS_NAMES + ("decode",) and r.passes.decode.rows_buckets == (1, 2, 4, 8)
    assert [w.name for w in r.rewrites] == ["fuse_window_snapshot"]
    assert r.rewrites[0].expect_matches == {"prefill": 0, "verify": 6, "draft": 2, "commit": 0, "decode": 0}


def test_full_recipe_values():
    r = load_recipe("dsv41")
    m = r.model
    assert m.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    assert len(m.target_ratios) == m.num_layers == 40
    assert (m.vocab_size, m.hidden_size, m.num_heads, m.head_dim, m.rope_head_dim) == (129280, 5120, 64, 512, 64)
    assert (m.max_seq_len, m.rms_norm_eps, m.rope_theta, m.compress_rope_theta) == (1048576, 1e-20, 10000.0, 160000.0)
    assert isinstance(m.rope_theta, float)
    assert m.draft.stages == 3 and m.draft.target_layer_ids == (37, 38, 39)
    assert (r.cache.window_format, r.cache.compressed_format, r.cache.state_format) == ("dsv41_mxfp8", "dsv41_nvfp4", "fp32")
    assert r.cache.staging.layout == "NHD" and r.cache.staging.page_size == 64
    for name in ("verify", "draft", "commit"):
        assert getattr(r.passes, name).rows_buckets == (1, 2, 4, 8, 16, 32)
    assert r.rewrites[0].expect_matches == {"prefill": 0, "verify": 40, "draft": 3, "commit": 0}


# --- normalized form and hash -------------------------------------------------------

def _keys_sorted(value) -> bool:
    if isinstance(value, dict):
        return list(value) == sorted(value) and all(_keys_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(_keys_sorted(v) for v in value)
    return True


def test_normalized_and_sha256_are_stable():
    a, b = load_recipe("dsv41-tiny"), parse_recipe(TINY_TEXT)
    norm = a.normalized()
    assert norm == b.normalized()
    assert _keys_sorted(norm)
    assert json.loads(json.dumps(norm)) == norm  # plain JSON data
    assert norm["model"]["compress_ratios"] == [0, 0, 2, 2, 1, 1, 0, 0]
    text = json.dumps(norm, sort_keys=True, separators=(",", ":"))
    assert a.sha256() == b.sha256() == hashlib.sha256(text.encode()).hexdigest()
    # Comments and formatting are not part of the recipe's identity.
    reformatted = parse_recipe(yaml.safe_dump(yaml.safe_load(TINY_TEXT), default_flow_style=True))
    assert reformatted.sha256() == a.sha256()


def test_sha256_changes_with_any_value():
    base = load_recipe("dsv41-tiny").sha256()
    assert parse_recipe(edit("init_seed: 0", "init_seed: 1")).sha256() != base
    assert parse_recipe(edit("page_size: 16", "page_size: 32")).sha256() != base
    assert load_recipe("dsv41").sha256() != base


def test_defaults_are_filled_in_normalized():
    start = TINY_TEXT.index("rewrites:")
    recipe = parse_recipe(TINY_TEXT[:start])
    assert recipe.rewrites == ()
    assert recipe.normalized()["rewrites"] == []


def test_yaml12_exponent_floats_and_int_thetas():
    recipe = parse_recipe(edit("rms_norm_eps: 1.0e-6", "rms_norm_eps: 1e-6"))
    assert recipe.model.rms_norm_eps == 1e-6


# --- located errors -----------------------------------------------------------------

RATIOS = "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 0]"

ERROR_CASES = [
    # (id, old, new, line needle, key path, message fragment)
    ("unknown key", "  init_seed: 0", "  init_seed: 0\n  colour: red", "colour: red",
     "model.colour", "unknown key 'colour'"),
    ("wrong type", "hidden_size: 128", "hidden_size: wide", "hidden_size: wide",
     "model.hidden_size", "Input should be a valid integer"),
    ("bool for int", "num_heads: 2", "num_heads: true", "num_heads: true",
     "model.num_heads", "valid integer"),
    ("zero size", "verify: {width: 8", "verify: {width: 0", "verify: {width: 0",
     "passes.verify.width", "Input should be greater than 0"),
    ("negative size", "vocab_size: 512", "vocab_size: -4", "vocab_size: -4",
     "model.vocab_size", "Input should be greater than 0"),
    ("missing field", "  num_heads: 2\n", "", "model:",
     "model.num_heads", "Field required"),
    ("missing in flow map", "commit: {rows_buckets: [1, 2, 4, 8]}", "commit: {}", "commit: {}",
     "passes.commit.rows_buckets", "Field required"),
    ("ratios length", RATIOS, "compress_ratios: [0, 0, 2, 2, 1, 1, 0]", "compress_ratios:",
     "model.compress_ratios", "has 7 entries; expected num_layers + draft.stages = 8"),
    ("draft ratio", RATIOS, "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 1]", "compress_ratios:",
     "model.compress_ratios[7]", "draft stage entry is 1"),
    ("ratio value", RATIOS, "compress_ratios: [0, 0, 2, 4, 1, 1, 0, 0]", "compress_ratios:",
     "model.compress_ratios[3]", "Input should be 0, 1 or 2"),
    ("draft width", "draft: {width: 7", "draft: {width: 6", "draft: {width: 6",
     "passes.draft.width", "6 does not match verify.width - 1 = 7"),
    ("history", "history: 128", "history: 126", "history: 126",
     "cache.history", "126 is shorter than model.window - 1 = 127"),
    ("chunk", "chunk: 64", "chunk: 256", "chunk: 256",
     "passes.prefill.chunk", "larger than cache.history = 128"),
    ("unknown rewrite", "- name: fuse_window_snapshot", "- name: fuse_all", "name: fuse_all",
     "rewrites[0].name", "unknown rewrite 'fuse_all'; known rewrites: fuse_window_snapshot"),
    ("expect key", "commit: 0,", "comit: 0,", "comit: 0,",
     "rewrites[0].expect_matches.comit", "'prefill', 'decode', 'verify', 'draft' or 'commit'"),
    ("expect missing", ", commit: 0, decode: 0}", ", decode: 0}", "expect_matches:",
     "rewrites[0].expect_matches", "missing commit"),
    ("expect missing optional", ", decode: 0}", "}", "expect_matches:",
     "rewrites[0].expect_matches", "decode is missing; expected exactly the keys prefill, verify, draft, commit, decode"),
    ("expect absent pass", "  decode: {rows_buckets: [1, 2, 4, 8]}\n", "", "expect_matches:",
     "rewrites[0].expect_matches", "decode is not a pass of this recipe; expected exactly the keys prefill, verify, "
     "draft, commit"),
    ("target layer range", "[3, 4, 5]", "[3, 4, 6]", "target_layer_ids:",
     "model.draft.target_layer_ids[2]", "layer 6 is out of range"),
    ("head_dim", "head_dim: 64", "head_dim: 48", "head_dim: 48",
     "model.head_dim", "48 is not a multiple of 32"),
    ("max_seq_len", "max_seq_len: 1024", "max_seq_len: 1023", "max_seq_len: 1023",
     "model.max_seq_len", "not a multiple of compress ratio 2"),
    ("buckets order", "draft: {width: 7, rows_buckets: [1, 2, 4, 8]}",
     "draft: {width: 7, rows_buckets: [1, 4, 4]}", "draft: {width: 7",
     "passes.draft.rows_buckets[2]", "strictly increasing"),
    ("page size", "page_size: 16", "page_size: 24", "page_size: 24",
     "cache.staging.page_size", "24 is not a power of two"),
    ("name pattern", "name: dsv41-tiny", "name: Tiny", "name: Tiny", "name", "should match pattern"),
    ("version", "recipe_version: 1", "recipe_version: 2", "recipe_version: 2", "recipe_version", "Input should be 1"),
    ("duplicate key", "  window: 128", "  window: 64\n  window: 128", "window: 128",
     "model.window", "duplicate key 'window' (first at line"),
    ("python tag", "init_seed: 0", "init_seed: !!python/object/apply:os.getpid []", "init_seed:",
     "model.init_seed", "unsupported YAML tag"),
]


@pytest.mark.parametrize("old,new,needle,key_path,fragment", [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_error_names_file_line_and_key_path(old, new, needle, key_path, fragment):
    text = edit(old, new)
    err = parse_error(text)
    line = line_of(text, needle)
    assert (err.file, err.line, err.key_path) == ("t.yaml", line, key_path)
    assert str(err).startswith(f"t.yaml:{line}: {key_path}: "), str(err)
    assert fragment in err.message
    assert str(err) == f"t.yaml:{line}: {key_path}: {err.message}"


def test_duplicate_key_names_both_lines():
    text = edit("  window: 128", "  window: 64\n  window: 128")
    err = parse_error(text)
    first, second = line_of(text, "window: 64"), line_of(text, "window: 128")
    assert f"first at line {first}, again at line {second}" in err.message


def test_alias_is_refused_with_its_line():
    text = edit("stages: 2", "stages: &n 2")
    err = parse_error(text)
    assert err.line == line_of(text, "&n")
    assert str(err) == f"t.yaml:{err.line}: YAML anchors and aliases are not allowed in recipes"
    text = edit("noise_token_id: 1", "noise_token_id: *n")
    assert parse_error(text).line == line_of(text, "*n")  # undefined alias: still refused first


def test_syntax_error_has_yaml_line():
    text = edit("verify: {width: 8,", "verify: {width: 8,,")
    err = parse_error(text)
    assert err.line == line_of(text, "verify: {width: 8,,")
    assert err.message.startswith("YAML syntax error:")


def test_document_shape_errors():
    err = parse_error(TINY_TEXT + "---\nname: x\n")
    assert err.line == len(TINY_TEXT.splitlines()) + 1 and "second YAML document" in err.message
    assert str(parse_error("- a\n- b\n")) == "t.yaml:1: top level is a list; expected a mapping"
    assert "empty" in parse_error("# nothing\n").message


def test_oversized_document_is_refused(tmp_path):
    text = TINY_TEXT + "#" * (1 << 20)
    size = len(text.encode())
    err = parse_error(text)
    assert err.line is None
    assert str(err) == f"t.yaml: document is {size} bytes; the limit is 1048576 bytes (1 MiB)"
    path = tmp_path / "big.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=f"document is {size} bytes"):
        load_recipe(path)


def test_file_errors_use_the_path_as_given(tmp_path):
    path = tmp_path / "bad.yaml"
    text = edit("verify: {width: 8", "verify: {width: 0")
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    line = line_of(text, "verify: {width: 0")
    assert str(info.value) == f"{path}:{line}: passes.verify.width: Input should be greater than 0"

    missing = tmp_path / "missing.yaml"
    with pytest.raises(RecipeError, match="does not exist") as info:
        load_recipe(missing)
    assert info.value.file == str(missing)

    bad_utf8 = tmp_path / "latin1.yaml"
    bad_utf8.write_bytes(b"recipe_version: 1\nname: caf\xe9\n")
    with pytest.raises(RecipeError, match="not valid UTF-8") as info:
        load_recipe(bad_utf8)
    assert info.value.line == 2


def test_bundled_errors_use_the_base_name():
    with pytest.raises(RecipeError) as info:
        load_recipe("dsv99")
    assert info.value.file == "dsv99"
    assert "dsv4-tiny, dsv41, dsv41-mini, dsv41-tiny" in str(info.value)
    # A missing ".yaml" file is a path, not a bundled name.
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe("dsv99.yaml")


def test_recipe_is_frozen():
    recipe = load_recipe("dsv41-tiny")
    with pytest.raises(Exception):
        recipe.model.window = 4  # type: ignore[misc]


def test_known_rewrites_are_the_registry():
    # One catalog: a recipe may name exactly the rewrites passes/ registers, in its order.
    assert KNOWN_REWRITES == tuple(REWRITES)
    assert "fuse_window_snapshot" in KNOWN_REWRITES  # the bundled recipes' one rewrite


# --- fuzzing ------------------------------------------------------------------------

def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


TINY_DICT = yaml.safe_load(TINY_TEXT)
ALL_PATHS = [p for p in _paths(TINY_DICT) if p]
LEAVES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.floats(),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=5),
    st.dictionaries(st.sampled_from(["prefill", "verify", "x", "width"]), st.integers(-2, 9), max_size=3),
)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_mutated_recipes_fail_only_with_recipe_error(data):
    doc = copy.deepcopy(TINY_DICT)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(ALL_PATHS), label="path")
        parent = doc
        try:
            for part in path[:-1]:
                parent = parent[part]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this spot
        if isinstance(parent, dict) and data.draw(st.booleans(), label="drop"):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(LEAVES, label="leaf")
    text = yaml.safe_dump(doc, sort_keys=False)
    try:
        result = parse_recipe(text, "fuzz.yaml")
    except RecipeError as err:
        assert str(err).startswith("fuzz.yaml")
        assert err.line is None or 1 <= err.line <= len(text.splitlines()) + 1
    else:
        assert isinstance(result, Recipe)
        assert len(result.sha256()) == 64


@pytest.mark.parametrize("pages, message", [
    ("{compressed_entries: 63, index_keys: 32}",
     "cache.pages.compressed_entries: 63 tokens per page is not a multiple of compress ratio 2; a page must hold "
     "whole entries"),
    ("{compressed_entries: 64, index_keys: 2048}",
     "cache.pages.index_keys: 2048 tokens per page is more than model.max_seq_len = 1024"),
    ("{compressed_entries: 64, index_keys: 0}", "cache.pages.index_keys: Input should be greater than 0"),
])
def test_page_sizes_are_refused_at_their_line(pages, message):
    needle = "pages: {compressed_entries: 64, index_keys: 32}"
    error = parse_error(edit(needle, f"pages: {pages}"))
    assert str(error) == f"t.yaml:{line_of(TINY_TEXT, needle)}: {message}"

"""Malformed recipes: each gives one clear error naming file, line and key; nothing is written."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from paths import RECIPES

TINY = (RECIPES / "dsv41-tiny.yaml").read_text()

# (id, text to replace, replacement, expected key path, message fragment). The expected
# line is the line where the replacement lands (or the parent mapping for a missing key).
CASES = [
    ("syntax: unclosed flow list", "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 0]", "compress_ratios: [0, 0, 2", "", "flow"),
    ("syntax: bad indentation", "  hidden_size: 128", "   hidden_size: 128\n  oops", "", ""),
    ("syntax: tab indentation", "  num_heads: 2", "\tnum_heads: 2", "", ""),
    ("unknown top-level key", "recipe_version: 1", "recipe_version: 1\ncolour: blue", "colour", "unknown key"),
    ("unknown model key", "  hidden_size: 128", "  hidden_size: 128\n  hiden_size: 128", "model.hiden_size", "unknown key"),
    ("unknown staging key", "    page_size: 16", "    page_size: 16\n    pages: 4", "cache.staging.pages", "unknown key"),
    ("unknown pass", "  commit: {rows_buckets: [1, 2, 4, 8]}", "  commit: {rows_buckets: [1, 2, 4, 8]}\n  sample: {width: 1}", "passes.sample", "unknown key"),
    ("unknown rewrite", "  - name: fuse_window_snapshot", "  - name: fuse_everything", "rewrites[0].name", "unknown rewrite"),
    ("string for int", "  vocab_size: 512", "  vocab_size: lots", "model.vocab_size", "integer"),
    ("float for int", "  num_layers: 6", "  num_layers: 6.5", "model.num_layers", "integer"),
    ("bool for int", "  num_heads: 2", "  num_heads: true", "model.num_heads", ""),
    ("list for int", "  head_dim: 64", "  head_dim: [64]", "model.head_dim", "integer"),
    ("string for float", "  rope_theta: 10000.0", "  rope_theta: big", "model.rope_theta", "number"),
    ("null for required", "  window: 128", "  window: null", "model.window", ""),
    ("wrong format", "  window_format: dsv41_mxfp8", "  window_format: fp8", "cache.window_format", "dsv41_mxfp8"),
    ("renamed format", "  window_format: dsv41_mxfp8", "  window_format: mxfp8", "cache.window_format",
     "renamed: use dsv41_mxfp8"),
    ("wrong layout", "    layout: NHD", "    layout: NDH", "cache.staging.layout", "NHD"),
    ("wrong family", "  family: deepseek_v41", "  family: llama", "model.family", "deepseek_v41"),
    ("wrong version", "recipe_version: 1", "recipe_version: 2", "recipe_version", "1"),
    ("bad name", "name: dsv41-tiny", "name: Tiny Model!", "name", "pattern"),
    ("missing model field", "  vocab_size: 512\n", "", "model.vocab_size", "Field required"),
    ("missing cache section", "cache:\n", "cache_:\n", "cache", "Field required"),
    ("missing pass", "  draft: {width: 7, rows_buckets: [1, 2, 4, 8]}\n", "", "passes.draft", "Field required"),
    ("missing expect count", "{prefill: 0, verify: 6, draft: 2, commit: 0, decode: 0}", "{prefill: 0, verify: 6, draft: 2, decode: 0}", "rewrites[0].expect_matches", "missing commit"),
    ("zero vocab", "  vocab_size: 512", "  vocab_size: 0", "model.vocab_size", "greater than 0"),
    ("negative hidden", "  hidden_size: 128", "  hidden_size: -128", "model.hidden_size", "greater than 0"),
    ("zero heads", "  num_heads: 2", "  num_heads: 0", "model.num_heads", "greater than 0"),
    ("zero window", "  window: 128", "  window: 0", "model.window", "greater than 0"),
    ("negative eps", "  rms_norm_eps: 1.0e-6", "  rms_norm_eps: -1.0e-6", "model.rms_norm_eps", "greater than 0"),
    ("zero width", "  verify: {width: 8", "  verify: {width: 0", "passes.verify.width", "greater than 0"),
    ("zero page size", "    page_size: 16", "    page_size: 0", "cache.staging.page_size", "greater than 0"),
    ("negative seed", "  init_seed: 0", "  init_seed: -1", "model.init_seed", "greater than or equal to 0"),
    ("ratio outside set", "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 0]", "compress_ratios: [0, 0, 4, 2, 1, 1, 0, 0]", "model.compress_ratios[2]", ""),
    ("too few ratios", "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 0]", "compress_ratios: [0, 0, 2, 2, 1, 1, 0]", "model.compress_ratios", "expected"),
    ("too many layers", "  num_layers: 6", "  num_layers: 7", "model.compress_ratios", "expected"),
    ("compressed draft stage", "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 0]", "compress_ratios: [0, 0, 2, 2, 1, 1, 0, 2]", "model.compress_ratios[7]", "draft"),
    ("draft target out of range", "target_layer_ids: [3, 4, 5]", "target_layer_ids: [3, 4, 6]", "model.draft.target_layer_ids[2]", ""),
    ("reuse across ratios", "kv_source_layer_ids: [2, 4]", "kv_source_layer_ids: [2]", "model.csa2.kv_source_layer_ids", "reuses entries of its own ratio"),
    ("window-only kv source", "kv_source_layer_ids: [2, 4]", "kv_source_layer_ids: [1, 2, 4]", "model.csa2.kv_source_layer_ids[0]", "window-only"),
    ("kv source not indexing", "index_source_layer_ids: [2, 4, 5]", "index_source_layer_ids: [2, 5]", "model.csa2.index_source_layer_ids", "kv source 4 is missing"),
    ("candidate not an indexer", "candidate_source_layer_id: 4", "candidate_source_layer_id: 3", "model.csa2.candidate_source_layer_id", "not an index source"),
    ("hash-routed draft", "    moe: {experts: 4, experts_per_token: 3,", "    moe: {hash_layers: 1, experts: 4, experts_per_token: 3,", "model.draft.moe.hash_layers", "hash routing"),
    ("too many experts per token", "experts_per_token: 3,", "experts_per_token: 5,", "model.draft.moe.experts_per_token", "more than experts"),
    ("draft width mismatch", "  draft: {width: 7", "  draft: {width: 6", "passes.draft.width", "verify.width - 1"),
    ("history shorter than window", "  history: 128", "  history: 100", "cache.history", "window - 1"),
    ("unsupported history", "  history: 128", "  history: 127", "cache.history", "127 is not supported"),
    ("unsupported layout", "    layout: NHD", "    layout: HND", "cache.staging.layout", "not supported"),
    ("unsupported page size", "    page_size: 16", "    page_size: 8", "cache.staging.page_size", "not supported"),
    ("page size not power of two", "    page_size: 16", "    page_size: 24", "cache.staging.page_size", "power of two"),
    ("buckets not increasing", "  verify: {width: 8, rows_buckets: [1, 2, 4, 8]}", "  verify: {width: 8, rows_buckets: [1, 4, 2, 8]}", "passes.verify.rows_buckets[2]", "increasing"),
    ("empty buckets", "  commit: {rows_buckets: [1, 2, 4, 8]}", "  commit: {rows_buckets: []}", "passes.commit.rows_buckets", ""),
    ("chunk beyond history", "  prefill: {chunk: 64", "  prefill: {chunk: 256", "passes.prefill.chunk", "history"),
    ("impossible verify matches", "verify: 6, draft: 2,", "verify: 9, draft: 2,", "rewrites[0].expect_matches.verify", "impossible"),
    ("impossible prefill matches", "{prefill: 0, verify: 6", "{prefill: 3, verify: 6", "rewrites[0].expect_matches.prefill", "impossible"),
    ("head_dim not a block multiple", "  head_dim: 64", "  head_dim: 48", "model.head_dim", "multiple of 32"),
    ("odd rope dims", "  rope_head_dim: 16", "  rope_head_dim: 15", "model.rope_head_dim", ""),
    ("max_seq_len not a ratio multiple", "  max_seq_len: 1024", "  max_seq_len: 1023", "model.max_seq_len", "multiple"),
    ("anchor", "  hidden_size: 128", "  hidden_size: &h 128\n  intermediate_size_: *h", "", "anchors and aliases"),
    ("duplicate key", "  num_heads: 2", "  num_heads: 2\n  num_heads: 4", "model.num_heads", "duplicate key 'num_heads' (first at line 10, again at line 11)"),
    ("python tag", "  vocab_size: 512", "  vocab_size: !!python/object/apply:os.system ['true']", "model.vocab_size", ""),
]


# Where the error must point when it is not the last line of the replacement.
LINE_OF = {
    "missing model field": "model:",
    "missing cache section": None,  # the unknown key and the missing one are both fine
    "missing pass": "passes:",
    "too many layers": "compress_ratios:",
    "too few ratios": "compress_ratios:",
    "syntax: unclosed flow list": None,
    "syntax: bad indentation": None,
    "syntax: tab indentation": None,
    "anchor": "hidden_size: &h",
    "duplicate key": None,
}


def _expected_line(case_id: str, text: str, new: str):
    needle = LINE_OF.get(case_id, new.strip().splitlines()[-1].strip() if new.strip() else None)
    if needle is None:
        return None
    hits = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (case_id, needle, hits)
    return hits[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_recipe_gives_one_located_error(case, tmp_path):
    case_id, old, new, key, fragment = case
    assert TINY.count(old) == 1, old
    text = TINY.replace(old, new)
    recipe = tmp_path / "broken.yaml"
    recipe.write_text(text)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--out", str(out)])
    assert result.exit_code == 1, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1, result.output  # one error, not a traceback
    match = re.match(rf"error: {re.escape(str(recipe))}:(\d+): (.*)$", lines[0])
    assert match, lines[0]
    line, rest = int(match.group(1)), match.group(2)
    if key:
        assert rest.startswith(f"{key}: "), rest
    assert fragment in rest, rest
    expected = _expected_line(case_id, text, new)
    if expected is not None:
        assert line == expected, (line, expected, rest)
    assert 1 <= line <= len(text.splitlines()) + 1
    assert not out.exists()  # nothing left behind


def test_matrix_is_large_enough():
    assert len(CASES) >= 40


def test_huge_recipe_is_refused_without_reading_it_all(tmp_path):
    recipe = tmp_path / "huge.yaml"
    recipe.write_text(TINY + "# " + "x" * (2 << 20) + "\n")
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "limit" in result.output and not (tmp_path / "out").exists()


def test_alias_bomb_is_refused(tmp_path):
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: &d [*c, *c]\n"
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(bomb)
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "bomb.yaml:1:" in result.output and "anchors and aliases" in result.output

"""Format 2: what every buffer is and what every pass does, recorded as manifest data.

The exported tiny package must describe each cache and staging buffer as exporter/model/
buffers.py defines it; a reader refuses format-1 and op-set-1 packages with the re-export
advice, and any buffer or pass entry whose new fields are missing, mistyped or unknown,
naming the buffer and the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.model.buffers import STAGING_KIND, owned_caches
from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime import PackageError, load
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from runtime.package.manifests import contract_manifest, edited, read_back, refingerprint

pytestmark = pytest.mark.slow(minutes=0.6)

NULLS = dict(layer=None, stage=None, format=None, dims=None, ratio=None, rows_per_slot=None, page=None)


def _expected_buffers(d: Dims) -> dict[str, dict]:
    """Every cache and staging buffer of the tiny recipe, written out from the recipe's numbers."""
    page = {"layout": d.layout, "page_size": d.page_size}
    out = {"cache.seq_len": {**NULLS, "kind": "seq_len"}}
    tokens = {"compressed_entries": d.entry_page_tokens, "index_keys": d.index_page_tokens}
    pools = {"compressed_entries": "entry_pages", "index_keys": "index_key_pages"}
    for i in range(d.layers):
        for c in owned_caches(d, i):
            rows = {"format": c.fmt, "dims": c.dims, "ratio": c.ratio}
            if c.kind in pools:  # paged: the page spec an engine allocates by
                per_page, record = tokens[c.kind] // c.ratio, get_format(c.fmt).row_bytes(c.dims)
                spec = {"pool": pools[c.kind], "tokens_per_entry": c.ratio, "tokens_per_page": tokens[c.kind],
                        "entries_per_page": per_page, "record_bytes": record, "page_bytes": per_page * record,
                        "alignment": record, "pages_per_slot": d.max_seq_len // tokens[c.kind], "layout": "entry_major"}
                out[f"cache.{c.name}"] = {**NULLS, **rows, "kind": c.kind, "layer": i, "page": spec}
            else:
                out[f"cache.{c.name}"] = {**NULLS, **rows, "kind": c.kind, "layer": i, "rows_per_slot": c.rows}
            staged = {**NULLS, **rows, "kind": STAGING_KIND[c.kind], "layer": i}
            out[f"staging.verify.{c.name}"] = {**staged, "page": page} if c.kind == "window_ring" else staged
    # Engram's token history: the last max_ngram compressed ids of a slot, one float32 each; no owner.
    history = {**NULLS, "format": "fp32", "dims": 1, "ratio": 1}
    out["cache.engram.history"] = {**history, "kind": "token_history", "rows_per_slot": d.engram.max_ngram}
    out["staging.verify.engram.history"] = {**history, "kind": "token_history_staging"}
    window = {"format": d.window_format, "dims": d.head_dim, "ratio": 1}
    for s in range(d.draft_stages):
        out[f"cache.draft{s}.window"] = {**NULLS, **window, "kind": "draft_window", "stage": s, "rows_per_slot": d.history}
        out[f"staging.verify.draft{s}.context"] = {**NULLS, **window, "kind": "draft_context_staging", "stage": s}
        out[f"staging.draft.draft{s}.window"] = {**NULLS, **window, "kind": "draft_window_staging", "stage": s,
                                                 "page": page}
    return out


def test_tiny_package_records_what_every_buffer_is(fused_pkg, tiny_recipe):
    d, m = Dims.from_recipe(tiny_recipe), fused_pkg.manifest.to_json()  # the document as written
    assert m["format_version"] == "4.3" and m["opset_version"] == 7  # 4.3: the tiny recipe has Engram
    assert m["buffers"] == _expected_buffers(d)
    specs = {s["name"]: s for e in m["passes"].values() for s in e["inputs"] if s["role"] in ("cache", "staging")}
    assert set(specs) == set(m["buffers"])
    for name, info in m["buffers"].items():
        if info["kind"] in ("compressed_entries", "index_keys"):  # [pool, page_bytes], records of format and dims
            assert info["ratio"] == d.ratios[info["layer"]] > 0
            assert specs[name]["shape"] == [info["page"]["pool"], info["page"]["page_bytes"]]
            assert info["page"]["record_bytes"] == get_format(info["format"]).row_bytes(info["dims"])
        elif info["format"] is not None:  # the recorded rows decode: format and dims give the row bytes
            assert specs[name]["shape"][-1] == get_format(info["format"]).row_bytes(info["dims"]), name
    assert {n: m["buffers"][n]["kind"] for n in ("cache.layer2.state", "cache.layer4.compressed", "cache.layer4.index",
                                                 "staging.verify.layer2.state")} == {
        "cache.layer2.state": "compressor_state", "cache.layer4.compressed": "compressed_entries",
        "cache.layer4.index": "index_keys", "staging.verify.layer2.state": "state_staging"}


def test_tiny_package_records_what_every_pass_does(fused_pkg, tiny_recipe):
    d, passes = Dims.from_recipe(tiny_recipe), fused_pkg.manifest.to_json()["passes"]
    assert {n: (e["width"], e["advances"], e["reads_staging_of"]) for n, e in passes.items()} == {
        "prefill": (d.prefill_chunk, "lengths", None), "verify": (8, None, None), "draft": (7, None, None),
        "commit": (8, "accept_len", "verify"), "decode": (1, "lengths", None)}
    base = {"row_ids": "slot_ids", "positions": "positions"}
    paged = {**base, "entry_block_table": "entry_block_table", "index_key_block_table": "index_key_block_table"}
    assert {n: e["row_inputs"] for n, e in passes.items()} == {
        "prefill": {**paged, "tokens": "token_ids", "lengths": "new_tokens"},
        "verify": {**paged, "tokens": "token_ids"}, "draft": {**base, "tokens": "token_ids"},
        "commit": {**paged, "accept_len": "accepted_tokens"}, "decode": {**paged, "tokens": "token_ids", "lengths": "new_tokens"}}
    tables = {s["name"]: s["shape"] for s in passes["prefill"]["inputs"] if s["name"].endswith("block_table")}
    assert tables == {"entry_block_table": ["rows", d.max_seq_len // d.entry_page_tokens],
                      "index_key_block_table": ["rows", d.max_seq_len // d.index_page_tokens]}
    # The loaded specs carry what the manifest records.
    for info in fused_pkg.passes.values():
        assert (info.advances, info.reads_staging_of) == (passes[info.name]["advances"],
                                                          passes[info.name]["reads_staging_of"])
        for spec in info.inputs:
            if spec.role in ("cache", "staging"):
                assert spec.info == fused_pkg.manifest.buffers[spec.name]


def test_the_fingerprint_covers_buffer_and_pass_data_but_not_buckets(tiny_recipe):
    m = contract_manifest(tiny_recipe)
    moved = edited(m, lambda x: x["buffers"]["cache.layer0.window"].update(dims=32))
    assert moved["abi_fingerprint"] != m["abi_fingerprint"]
    assert edited(m, lambda x: x["passes"]["verify"].update(advances="tokens"))["abi_fingerprint"] != m["abi_fingerprint"]
    assert edited(m, lambda x: x["passes"]["verify"].update(rows_buckets=[1]))["abi_fingerprint"] == m["abi_fingerprint"]
    assert m["abi_fingerprint"] == fingerprint(contract(m["passes"], m["buffers"], m["cache_formats"]))


# -- versions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.0", "1.1", "2.0", "3.0"])
def test_a_format_1_package_is_refused_with_the_re_export_advice(tiny_recipe, tmp_path, version):
    m = edited(contract_manifest(tiny_recipe), lambda x: x.update(format_version=version))
    with pytest.raises(PackageError, match=rf"format_version {version} is older .*re-export it with this version of "
                                           r"b12x \(b12x export --recipe dsv41-tiny\)"):
        read_back(m, tmp_path)


@pytest.mark.parametrize("old", [1, 2, 3, 4, 5, 6])  # 4: before the quantized linears, 5: before Engram's ops, 6: before row-invariant ops
def test_an_older_op_set_package_is_refused_with_the_re_export_advice(tiny_recipe, tmp_path, old):
    m = edited(contract_manifest(tiny_recipe), lambda x: x.update(opset_version=old))
    with pytest.raises(PackageError, match=rf"opset_version {old} is unknown; this runtime has op set 7: re-export it with "
                                           r"this version of b12x \(b12x export --recipe dsv41-tiny\)"):
        read_back(m, tmp_path)


def test_a_newer_format_or_op_set_asks_for_a_newer_b12x(tiny_recipe, tmp_path):
    base = contract_manifest(tiny_recipe)
    for newer in ("5.0", "4.5"):
        with pytest.raises(PackageError, match=rf"format_version {newer} is not supported .*reads 4\.0 to 4\.4.*newer b12x"):
            read_back(edited(base, lambda x: x.update(format_version=newer)), tmp_path)
    with pytest.raises(PackageError, match=r"opset_version 8 is unknown; .*not an op set this runtime knows"):
        read_back(edited(base, lambda x: x.update(opset_version=8)), tmp_path)
    assert read_back(base, tmp_path).format_version == "4.3"  # the unedited manifest reads


@pytest.mark.parametrize("minor", ["4.0", "4.1", "4.2", "4.3", "4.4"])
def test_every_minor_up_to_this_runtimes_reads(tiny_recipe, tmp_path, minor):
    assert read_back(edited(contract_manifest(tiny_recipe), lambda x: x.update(format_version=minor)),
                     tmp_path).format_version == minor


def test_a_package_with_weight_formats_is_written_and_read_as_4_2(tmp_path):
    # dsv4-tiny stores V4 Instruct's formats: `weights.formats` and `weights.activation`, new in 4.2.
    m = contract_manifest(load_recipe("dsv4-tiny"))
    assert (m["format_version"], m["opset_version"]) == ("4.2", 7)
    read = read_back(m, tmp_path)
    assert read.weights.activation == "deepseek" and read.weights.formats
    assert {f.describe() for f in read.weights.formats.values()} == {"fp8_e4m3 128x128 ue8m0", "fp4_e2m1 1x32 ue8m0",
                                                                     "bf16"}


# -- malformed data -----------------------------------------------------------------------------


def _buffer(name, **fields):
    return lambda m: m["buffers"][name].update(fields)


def _drop(name, field):
    return lambda m: m["buffers"][name].pop(field)


def _pass(name, **fields):
    return lambda m: m["passes"][name].update(fields)


MALFORMED = {
    "field missing": (_drop("cache.layer0.window", "dims"), r"buffer cache\.layer0\.window: fields missing \['dims'\]"),
    "field unknown": (_buffer("cache.layer0.window", heads=1), r"buffer cache\.layer0\.window: unknown fields \['heads'\]"),
    "kind unknown": (_buffer("cache.layer0.window", kind="window_rings"),
                     r"buffer cache\.layer0\.window: field 'kind': 'window_rings' is not a kind of cache buffer"),
    "kind of another role": (_buffer("cache.layer0.window", kind="window_staging"),
                             r"buffer cache\.layer0\.window: field 'kind': 'window_staging' is not a kind of cache"),
    "kind not a string": (_buffer("cache.seq_len", kind=7), r"buffer cache\.seq_len: field 'kind': 7 is not a string"),
    "dims a string": (_buffer("cache.layer0.window", dims="64"), r"buffer cache\.layer0\.window: field 'dims': '64'"),
    "dims a bool": (_buffer("cache.layer0.window", dims=True), r"buffer cache\.layer0\.window: field 'dims': True"),
    "dims off the row": (_buffer("cache.layer0.window", dims=32), r"buffer cache\.layer0\.window: field 'dims': 32 "),
    "format unknown": (_buffer("cache.layer4.index", format="fp8"), r"buffer cache\.layer4\.index: field 'format': 'fp8'"),
    "format another width": (_buffer("cache.layer0.window", format="bf16"),
                             r"buffer cache\.layer0\.window: field 'dims': 64 bf16 values"),
    "layer missing": (_buffer("cache.layer0.window", layer=None), r"buffer cache\.layer0\.window: field 'layer'"),
    "stage on a layer cache": (_buffer("cache.layer0.window", stage=0), r"cache\.layer0\.window: field 'stage'"),
    "ring ratio": (_buffer("cache.layer2.state", ratio=2), r"buffer cache\.layer2\.state: field 'ratio'"),
    "rows per slot": (_buffer("cache.layer4.compressed", rows_per_slot=7),
                      r"buffer cache\.layer4\.compressed: field 'rows_per_slot'"),
    "page missing": (_buffer("staging.verify.layer0.window", page=None),
                     r"buffer staging\.verify\.layer0\.window: field 'page'"),
    "page of another size": (_buffer("staging.verify.layer0.window", page={"layout": "NHD", "page_size": 8}),
                             r"buffer staging\.verify\.layer0\.window: field 'page'"),
    "entry not an object": (lambda m: m["buffers"].update({"cache.seq_len": "seq_len"}),
                            r"buffer cache\.seq_len: expected an object"),
    "buffer undescribed": (lambda m: m["buffers"].pop("cache.draft0.window"),
                           r"buffers: cache\.draft0\.window is not described"),
    "buffers missing": (lambda m: m.pop("buffers"), r"'buffers' is missing"),
    "advances missing": (lambda m: m["passes"]["prefill"].pop("advances"),
                         r"passes\.prefill: fields missing \['advances'\]"),
    "advances dropped": (_pass("prefill", advances=None), r"passes\.prefill\.advances: None; the pass's count inputs are"),
    "advances another input": (_pass("commit", advances="positions"), r"passes\.commit\.advances: 'positions'"),
    "width a string": (_pass("verify", width="8"), r"passes\.verify\.width: '8'"),
    "staging of no pass": (_pass("commit", reads_staging_of="stage"), r"passes\.commit\.reads_staging_of: 'stage'"),
    "row input kind unknown": (lambda m: m["passes"]["verify"]["row_inputs"].update(tokens="words"),
                               r"passes\.verify\.row_inputs\.tokens: kind 'words' is not one of"),
    "row input without kind": (lambda m: m["passes"]["verify"]["row_inputs"].pop("tokens"),
                               r"passes\.verify\.row_inputs: input tokens has no kind"),
    "two slot inputs": (lambda m: m["passes"]["verify"]["row_inputs"].update(positions="slot_ids"),
                        r"passes\.verify\.row_inputs: 2 inputs of kind slot_ids"),
    "two token inputs": (lambda m: m["passes"]["verify"]["row_inputs"].update(entry_block_table="token_ids"),
                         r"passes\.verify\.row_inputs: 2 inputs of kind token_ids; expected one of each kind"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_data_is_refused_naming_the_buffer_and_field(tiny_recipe, tmp_path, case):
    edit, message = MALFORMED[case]
    with pytest.raises(PackageError, match=message):
        read_back(edited(contract_manifest(tiny_recipe), edit), tmp_path)


def test_load_refuses_a_package_whose_buffer_kind_is_unknown(small_path, tmp_path):
    """Through load() too: the data is checked before any graph is deserialised."""
    target = shutil.copytree(small_path, tmp_path / "copy.b12x")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["buffers"]["cache.layer1.compressed"]["kind"] = "compressed"
    refingerprint(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"buffer cache\.layer1\.compressed: field 'kind': 'compressed'"):
        load(target)


def test_inspect_shows_kind_layer_and_format(small_path):
    result = CliRunner().invoke(main, ["inspect", str(small_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    table = result.output.split("buffers: what each cache and staging buffer holds")[1]
    line = next(x for x in table.splitlines() if "cache.layer1.compressed" in x)
    assert [cell.strip() for cell in line.split("│")[2:4]] == ["compressed_entries", "L1"] and "dsv41_nvfp4 x64" in line
    words = " ".join(result.output.split())  # captions wrap at the console's width
    assert "advances lengths;" in words and "advances accept_len; persists the staging of verify" in words


def test_inspect_shows_whose_records_the_caches_hold(small_path):
    result = CliRunner().invoke(main, ["inspect", str(small_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    table = result.output.split("cache formats: whose bytes the caches hold")[1]
    line = next(x for x in table.splitlines() if "dsv41_nvfp4" in x)
    assert "DeepSeek V4.1 compressed record (indexed), flashinfer-python 0.7.4" in line
    assert "records of flashinfer-python 0.7.4" in " ".join(table.split())


def _rewritten(small_path, tmp_path, change) -> Path:
    target = shutil.copytree(small_path, tmp_path / "copy.b12x")
    manifest = json.loads((target / "manifest.json").read_text())
    change(manifest)
    refingerprint(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


@pytest.mark.parametrize("change,message", [
    (lambda m: m["cache_formats"].update(dsv41_mxfp8="DeepSeek V4.1 window record (swa), flashinfer-python 0.7.3"),
     r"cache format 'dsv41_mxfp8' holds '.*0\.7\.3'; this runtime reads and writes '.*0\.7\.4': re-export"),
    (lambda m: m["cache_formats"].pop("dsv41_nvfp4"), r"cache_formats does not say whose bytes format 'dsv41_nvfp4'"),
    (lambda m: m.pop("cache_formats"), r"'cache_formats' is missing"),
    (lambda m: m["cache_formats"].update(bf16="bfloat16 bits"), r"cache_formats names \['bf16'\], which no buffer uses"),
    (lambda m: [b.update(format="nvfp4") for b in m["buffers"].values() if b["format"] == "dsv41_nvfp4"],
     r"'nvfp4' is not one of .*'nvfp4' was renamed: use dsv41_nvfp4"),
], ids=["other-flashinfer", "unrecorded", "missing", "unused", "old-name"])
def test_load_refuses_caches_of_another_convention(small_path, tmp_path, change, message):
    target = _rewritten(small_path, tmp_path, change)
    with pytest.raises(PackageError, match=message):
        load(target)

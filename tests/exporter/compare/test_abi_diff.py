"""`b12x abi diff`: empty for packages that bind alike, one line per kind of change otherwise."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.compare.abi_diff import diff_manifests
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.manifest import digest

pytestmark = pytest.mark.slow(minutes=0.4)


@pytest.fixture(scope="module")
def base(small_path):
    return json.loads((small_path / "manifest.json").read_text())


def _crafted(manifest: dict, edit) -> dict:
    """A manifest whose calling conventions differ by `edit`, with a consistent fingerprint and digest."""
    out = copy.deepcopy(manifest)
    edit(out["passes"])
    # Buffers no pass binds any more leave the buffer table with it (a reader refuses strays).
    bound = {s["name"] for p in out["passes"].values() for s in p["inputs"]}
    out["buffers"] = {name: info for name, info in out["buffers"].items() if name in bound}
    out["abi_fingerprint"] = fingerprint(contract(out["passes"], out["buffers"], out.get("cache_formats")))
    out["manifest_sha256"] = digest(out)
    return out


def _buffer(passes, pass_name, name):
    entry = passes[pass_name]
    return next(s for s in entry["inputs"] + entry["outputs"] if s["name"] == name)


def _rename(passes, pass_name, old, new):
    _buffer(passes, pass_name, old)["name"] = new
    kinds = passes[pass_name]["row_inputs"]
    if old in kinds:  # a row input keeps its kind under the new name
        kinds[new] = kinds.pop(old)


def _swap_inputs(passes, pass_name, a, b):
    inputs = passes[pass_name]["inputs"]
    i, j = (next(k for k, s in enumerate(inputs) if s["name"] == n) for n in (a, b))
    inputs[i], inputs[j] = inputs[j], inputs[i]


CHANGES = {
    "pass removed": (lambda p: p.pop("draft"), "pass draft: removed"),
    "pass added": (lambda p: p.update(mtp=copy.deepcopy(p["draft"])), "pass mtp: added"),
    "input added": (lambda p: p["verify"]["inputs"].append({"name": "temperature", "role": "input", "dtype": "float32",
                                                            "shape": ["rows"]}),
                    "verify input temperature: added (input float32 [rows])"),
    "input removed": (lambda p: p["commit"]["inputs"].pop(), "commit input accept_len: removed (input int32 [rows])"),
    "input renamed": (lambda p: _rename(p, "verify", "tokens", "token_ids"), "verify input tokens: renamed to token_ids"),
    "output renamed": (lambda p: _rename(p, "draft", "logits", "scores"), "draft output logits: renamed to scores"),
    "output added": (lambda p: p["draft"]["outputs"].append({"name": "hidden", "role": "output", "dtype": "float32",
                                                             "shape": ["rows", 7, 128]}),
                     "draft output hidden: added (output float32 [rows, 7, 128])"),
    "dtype changed": (lambda p: _buffer(p, "prefill", "tokens").update(dtype="int64"),
                      "prefill input tokens: dtype int32 -> int64"),
    "shape changed": (lambda p: _buffer(p, "verify", "staging.verify.layer1.window").update(shape=["rows", 9, 16, 1, 70]),
                      "verify input staging.verify.layer1.window: shape [rows, 9, 16, 1, 66] -> [rows, 9, 16, 1, 70]"),
    "symbolic shape changed": (lambda p: _buffer(p, "commit", "cache.seq_len").update(shape=["rows"]),
                               "commit input cache.seq_len: shape [slots] -> [rows]"),
    "role changed": (lambda p: _buffer(p, "draft", "cache.draft0.window").update(role="staging"),
                     "draft input cache.draft0.window: role cache -> staging"),
    "reordered": (lambda p: _swap_inputs(p, "verify", "row_ids", "positions"), "verify inputs: reordered"),
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_each_kind_of_change_is_reported_once(base, kind):
    edit, expected = CHANGES[kind]
    assert diff_manifests(base, _crafted(base, edit)) == [expected]


def test_versions_that_gate_loading_are_reported(base):
    newer = {**base, "opset_version": base["opset_version"] + 1}
    assert diff_manifests(base, newer) == [f"op set: version {base['opset_version']} -> {base['opset_version'] + 1}"]


def test_cli_is_quiet_for_fused_vs_unfused(small_path, small_unfused_path, structural_path):
    for other in (small_unfused_path, structural_path):  # rewrites and stored weights are not the ABI
        result = CliRunner().invoke(main, ["abi", "diff", str(small_path), str(other)])
        assert result.exit_code == 0, result.output
        assert result.output.startswith("ABI identical: ")


def test_cli_prints_the_changes_and_fails(base, small_path, tmp_path):
    changed = _crafted(base, lambda p: (p.pop("draft"), _rename(p, "verify", "tokens", "token_ids")))
    (tmp_path / "manifest.json").write_text(json.dumps(changed))
    result = CliRunner().invoke(main, ["abi", "diff", str(small_path), str(tmp_path / "manifest.json")])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == ["pass draft: removed", "verify input tokens: renamed to token_ids"]
    assert "ABI differs: 2 change(s)" in result.stderr


def test_cli_refuses_a_manifest_whose_fingerprint_lies(base, small_path, tmp_path):
    lying = copy.deepcopy(base)
    lying["passes"]["verify"]["inputs"].pop()
    lying["manifest_sha256"] = digest(lying)  # the document is signed; its fingerprint is what lies
    (tmp_path / "manifest.json").write_text(json.dumps(lying))
    result = CliRunner().invoke(main, ["abi", "diff", str(small_path), str(tmp_path / "manifest.json")])
    assert result.exit_code == 1 and "abi_fingerprint does not match the calling conventions" in result.output

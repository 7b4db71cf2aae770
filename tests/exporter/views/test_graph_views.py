"""Views of a package's graphs: node-per-line text, Graphviz, ONNX, and the numbered pass dumps."""

from __future__ import annotations

import re

import onnx
import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.runtime.ops.namespace import NAMESPACE, OPSET_VERSION

pytestmark = pytest.mark.slow(minutes=0.1)  # the module's time on two busy cores: longest runs first

FUSED = "b12x_toolchain.window_snapshot_append.default"


def _inspect(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)], terminal_width=200)


def _op_nodes(pkg, pass_name):
    return [n for n in pkg.passes[pass_name].program.graph.nodes if n.op == "call_function"]


def test_graph_prints_one_node_per_line_with_ops_and_shapes(small_path, small_pkg):
    result = _inspect(small_path, "--graph", "verify")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    ops = _op_nodes(small_pkg, "verify")
    assert lines[0] == f"# verify: {len(ops)} op nodes; symbols: entry_pages, index_key_pages, rows, slots"
    assert len(lines) == 1 + len(small_pkg.passes["verify"].program.graph.nodes)
    assert "%cache.layer0.window : uint8[slots, 128, 66]  (cache)" in lines
    assert "%tokens : int32[rows, 8]  (input)" in lines
    assert "%cache.layer1.compressed : uint8[entry_pages, 1152]  (cache)" in lines  # 32 records of 36 bytes
    assert "%entry_block_table : int32[rows, 16]  (input)" in lines
    fused = [line for line in lines if f"= {FUSED}(" in line]
    assert len(fused) == 2  # one per layer
    assert fused[0].endswith("'dsv41_mxfp8')  # writes %staging.verify.layer0.window")
    assert re.fullmatch(r"return \{logits: %\w+\}", lines[-1])
    assert any(line.endswith(": float32[rows, 8, 512]") for line in lines)


def test_unknown_pass_and_dot_without_graph_are_refused(small_path):
    result = _inspect(small_path, "--graph", "sample")
    assert result.exit_code == 1 and "no pass 'sample'; this package has commit, decode, draft, prefill, verify" in result.output
    assert "--dot needs --graph PASS" in _inspect(small_path, "--dot", "-").output


def test_dot_writes_graphviz(small_path, small_pkg, tmp_path):
    result = _inspect(small_path, "--graph", "draft", "--dot", tmp_path / "draft.dot")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "draft.dot").read_text()
    assert text.startswith('digraph "draft" {') and text.rstrip().endswith("}")
    nodes = re.findall(r"^  n\d+ \[label=", text, flags=re.M)
    assert len(nodes) == len(small_pkg.passes["draft"].program.graph.nodes)
    writes = re.findall(r"^  n\d+ -> n\d+ \[color=red, style=dashed, constraint=false, label=writes\];$", text, flags=re.M)
    assert len(writes) == 1  # one fused window write per draft stage


def test_onnx_views_pass_the_checker(small_path, small_pkg, tmp_path):
    result = _inspect(small_path, "--onnx", tmp_path)
    assert result.exit_code == 0, result.output
    for pass_name, info in small_pkg.passes.items():
        model = onnx.load(str(tmp_path / f"{pass_name}.onnx"))
        onnx.checker.check_model(model, full_check=True)
        assert {(o.domain, o.version) for o in model.opset_import} >= {(NAMESPACE, OPSET_VERSION), ("org.pytorch.aten", 1)}
        assert [i.name for i in model.graph.input] == [s.name for s in info.inputs]
        b12x_ops = [n for n in model.graph.node if n.domain == NAMESPACE]
        assert len(b12x_ops) == sum(1 for n in _op_nodes(small_pkg, pass_name) if getattr(n.target, "namespace", None) == NAMESPACE)
        assert [o.name for o in model.graph.output][: len(info.outputs)] == [s.name for s in info.outputs]
    verify = onnx.load(str(tmp_path / "verify.onnx"))
    fused = [n for n in verify.graph.node if n.op_type == "window_snapshot_append"]
    assert len(fused) == 2
    # In-place writes are new versions: the staging buffer goes in, its next version comes out.
    assert fused[0].input[1] == "staging.verify.layer0.window" and fused[0].output == ["staging.verify.layer0.window@1"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in fused[0].attribute} == {
        "history": 128, "layout": b"NHD", "page_size": 16, "fmt": b"dsv41_mxfp8"}
    assert "staging.verify.layer0.window@1" in [o.name for o in verify.graph.output]
    logits = next(o for o in verify.graph.output if o.name == "logits")
    assert [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim] == ["rows", 8, 512]


def test_dump_passes_numbers_every_rewrite(structural_path):
    dump = structural_path.parent.parent / "dump"
    assert sorted(p.name for p in dump.iterdir()) == ["commit", "decode", "draft", "prefill", "verify"]
    for pass_name in ("prefill", "verify", "draft", "commit", "decode"):
        assert sorted(p.name for p in (dump / pass_name).iterdir()) == ["00-captured.txt", "01-fuse_window_snapshot.txt"]
    before = (dump / "verify" / "00-captured.txt").read_text()
    after = (dump / "verify" / "01-fuse_window_snapshot.txt").read_text()
    count = lambda text: int(re.match(r"# verify after \w+: (\d+) op nodes", text).group(1))
    assert count(before) - count(after) == 2
    assert FUSED not in before and after.count(f"= {FUSED}(") == 2
    assert before.count("= b12x_toolchain.window_snapshot.default(") == 2

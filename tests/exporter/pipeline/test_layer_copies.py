"""Layers traced once and copied: the graph a direct capture gives, node for node, in less time.

Toy modules show the mechanism (the graph before stitching, and after it compared with the
graph expected, the direct capture's; numbers against the module itself; refusals); a
recipe with every layer kind repeated shows it on the model's verify pass (every target
layer kind, its staging written in place) and on the draft stages. Prefill and decode copy
the same layer kinds, writing the caches themselves in place; there a wrong copy shows in
the numbers of the tiny recipe's tests (five layer halves of its prefill are copies), not here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.pipeline import capture as capture_module
from b12x_toolchain.exporter.pipeline.capture import capture, no_stack_traces
from b12x_toolchain.exporter.pipeline.layer_copies import COPY, MARKERS, copying_layers
from b12x_toolchain.exporter.pipeline.package_writer import program_bytes
from b12x_toolchain.exporter.pipeline.stitch_layer_copies import StitchError, stitch
from b12x_toolchain.exporter.pipeline.structural import fake_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict
from b12x_toolchain.runtime.rewrite import RewriteError, RewriteResult, count_nodes

pytestmark = pytest.mark.slow(minutes=0.6)


def canonical(graph_module) -> list:
    """Each node as (op, target, arguments by position, shape and dtype): the graph less its node names."""
    index, out = {}, []
    for k, node in enumerate(graph_module.graph.nodes):
        index[node] = k
        val = node.meta.get("val")
        value = (tuple(map(str, val.shape)), val.dtype) if isinstance(val, torch.Tensor) else str(val)
        args = torch.fx.map_arg((node.args, node.kwargs), lambda x: ("node", index[x]))
        out.append((node.op, str(node.target), repr(args), value))
    return out


class Stack(torch.nn.Module):
    """Three layers of one kind, one of another (a wider weight); each writes its own cache."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.copies, self.leak = None, leak

    def forward(self, weights, caches, x):
        leaked = None
        for i, (w, cache) in enumerate(zip(weights, caches)):
            def body(x=x, w=w, cache=cache):
                nonlocal leaked
                h = torch.tanh(x @ w) + (0 if leaked is None or not self.leak else leaked)
                cache.copy_(h.sum(dim=0)[: cache.shape[0]])
                leaked = h.sum(dim=-1, keepdim=True)
                return [h[:, : x.shape[1]] * 0.5 + x], None

            if self.copies is None:
                x = body()[0][0]
            else:
                x = self.copies.run(("toy",), [x, w, cache], body)[0][0]
        return x


def _stack_inputs():
    torch.manual_seed(0)
    widths = (8, 8, 16, 8)
    weights = [torch.randn(8, n) for n in widths]
    caches = [torch.zeros(4) for _ in widths]
    return weights, caches, torch.randn(2, 8)


def _export_stack(module, copy_layers: bool):
    args = _stack_inputs()
    with copying_layers() as copies, no_stack_traces():  # as a pass is captured: stack traces name lines
        module.copies = copies if copy_layers else None
        rows = torch.export.Dim("rows", min=1, max=64)
        program = torch.export.export(module, args, strict=False,
                                      dynamic_shapes=([None] * 4, [None] * 4, {0: rows}))
        module.copies = None
    return program


def test_toy_stack_traces_each_kind_once_and_stitches_to_the_direct_graph():
    program = _export_stack(Stack(), copy_layers=True)
    before = [n.target for n in program.graph.nodes]
    # Before: layer 0 and layer 2 (the wider weight) traced between markers, 1 and 3 stubbed.
    assert before.count(MARKERS[0]) == 2 and before.count(MARKERS[1]) == 2 and before.count(COPY) == 2
    assert before.count(torch.ops.aten.tanh.default) == 2
    direct = _export_stack(Stack(), copy_layers=False)  # the graph expected after stitching
    nodes_before, nodes_expected = count_nodes(program.graph_module), count_nodes(direct.graph_module)
    assert stitch(program, "toy") == RewriteResult("stitch_layer_copies", True, 2, nodes_before, nodes_expected)
    after = [n.target for n in program.graph.nodes]
    assert not {*MARKERS, COPY} & set(after)
    assert after.count(torch.ops.aten.tanh.default) == 4 and after.count(torch.ops.aten.copy_.default) == 4
    assert stitch(direct, "toy") == RewriteResult("stitch_layer_copies", False, 0, nodes_expected, nodes_expected)
    assert canonical(program.graph_module) == canonical(direct.graph_module)
    assert program_bytes(program) == program_bytes(direct)
    # Numbers: the stitched program against the module itself, outputs and every cache written.
    expected_caches, stitched_caches = _stack_inputs()[1], _stack_inputs()[1]
    weights, _, x = _stack_inputs()
    expected = Stack()(weights, expected_caches, x)
    got = program.module()(weights, stitched_caches, x)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(stitched_caches, expected_caches))
    assert all(c.abs().sum() > 0 for c in stitched_caches)


def test_stitch_refuses_a_template_that_reads_another_layers_nodes():
    program = _export_stack(Stack(leak=True), copy_layers=True)
    with pytest.raises(RewriteError, match=r"rewrite stitch_layer_copies failed on the toy graph: layer template 1: "
                                           r"node \w+ reads \w+, which belongs to another layer") as info:
        stitch(program, "toy")
    assert isinstance(info.value.__cause__, StitchError)


@pytest.fixture(scope="module")
def repeated():
    from importlib.resources import files

    data = yaml.safe_load((files("b12x_toolchain.recipes") / "dsv41-tiny.yaml").read_bytes())
    model = copy.deepcopy(data["model"])
    model.update(num_layers=9, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 0, 0])
    model["csa2"].update(kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5)
    model["draft"]["target_layer_ids"] = [6, 7, 8]
    data.update(name="dsv41-repeated", model=model)
    return Dims.from_recipe(recipe_from_dict(data))


@pytest.mark.parametrize("name, copies", [("verify", 10), ("draft", 2)])
def test_copied_layers_give_the_graph_of_a_direct_capture(repeated, name, copies, monkeypatch):
    made = []
    monkeypatch.setattr(capture_module, "stitch", lambda program, graph: made.append(stitch(program, graph).matches))
    copied = capture(PASSES[name](repeated), fake_weights(repeated))
    direct = capture(PASSES[name](repeated), fake_weights(repeated), copy_layers=False)
    # Attention halves: layer 1 repeats 0 (window), 4 repeats 3 (ratio-2 Reuse), 8 repeats 6
    # (ratio-1 Reuse, whichever layer it takes the top-k from); MoE halves: layers 2-8 repeat 1
    # (routed; 0 is hashed). The draft pass: stage 1 repeats both halves of stage 0.
    assert made == [copies, 0]
    assert canonical(copied.graph_module) == canonical(direct.graph_module)
    assert program_bytes(copied) == program_bytes(direct)  # names and signature too

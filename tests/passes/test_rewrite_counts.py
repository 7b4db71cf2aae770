"""The fusion removes exactly one node per fused window layer and touches nothing else."""

from __future__ import annotations

from collections import Counter


def _ops(pkg, pass_name) -> Counter:
    graph = pkg.passes[pass_name].program.graph
    return Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def test_one_node_fewer_per_window_layer(fused_pkg, unfused_pkg, tiny_recipe):
    window_layers = {"verify": tiny_recipe.model.num_layers, "draft": tiny_recipe.model.draft.stages}
    for pass_name, layers in window_layers.items():
        fused, unfused = _ops(fused_pkg, pass_name), _ops(unfused_pkg, pass_name)
        assert sum(unfused.values()) - sum(fused.values()) == layers
        # vLLM-style accounting: fused-away ops gone, fused-in op present once per layer.
        assert unfused["b12x_toolchain.window_snapshot.default"] == layers and fused["b12x_toolchain.window_snapshot.default"] == 0
        assert unfused["b12x_toolchain.cache_append.default"] == layers and fused["b12x_toolchain.cache_append.default"] == 0
        assert fused["b12x_toolchain.window_snapshot_append.default"] == layers
        assert unfused["b12x_toolchain.window_snapshot_append.default"] == 0
        rest = lambda c: {k: v for k, v in c.items() if "window_snapshot" not in k and "cache_append" not in k}
        assert rest(fused) == rest(unfused)
        record = fused_pkg.manifest.rewrites.results[pass_name]["fuse_window_snapshot"]
        assert record.matches == layers
        assert record.nodes_before - record.nodes_after == layers


def test_prefill_and_commit_graphs_unchanged(fused_pkg, unfused_pkg):
    for pass_name in ("prefill", "commit"):
        assert _ops(fused_pkg, pass_name) == _ops(unfused_pkg, pass_name)
        record = fused_pkg.manifest.rewrites.results[pass_name]["fuse_window_snapshot"]
        assert record.matches == 0 and record.nodes_before == record.nodes_after
        # Not only the same op counts: the saved graphs are the same bytes.
        name = f"graphs/{pass_name}.pt2"
        assert fused_pkg.manifest.files[name] == unfused_pkg.manifest.files[name]


def test_unfused_package_records_empty_pipeline(fused_pkg, unfused_pkg):
    assert fused_pkg.manifest.rewrites.pipeline == ("fuse_window_snapshot",)
    assert unfused_pkg.manifest.rewrites.pipeline == ()
    assert unfused_pkg.manifest.rewrites.results["verify"] == {}

"""One package holds every rank: what it stores, what each rank binds, and what is refused
before any replay (a missing group, a wrong world size or rank, a peer that does not answer).

On the small recipe (two layers, tensor 2 and expert 2 over two ranks; conftest's chat
recipe, shared with the serving tests), exported with
weights and structurally (fake weights, on the fake process group) from a checkpoint. The
structural export is `b12x export --weights none --weights-index`, whose report names every
rank's passes.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import yaml
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.model.engram import row_ranges
from b12x_toolchain.exporter.model.parallel import rank_weights
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.pipeline.checkpoint_index import write_checkpoint
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.pass_graph import PassGraph, load_graph, refuse_collectives
from b12x_toolchain.runtime.parallel.group import collective_counts
from b12x_toolchain.runtime.parallel.mapping import Mapping
from conftest import chat_parallel_recipe
from ranks import on_ranks

pytestmark = pytest.mark.slow(minutes=1.2)


@pytest.fixture(scope="module")
def recipe(chat_recipe):
    return chat_parallel_recipe(chat_recipe, "tensor2-expert2")


@pytest.fixture(scope="module")
def whole(recipe):
    return init_weights(Dims.from_recipe(recipe), recipe.model.init_seed)


@pytest.fixture(scope="module")
def checkpoint(whole, tmp_path_factory):
    return write_checkpoint(whole, tmp_path_factory.mktemp("checkpoint"), shard_bytes=1 << 20)


@pytest.fixture(scope="module")
def packed(chat_parallel_path):
    return chat_parallel_path("tensor2-expert2")  # exported with the recipe's own weights, `whole`


@pytest.fixture(scope="module")
def exported_structurally(recipe, checkpoint, tmp_path_factory):
    """The command line's structural export of the recipe (one pass at a time, as export_package
    with structural=True and the checkpoint's checksums): its report, and the package."""
    folder = tmp_path_factory.mktemp("structural")
    source = folder / "parallel.yaml"
    source.write_text(yaml.safe_dump(recipe.normalized()))
    result = CliRunner().invoke(main, ["export", "--recipe", str(source), "--weights", "none", "--weights-index",
                                       str(checkpoint), "--out", str(folder / "out")], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output, folder / "out" / f"{recipe.name}.b12x"


@pytest.fixture(scope="module")
def structural(exported_structurally):
    return exported_structurally[1]


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_export_reports_every_ranks_passes(exported_structurally, recipe):
    output, structural = exported_structurally
    for rank in range(2):
        for name in recipe.pass_names:
            assert f"captured {name} (rank {rank}) in " in output
    assert (structural / "ranks" / "1" / "graphs" / "verify.pt2").is_file()


def test_every_rank_has_its_graphs_and_shards(packed, structural, recipe):
    m, s = manifest(packed), manifest(structural)
    assert m["format_version"] == "4.4" and m["parallel"]["world_size"] == 2  # 4.4: it carries a tokenizer
    # The Engram table is split by hash head: each rank's row range, recorded as data.
    table = "model.layers.1.engram.embed.weight"
    assert m["parallel"]["splits"][table] == {"axis": 0, "parts": 2, "halves": False,
                                              "ranges": [list(r) for r in row_ranges(Dims.from_recipe(recipe), 1, 2)]}
    assert m["weights"]["engram_tables"] == [table]
    assert m["abi_fingerprint"] == s["abi_fingerprint"]
    for rank in range(2):
        for name, graph in m["parallel"]["ranks"][rank]["graphs"].items():
            assert graph == f"ranks/{rank}/graphs/{name}.pt2"
            # A structural rank holds the very graph a capture with real weights gives.
            assert (packed / graph).read_bytes() == (structural / graph).read_bytes()
        assert m["parallel"]["ranks"][rank]["weights"] == f"ranks/{rank}/weights.safetensors"
        assert s["parallel"]["ranks"][rank]["weights"] is None
    # The two ranks' graphs differ (vocabulary and expert offsets), their conventions do not.
    assert (packed / "ranks/0/graphs/verify.pt2").read_bytes() != (packed / "ranks/1/graphs/verify.pt2").read_bytes()
    program = load_graph("verify", (packed / "ranks/0/graphs/verify.pt2").read_bytes())
    layers = recipe.model.num_layers
    # Per layer: after the row-parallel O and after the experts; one for the embedding; the head's
    # gather, and one per Engram layer (its columns).
    assert collective_counts(program.graph) == {"all_reduce": 2 * layers + 1, "all_gather_into_tensor": 2}
    assert m["parallel"]["collectives"]["verify"] == collective_counts(program.graph)
    assert m["parallel"]["collectives"]["commit"] == {}
    with pytest.raises(PackageError, match="calls _c10d_functional.all_reduce.default, but the package has no "
                                           "parallel mapping"):
        refuse_collectives({"verify": PassGraph("verify", (packed / "ranks/0/graphs/verify.pt2").read_bytes())})


def _two_ranks(rank, packed, structural, checkpoint, done):
    """What one rank of two binds, then what it is refused: another rank's place, and (rank 0)
    a load that waits for a peer which never loads."""
    bound = load(packed, rank=rank).weights, load(structural, rank=rank, weights=checkpoint).weights
    refused = [_refusal(lambda: load(packed, rank=1 - rank))]
    if rank == 0:
        refused.append(_refusal(lambda: load(packed, rank=0, peer_timeout=2)))
        done.touch()
    else:  # alive, but not loading, until rank 0 has given up on it
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    return bound, refused


def _refusal(call):
    try:
        call()
    except PackageError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def two_ranks(packed, structural, checkpoint, tmp_path_factory):
    return on_ranks(_two_ranks, 2, packed, structural, checkpoint, tmp_path_factory.mktemp("flag") / "done")


def test_each_rank_binds_its_shards_from_the_package_or_a_whole_checkpoint(two_ranks, whole, recipe):
    d = Dims.from_recipe(recipe)
    for rank, ((stored, from_checkpoint), _) in enumerate(two_ranks):
        expected = rank_weights(whole, d, rank)
        assert stored.keys() == from_checkpoint.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(stored[name], tensor) and torch.equal(from_checkpoint[name], tensor), name
        assert stored["lm_head.weight"].shape[0] == d.vocab // 2


def test_a_rank_is_refused_before_any_replay(packed, chat_path, two_ranks, tmp_path):
    with pytest.raises(PackageError, match=r"exported for tensor 2, expert 2 \(world size 2\); load it in each "
                                           r"rank's process with load\(path, rank=R\)"):
        load(packed)
    with pytest.raises(PackageError, match="rank 0 of a package for tensor 2, expert 2 .*: no process group is "
                                           "initialised in this process"):
        load(packed, rank=0)
    with pytest.raises(PackageError, match="rank 2 is out of range"):
        load(packed, rank=2)
    with pytest.raises(PackageError, match="rank 1: the package was exported for one device"):
        load(chat_path, rank=1)
    # A default group of one, in this process (no rank process to start for it), gone after.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(PackageError, match="this process's default group has world size 1; the package was "
                                               "exported for world size 2"):
            load(packed, rank=0)
    finally:
        dist.destroy_process_group()
    (_, (swapped, missing)), (_, (swapped_1,)) = two_ranks
    assert "this process is rank 0 of its default group, not rank 1" in swapped
    assert "this process is rank 1 of its default group, not rank 0" in swapped_1
    assert "rank 0 of world size 2: rank 1 did not answer within 2 s" in missing


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(world_size=4), "expected each of tensor and expert to be 1 or the world size"),
    (lambda p: p.update(tensor=3, world_size=3), "expected each of tensor and expert to be 1 or the world size"),
    (lambda p: p["ranks"].pop(), "parallel.ranks must list 2 ranks"),
    (lambda p: p["ranks"][1]["graphs"].pop("draft"), r"parallel.ranks\[1\].graphs must name a graph file for each"),
    (lambda p: p["splits"].update({"lm_head.weight": {"axis": -1, "parts": 2, "halves": False}}),
     "parallel.splits.lm_head.weight"),
])
def test_a_malformed_mapping_is_refused(packed, change, message):
    m = manifest(packed)
    change(m["parallel"])
    with pytest.raises(PackageError, match=message):
        Mapping.from_json(m["parallel"], m["passes"])


def test_a_tampered_rank_file_is_refused(packed, tmp_path):
    copy = tmp_path / packed.name
    shutil.copytree(packed, copy)
    data = bytearray((copy / "ranks/1/weights.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "ranks/1/weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(PackageError, match="ranks/1/weights.safetensors: sha256 .* does not match"):
        load(copy, rank=0)


def test_a_rank_loads_for_inspection_without_its_group_but_does_not_run(packed):
    pkg = load(packed, rank=1, join_group=False)
    assert (pkg.rank, pkg.mapping.world_size) == (1, 2)
    assert collective_counts(pkg.passes["verify"].program.graph)["all_reduce"] > 0
    with pytest.raises(PackageError, match="rank 1 was loaded for inspection .*load it in its process group"):
        pkg.session()
    shown = CliRunner().invoke(main, ["inspect", str(packed)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "parallel: tensor 2, expert 2 (world size 2)" in shown.output
    graph = CliRunner().invoke(main, ["inspect", str(packed), "--rank", "1", "--graph", "verify"], terminal_width=200)
    assert graph.exit_code == 0 and "all_reduce" in graph.output

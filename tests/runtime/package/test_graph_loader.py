"""The graph loader (built straight from the checked JSON) gives the graphs torch.export.load
gives, a session's replay graphs are those graphs without described values, and only the
passes used are deserialised."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.compare.package_verify import verify_packages
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.package.pass_graph import DIRECT, TORCH, PassGraph
from b12x_toolchain.runtime.serving.engine import Engine, passes_used
from b12x_toolchain.runtime.serving.requests import Request

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=1.1)]


def _value(val):
    if isinstance(val, torch.Tensor):
        return (type(val), tuple(map(str, val.shape)), tuple(map(str, val.stride())), val.dtype, val.device,
                val.requires_grad)
    if isinstance(val, (tuple, list)):
        return tuple(_value(v) for v in val)
    return str(val)


def assert_same_program(ours: torch.export.ExportedProgram, theirs: torch.export.ExportedProgram, name: str):
    """Node for node: names, targets, arguments, metadata keys and described values; and the
    program around the graph (signature, calling spec, ranges, guards, generated code)."""
    a, b = list(ours.graph.nodes), list(theirs.graph.nodes)
    assert len(a) == len(b), name
    for x, y in zip(a, b):
        where = f"{name}: {x.name}"
        assert (x.name, x.op, x.target, str(x.args), str(x.kwargs)) == (y.name, y.op, y.target, str(y.args),
                                                                        str(y.kwargs)), where
        assert set(x.meta) == set(y.meta), where
        assert _value(x.meta.get("val")) == _value(y.meta.get("val")), where
        assert {k: v for k, v in x.meta.items() if k != "val"} == {k: v for k, v in y.meta.items() if k != "val"}, where
    assert ours.graph_module.code == theirs.graph_module.code, name
    assert str(ours.graph_signature) == str(theirs.graph_signature), name
    assert ours.call_spec == theirs.call_spec, name
    assert str(ours.range_constraints) == str(theirs.range_constraints), name
    assert ours._guards_code == theirs._guards_code, name
    assert [type(v) for v in ours.verifiers] == [type(v) for v in theirs.verifiers], name


def assert_same_replay(replay, program: torch.export.ExportedProgram, name: str):
    """A replay graph: the program's nodes, arguments, metadata, code and calling spec, and no
    described values (they are what a replay never reads)."""
    a, b = list(replay.graph_module.graph.nodes), list(program.graph.nodes)
    assert [(x.name, x.op, x.target, str(x.args), str(x.kwargs)) for x in a] == \
        [(y.name, y.op, y.target, str(y.args), str(y.kwargs)) for y in b], name
    assert [x.meta for x in a] == [{k: v for k, v in y.meta.items() if k != "val"} for y in b], name
    assert replay.graph_module.code == program.graph_module.code, name
    assert replay.call_spec.in_spec == program.call_spec.in_spec, name
    assert replay.call_spec.out_spec == program.call_spec.out_spec, name


def _kind(arg):
    if isinstance(arg, torch.fx.Node):
        return "node"
    if isinstance(arg, (tuple, list)):
        return type(arg).__name__, tuple(sorted({_kind(a) for a in arg}, key=repr))
    return type(arg).__name__


def _node_kind(node: torch.fx.Node) -> tuple:
    """What the loader builds a node from: op, target, the types of its arguments by position and
    keyword, its metadata keys (placeholders differ only by name, which the loader copies)."""
    if node.op == "placeholder":
        return node.op, tuple(sorted(node.meta))
    return (node.op, str(node.target), tuple(map(_kind, node.args)),
            tuple((k, _kind(v)) for k, v in sorted(node.kwargs.items())), tuple(sorted(node.meta)))


def covering_passes(package) -> set[str]:
    """The passes of fewest nodes whose node kinds (read from the replay graphs, no program built)
    are all the package's. torch.export.load takes seconds per thousand nodes, and what the loader
    builds depends on a node's kind, not on the pass it is in: comparing these passes compares
    every kind of node any pass holds (prefill and decode, for one, hold the same kinds)."""
    graphs = {name: info.graph.replay.graph_module.graph for name, info in package.passes.items()}
    kinds = {name: {_node_kind(n) for n in graph.nodes} for name, graph in graphs.items()}
    every = set().union(*kinds.values())
    covers = (set(c) for r in range(1, len(kinds) + 1) for c in itertools.combinations(kinds, r)
              if set().union(*(kinds[name] for name in c)) == every)
    return min(covers, key=lambda c: sum(len(graphs[name].nodes) for name in c))


# V4.1's layer kinds with the release's FP8 / FP4 weights, then V4's (CSA with its indexer,
# HCA, the MTP draft) in fp32: the two shared exports cover the op set between them.
@pytest.mark.parametrize("package", ["small_release_path", "dsv4_small_path"])
def test_same_graphs_and_bitwise_replays_as_torch_export_load(package, request):
    path = request.getfixturevalue(package)
    ours, theirs = load(path), load(path, graph_loader=TORCH)
    compared = covering_passes(ours)
    # The other passes hold no node kind the compared ones lack, so torch does not load them: they
    # replay our graphs on both sides, there to fill the caches the compared passes read.
    for name in set(theirs.passes) - compared:
        theirs.passes[name].graph.loader = DIRECT
    for name in compared:
        assert_same_replay(ours.passes[name].graph.replay, theirs.passes[name].program, name)
    # Every pass and rows bucket on the same random inputs: outputs, staging and caches byte for byte
    # (ours replays the replay graphs: no program of it has been read).
    checks = verify_packages(ours, theirs, seed=3)
    assert not any(info.graph._program for info in ours.passes.values())
    assert {c.pass_name for c in checks} == set(ours.passes)
    assert all(c.replays for c in checks)
    assert [d for c in checks for d in c.differences] == []
    # Described values and all, read now from the archive (one load of the package serves both).
    for name in compared:
        assert_same_program(ours.passes[name].program, theirs.passes[name].program, name)


def _deserialised(package) -> set[str]:
    return {name for name, info in package.passes.items() if info.graph.deserialised}


def test_load_deserialises_nothing_and_a_session_only_its_passes(fused_path):
    package = load(fused_path)
    assert _deserialised(package) == set()
    used = passes_used(package.passes, speculative=False, drafter=None)
    assert used == ("prefill", "decode")
    session = package.session(slots=1, passes=used)
    assert set(session.buckets) == _deserialised(package) == {"prefill", "decode"}
    engine = Engine(session, speculative=False)
    engine.submit([Request([1, 2, 3, 4], max_new_tokens=2)])  # a token from each pass: prefill, then decode
    engine.run()
    assert engine.finished and len(engine.finished[0].tokens) == 2
    drafter = lambda rows: []  # noqa: E731  (never called: nothing is submitted)
    Engine(package.session(slots=1, passes=passes_used(package.passes, drafter=drafter)), drafter=drafter)
    assert _deserialised(package) == {"prefill", "decode", "verify", "commit"}  # no draft pass
    with pytest.raises(ValueError, match="no draft pass"):
        Engine(session.package.session(slots=1, passes=("prefill", "verify", "commit")))
    with pytest.raises(ValueError, match="expected pass names"):
        package.session(passes=("prefill", "nonesuch"))


def test_inspect_summary_deserialises_no_graph(fused_path, monkeypatch):
    def refuse(self):
        raise AssertionError(f"{self.file} was deserialised")

    monkeypatch.setattr(PassGraph, "_deserialise", refuse)
    result = CliRunner().invoke(main, ["inspect", str(fused_path)])
    assert result.exit_code == 0, result.output
    assert "abi" in result.output


FIRST_TOKEN = """
import sys
import torch
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine, passes_used
package = load(sys.argv[1])
engine = Engine(package.session(slots=1, passes=passes_used(package.passes)))
engine.submit([[1, 2, 3, 4]])
engine.step()
assert engine.finished or engine.active, "no request ran"
heavy = sorted(m for m in ("torch._dynamo", "torch._export.serde.serialize", "sympy", "networkx") if m in sys.modules)
print("heavy:", ",".join(heavy))
"""


def test_a_session_to_its_first_token_imports_no_deserialiser_dynamo_sympy_or_networkx(fused_path):
    """What a replay needs is built without torch's deserialiser (which imports torch._dynamo)
    and without described values (a ShapeEnv imports torch._dynamo too, and sympy); the pass
    kit (networkx) is imported only to compile."""
    done = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(fused_path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "heavy: \n" in done.stdout, done.stdout


def test_a_program_read_after_the_replay_is_the_full_program(fused_path):
    package = load(fused_path)
    graph = package.passes["commit"].graph
    replay = graph.replay
    assert graph.deserialised and not any("val" in n.meta for n in replay.graph_module.graph.nodes)
    assert graph._document is None  # the parsed JSON is not kept beside the replay graph
    assert graph.collective_call() is None  # read from the replay graph now
    program = graph.program  # described values and all, from the archive, checked again
    assert all("val" in n.meta for n in program.graph.nodes if n.op in ("placeholder", "output"))
    assert graph.replay is program  # once read, the program is what replays

"""The torch releases a package loads and replays on (runtime/package/torch_versions.py): under
torch 2.11's serialiser schema, refusals of a package or a running torch outside the range,
graph schema versions, and the export floor. No package is exported here: the shipped one is
loaded, copied by hard links and read."""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from torch._export.serde import schema
from torch.torch_version import TorchVersion

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.pipeline.export import ExportError, export_package
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package import graph_enums, graph_loader
from b12x_toolchain.runtime.package.graph_archive import check_archive
from b12x_toolchain.runtime.package.manifest import digest
from b12x_toolchain.runtime.package.torch_versions import RANGE, check_package_torch, release
from b12x_toolchain.runtime.serving.speculative import Decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NOT_IN_2_11 = ("FLOAT8E8M0FNU", "UINT32", "UINT64")  # scalar types torch 2.11's serialiser lacks
PROMPT = "def f(x):\n    return x\n"


def _reload_graph_modules() -> None:
    # graph_loader imports graph_enums; both are imported again, as a process on that torch would.
    importlib.reload(graph_enums)
    importlib.reload(graph_loader)


@contextlib.contextmanager
def torch_2_11(monkeypatch):
    """torch 2.11 as the runtime sees it: its version, its schema's ScalarType (without the three
    names) and an older schema minor, the graph modules imported under them; restored after."""
    kept = {m.name: m.value for m in schema.ScalarType if m.name not in NOT_IN_2_11}
    monkeypatch.setattr(schema, "ScalarType", enum.IntEnum("ScalarType", kept))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", (schema.SCHEMA_VERSION[0], schema.SCHEMA_VERSION[1] - 1))
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    try:
        _reload_graph_modules()
        yield
    finally:
        monkeypatch.undo()
        _reload_graph_modules()


def _prefill_and_verify(path) -> torch.Tensor:
    """The verify logits after a prefill of PROMPT, each pass's graph built in this call."""
    package = load(path)
    session = package.session(slots=1)
    prompt = package.tokenizer.encode(PROMPT)
    Decoder(session).prefill(0, prompt[:-1])
    width, noise = package.passes["verify"].width, package.manifest.model.noise_token_id
    return session.replay("verify", token_ids=[[prompt[-1]] + [noise] * (width - 1)], slot_ids=[0],
                          positions=[len(prompt) - 1])["logits"]


def _with_manifest(path, tmp_path, edit):
    """A copy of the package (files hard-linked) whose manifest went through `edit`, signed again."""
    copy = shutil.copytree(path, tmp_path / "copy.b12x", copy_function=os.link)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    manifest["manifest_sha256"] = digest(manifest)
    (copy / "manifest.json").unlink()  # a new file: writing through the link would edit the original
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


# -- torch 2.11's schema ------------------------------------------------------------------------


def test_the_shipped_package_replays_under_torch_2_11s_schema(shipped_path, monkeypatch):
    expected = _prefill_and_verify(shipped_path)
    with torch_2_11(monkeypatch):
        assert not any(hasattr(schema.ScalarType, name) for name in NOT_IN_2_11)
        logits = _prefill_and_verify(shipped_path)
    assert torch.equal(logits, expected)


def test_the_enum_tables_are_torchs_for_every_name_this_torch_has():
    from torch._export.serde import serialize  # imports torch._dynamo: here only, not in the runtime

    tables = [(schema.ScalarType, graph_enums.DTYPES, serialize._SERIALIZE_TO_TORCH_DTYPE),
              (schema.Layout, graph_enums.LAYOUTS, serialize._SERIALIZE_TO_TORCH_LAYOUT),
              (schema.MemoryFormat, graph_enums.MEMORY_FORMATS, serialize._SERIALIZE_TO_TORCH_MEMORY_FORMAT)]
    for enum_type, ours, torchs in tables:
        named = {m for m in enum_type if m.value != 0}  # 0 is Unknown: no dtype, layout or format
        assert {m.value: ours[m.value] for m in named} == {m.value: torchs[m] for m in named}, enum_type
    assert (graph_enums.POSITIONAL, graph_enums.KEYWORD) == (schema.ArgumentKind.POSITIONAL,
                                                             schema.ArgumentKind.KEYWORD)


@pytest.mark.parametrize("value", [0, 14, 99, True, "7"])
def test_an_unknown_enum_value_is_refused_by_value(value):
    with pytest.raises(PackageError, match=rf"scalar type {value!r} is not one of torch's serialised values"):
        graph_enums.dtype(value)


# -- the torch a package records, and the running torch -----------------------------------------


@pytest.mark.parametrize("version, expected", [("2.13.0+cpu", (2, 13)), ("2.11.0+cu130", (2, 11)),
                                               ("2.15.0.dev20260101", (2, 15)), ("2.16.0a0+git1234", (2, 16)),
                                               ("10.2", (10, 2)), ("2.110.1", (2, 110))])
def test_a_version_string_reads_as_its_release(version, expected):
    assert release(version) == expected


@pytest.mark.parametrize("version", ["", "2", "v2.13", "two.13", "2.x", None, 213])
def test_a_malformed_version_is_refused(version):
    with pytest.raises(PackageError, match="is not of the form MAJOR.MINOR"):
        release(version)


@pytest.mark.parametrize("recorded", ["2.11.0+cu130", "2.13.0+cpu", "2.15.0.dev20260101", "2.15.3"])
def test_a_package_of_a_supported_torch_passes(recorded):
    check_package_torch(recorded)


@pytest.mark.parametrize("recorded", ["2.10.0", "2.16.0"])
def test_a_package_of_another_torch_is_refused_at_load(shipped_path, tmp_path, recorded):
    copy = _with_manifest(shipped_path, tmp_path, lambda m: m["versions"].update(torch=recorded))
    with pytest.raises(PackageError) as refused:
        load(copy)
    message = str(refused.value)
    assert f"versions.torch {recorded} is outside" in message
    assert RANGE in message and "torch >= 2.11, < 2.16" in message and str(torch.__version__) in message


def test_a_package_that_records_no_torch_or_a_malformed_one_is_refused(shipped_path, tmp_path):
    copy = _with_manifest(shipped_path, tmp_path, lambda m: m["versions"].pop("torch"))
    with pytest.raises(PackageError, match=rf"versions.torch is missing.*{RANGE}"):
        load(copy)
    with pytest.raises(PackageError, match=r"versions.torch: torch version 'nightly' is not of the form"):
        check_package_torch("nightly")


@pytest.mark.parametrize("running", ["2.10.1", "2.16.0", "3.0.0"])
def test_a_running_torch_outside_the_range_is_refused_at_load(shipped_path, monkeypatch, running):
    recorded = json.loads((shipped_path / "manifest.json").read_text())["versions"]["torch"]
    monkeypatch.setattr(torch, "__version__", TorchVersion(running))
    with pytest.raises(PackageError) as refused:
        load(shipped_path)
    assert str(refused.value) == (f"this is torch {running}, which this runtime does not support ({RANGE}); "
                                  f"the package was exported with torch {recorded}")


# -- graph schema versions --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verify_document(shipped_path):
    """The shipped package's verify graph document, as load checks it."""
    name = json.loads((shipped_path / "manifest.json").read_text())["passes"]["verify"]["graph"]
    return check_archive(name, (shipped_path / name).read_bytes())


def test_the_package_is_written_in_the_schema_major_the_builder_reads(verify_document):
    assert verify_document["schema_version"]["major"] == graph_loader.GRAPH_SCHEMA_MAJOR == schema.SCHEMA_VERSION[0]


@pytest.mark.parametrize("minor", [1, 19, 21, 99])
def test_an_older_or_newer_schema_minor_is_read(verify_document, minor):
    major = graph_loader.GRAPH_SCHEMA_MAJOR
    graph_loader._check_schema_version({"major": major, "minor": minor})
    if minor == 99:  # a whole build once: nothing after the check depends on the minor
        built = graph_loader.replay_graph({**verify_document, "schema_version": {"major": major, "minor": minor}})
        assert len(built.graph_module.graph.nodes) > 0


@pytest.mark.parametrize("major, minor", [(7, 20), (9, 0), (0, 0)])
def test_another_schema_major_is_refused_naming_both_versions(verify_document, major, minor):
    document = {**verify_document, "schema_version": {"major": major, "minor": minor}}
    with pytest.raises(PackageError, match=rf"graph schema version {major}\.{minor} is not one this runtime reads "
                                           rf"\({graph_loader.GRAPH_SCHEMA_MAJOR}\.x, any minor\)"):
        graph_loader.replay_graph(document)


@pytest.mark.parametrize("version", [None, "8.20", {"major": 8}, {"major": "8", "minor": 20}])
def test_a_malformed_schema_version_is_refused(verify_document, version):
    with pytest.raises(PackageError, match="graph schema_version .*expected"):
        graph_loader.replay_graph({**verify_document, "schema_version": version})


# -- the export floor ------------------------------------------------------------------------------


@pytest.mark.parametrize("running, message", [
    ("2.11.0", "export needs torch >= 2.13; this is torch 2.11.0"),
    ("2.12.1+cu128", "export needs torch >= 2.13; this is torch 2.12.1+cu128"),
    ("2.16.0", f"export needs a torch whose packages the runtime loads ({RANGE}); this is torch 2.16.0"),
])
def test_export_refuses_a_torch_it_cannot_export_with(tiny_recipe, tmp_path, monkeypatch, running, message):
    monkeypatch.setattr(torch, "__version__", TorchVersion(running))
    with pytest.raises(ExportError) as refused:
        export_package(tiny_recipe, tmp_path)
    assert str(refused.value) == message
    assert not any(tmp_path.iterdir())  # refused before anything is written
    result = CliRunner().invoke(main, ["export", "--recipe", "dsv41-tiny", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.stderr == f"error: {message}\n" and "Traceback" not in result.output

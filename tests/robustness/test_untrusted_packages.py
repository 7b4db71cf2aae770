"""Packages edited by someone else: every refusal is a PackageError before torch deserialises.

Each tampered copy is made consistent the way a tamperer would: the edited file is
re-hashed into the manifest and the manifest's own digest recomputed, so only the new
checks stand between the edit and `torch.export.load`. Edits come from generators over
node targets, argument kinds, symbolic expressions and archive entries, plus a hypothesis
fuzzer over graph-JSON mutations; a planted payload would create a marker file, which
must never exist.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import socket
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest
from b12x_toolchain.runtime import PackageError, load
from b12x_toolchain.runtime.package.pass_graph import load_graph

GRAPH = "graphs/commit.pt2"  # the smallest graph: quickest to rewrite and to load
MODEL = "archive/models/model.json"
MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / "b12x-tamper-marker"
PAYLOAD = f"__import__('os').system('touch {MARKER}')"


@pytest.fixture(autouse=True)
def no_marker():
    MARKER.unlink(missing_ok=True)
    yield
    assert not MARKER.exists(), "a planted payload ran"


def archive_entries(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def archive_bytes(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, body in entries.items():
            archive.writestr(name, body)
    return out.getvalue()


def resign(package: Path, edit_manifest=None) -> None:
    """Re-hash every file into the manifest and recompute its digest, as a tamperer would."""
    manifest = json.loads((package / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = hashlib.sha256((package / name).read_bytes()).hexdigest()
    if edit_manifest is not None:
        edit_manifest(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (package / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))


def with_graph(small_path: Path, tmp_path: Path, edit) -> Path:
    """A re-signed copy of the small package whose commit graph JSON went through `edit`."""
    copy_path = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    entries = archive_entries((copy_path / GRAPH).read_bytes())
    document = json.loads(entries[MODEL])
    edit(document)
    entries[MODEL] = json.dumps(document).encode()
    (copy_path / GRAPH).write_bytes(archive_bytes(entries))
    resign(copy_path)
    return copy_path


def first_node(document: dict) -> dict:
    return document["graph_module"]["graph"]["nodes"][0]


# -- node targets and other strings torch would resolve ----------------------------------

TARGETS = [
    "torch.ops.profiler._record_function_enter.default",  # another namespace's op
    "torch.ops.nosuchns.op.default",  # an unregistered namespace
    "builtins.exec",
    "torch.serialization.os.system",  # torch would resolve this to os.system
    "torch.ops.aten.__class__.__init__",  # from the op namespace into plain Python
    "torch.ops.b12x_toolchain.window_magic.default",  # our namespace, not our op set
    "torch.ops.b12x.window_commit.default",  # op set 1's namespace, which FlashInfer's b12x also uses
    "math.sqrt",
    "_operator.add",
    "#custom_extension",
    PAYLOAD,
]


@pytest.mark.parametrize("target", TARGETS)
def test_a_node_target_outside_the_op_set_is_refused_before_deserialising(small_path, tmp_path, target):
    package = with_graph(small_path, tmp_path, lambda doc: first_node(doc).update(target=target))
    with pytest.raises(PackageError, match=rf"{GRAPH}: node '\w+': target .* is outside op set v7"):
        load(package)


def _set_first_arg(kind: str, value):
    def edit(document):
        node = next(n for n in document["graph_module"]["graph"]["nodes"] if n["inputs"])
        node["inputs"][0]["arg"] = {kind: value}
    return edit


def _set_expr(text: str):
    return _set_first_arg("as_sym_int", {"as_expr": {"expr_str": text, "hint": {"as_int": 1}}})


STRINGS = {  # other strings the deserialiser turns into objects, and the check that names them
    "nested graph argument": (_set_first_arg("as_graph", {"name": "g", "graph": {}}), "argument kind 'as_graph'"),
    "operator argument": (_set_first_arg("as_operator", "torch.serialization.os.system"), "argument kind 'as_operator'"),
    "custom object argument": (_set_first_arg("as_custom_obj", {"name": "x", "class_fqn": "os.system"}),
                               "argument kind 'as_custom_obj'"),
    "sympy payload": (_set_expr(PAYLOAD), "symbolic expression"),
    "sympy call": (_set_expr("Symbol('s0', positive=True, integer=True).__class__"), "symbolic expression"),
    "guard payload": (lambda doc: doc["guards_code"].append(PAYLOAD), "guards_code"),
    "range key": (lambda doc: doc["range_constraints"].update({PAYLOAD: {"min_val": 0, "max_val": 1}}),
                  "range_constraints"),
    "node metadata": (lambda doc: first_node(doc)["metadata"].update(custom={"x": 1}), "metadata 'custom'"),
    "module metadata": (lambda doc: doc["graph_module"]["metadata"].update(x="y"), "graph_module.metadata"),
    "custom objects": (lambda doc: doc["graph_module"]["graph"]["custom_obj_values"].update(x={}), "custom objects"),
    "verifier": (lambda doc: doc.update(verifiers=["os.system"]), "verifiers"),
    "unknown top-level key": (lambda doc: doc.update(extension="x"), "expected an object with keys among"),
}


@pytest.mark.parametrize("case", sorted(STRINGS))
def test_strings_torch_would_resolve_are_held_to_the_allow_list(small_path, tmp_path, case):
    edit, named = STRINGS[case]
    with pytest.raises(PackageError, match=f"^{GRAPH}: .*" + named.replace("(", r"\(")):
        load(with_graph(small_path, tmp_path, edit))


def test_the_exact_graphs_the_exporter_writes_pass_the_check(small_path):
    assert load(small_path).passes["commit"].program is not None


# -- archive entries -------------------------------------------------------------------

ENTRIES = {
    "archive/data/constants/payload.pkl": b"\x80\x04cos\nsystem\n.",
    "archive/extra.py": PAYLOAD.encode(),
    "archive/data/sample_inputs/model.pt": b"\x80\x04N.",
    "archive/data/weights/model_weights_config.json": b'{"config": {"w": {"path_name": "payload.pkl"}}}',
    "archive/data/constants/model_constants_config.json": b'{"config": {}, "config": {"c": 1}}',
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_an_archive_entry_that_is_not_plain_graph_data_is_refused(small_path, tmp_path, entry):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    entries = archive_entries((package / GRAPH).read_bytes())
    entries[entry] = ENTRIES[entry]
    (package / GRAPH).write_bytes(archive_bytes(entries))
    resign(package)
    with pytest.raises(PackageError, match=f"^{GRAPH}: "):
        load(package)


# -- strict JSON -----------------------------------------------------------------------

def _duplicate(text: str, key: str, value: str) -> str:
    """The manifest text with `"key": value` placed first in its object: top level, or `files`."""
    where = text.index('"files": {') + len('"files": {') if key.startswith("graphs/") else 1
    return text[:where] + f'"{key}": {value}, ' + text[where:]


@pytest.mark.parametrize("key, value", [("format_version", '"9.9"'), ("name", '"other"'),
                                        (GRAPH, '"0000"')])
def test_a_manifest_with_a_duplicated_key_is_refused_naming_it(small_path, tmp_path, key, value):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    resign(package)  # the manifest as json.dumps writes it, so the edit below lands where meant
    text = (package / "manifest.json").read_text()
    (package / "manifest.json").write_text(_duplicate(text, key, value))
    with pytest.raises(PackageError, match=f"manifest.json: key '{key}' appears twice"):
        load(package)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_manifest_with_a_non_json_number_is_refused(small_path, tmp_path, literal):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    resign(package, lambda manifest: manifest.update(note=0.5))
    text = (package / "manifest.json").read_text().replace('"note": 0.5', f'"note": {literal}')
    (package / "manifest.json").write_text(text)
    with pytest.raises(PackageError, match=f"manifest.json: {literal} is not a JSON number"):
        load(package)


def test_a_weights_header_with_a_duplicated_tensor_name_is_refused(small_path, tmp_path):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    data = (package / "weights.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    name = next(key for key in header if key != "__metadata__")
    text = "{" + json.dumps(name) + ":" + json.dumps(header[name]) + "," + data[8 : 8 + size].decode()[1:]
    text += " " * (-len(text) % 8)
    (package / "weights.safetensors").write_bytes(len(text).to_bytes(8, "little") + text.encode() + data[8 + size :])
    resign(package)
    with pytest.raises(PackageError, match=f"weights.safetensors: header: key '{name}' appears twice"):
        load(package)


# -- plain files and directories only --------------------------------------------------

def _fifo(path: Path, outside: Path):
    os.mkfifo(path)


def _socket(path: Path, outside: Path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()


def _link_out(path: Path, outside: Path):
    path.symlink_to(outside)


def _link_in(path: Path, outside: Path):
    path.symlink_to(path.parent / "commit.pt2")


ODD_ENTRIES = {"a FIFO": _fifo, "a socket": _socket, "a symbolic link": _link_out}


@pytest.mark.parametrize("kind", sorted(ODD_ENTRIES))
def test_a_graphs_entry_that_is_not_a_plain_file_is_refused_by_name(small_path, tmp_path, kind):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    outside = tmp_path / "outside.pt2"
    outside.write_bytes(b"outside")
    ODD_ENTRIES[kind](package / "graphs" / "extra.pt2", outside)
    with pytest.raises(PackageError, match=f"^graphs/extra.pt2: is {kind}; packages hold plain files"):
        load(package)


@pytest.mark.parametrize("make_link", [_link_in, _link_out], ids=["inside", "outside"])
def test_a_listed_file_replaced_by_a_link_is_refused_whichever_way_it_points(small_path, tmp_path, make_link):
    package = shutil.copytree(small_path, tmp_path / "tampered.b12x")
    shutil.copy(package / GRAPH, tmp_path / "outside.pt2")
    (package / "graphs" / "draft.pt2").unlink()
    make_link(package / "graphs" / "draft.pt2", tmp_path / "outside.pt2")
    with pytest.raises(PackageError, match="^graphs/draft.pt2: is a symbolic link"):
        load(package)


def test_the_package_root_itself_may_be_a_link(small_path, tmp_path):
    link = tmp_path / "current.b12x"
    link.symlink_to(small_path)
    assert load(link).path == link


# -- the command line ------------------------------------------------------------------

def _commands(package: Path, good: Path) -> dict[str, list[str]]:
    return {
        "inspect": ["inspect", str(package)],
        "inspect --graph": ["inspect", str(package), "--graph", "commit"],
        "run": ["run", str(package), "--prompt-ids", "1,2"],
        "verify": ["verify", str(good), str(package)],
        "abi diff": ["abi", "diff", str(good), str(package)],
        "export --check": ["export", "--check", str(package)],
    }


@pytest.mark.parametrize("command", sorted(_commands(Path("p"), Path("g"))))
def test_every_command_turns_a_tampered_package_into_one_error_line(small_path, tmp_path, command):
    package = with_graph(small_path, tmp_path, lambda doc: first_node(doc).update(target="builtins.exec"))
    if command == "abi diff":  # reads manifests only: tamper the manifest instead
        (package / "manifest.json").write_text(_duplicate((package / "manifest.json").read_text(), "name", '"x"'))
    result = CliRunner().invoke(main, _commands(package, small_path)[command])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.startswith("error: ")], result.output


# -- fuzzing ---------------------------------------------------------------------------

KINDS = ["as_tensor", "as_int", "as_graph", "as_operator", "as_custom_obj", "as_string", "as_expr", "as_sym_int"]
TEXTS = st.sampled_from(TARGETS + ["torch.ops.aten.add.Tensor", "torch.ops.b12x_toolchain.window_commit.default",
                                   "_operator.getitem", "", "torch"]) | st.text(max_size=40)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TEXTS,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KINDS), inner,
                                                                                     max_size=2), max_leaves=6)


@st.composite
def mutations(draw):
    """(what, node index, value): replace a node's target, one argument, or wrap it deeper."""
    return draw(st.sampled_from(["target", "argument", "nest", "expr"])), draw(st.integers(0, 200)), draw(VALUES)


@pytest.fixture(scope="module")
def commit_graph(small_path):
    return (small_path / GRAPH).read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_graph_json_mutations_give_a_package_error_or_a_clean_load(commit_graph, mutation):
    what, index, value = mutation
    entries = archive_entries(commit_graph)
    document = json.loads(entries[MODEL])
    nodes = document["graph_module"]["graph"]["nodes"]
    node = nodes[index % len(nodes)]
    if what == "target":
        node["target"] = value
    elif what == "argument" and node["inputs"]:
        node["inputs"][0]["arg"] = value
    elif what == "nest" and node["inputs"]:
        node["inputs"][0]["arg"] = {"as_tensors": [copy.deepcopy(node["inputs"][0]["arg"]), value]}
    elif what == "expr" and node["inputs"]:
        node["inputs"][0]["arg"] = {"as_sym_int": {"as_expr": {"expr_str": value}}}
    entries[MODEL] = json.dumps(document).encode()
    try:
        load_graph(GRAPH, archive_bytes(entries))
    except PackageError:
        pass

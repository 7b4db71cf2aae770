"""Check a torch.export archive before it is deserialised.

b12x graphs carry no weights, constants or sample inputs (weights are graph inputs read
from safetensors), so the only entries allowed are the JSON graph and small metadata
files. Anything else — in particular a pickle that torch.load would unpickle — is refused.
"""

from __future__ import annotations

import io
import zipfile

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.ops.namespace import NAMESPACE, OPSET_VERSION
from b12x_toolchain.runtime.package.graph_json import check_graph_json
from b12x_toolchain.runtime.parallel import group as collectives
from b12x_toolchain.runtime.strict_json import load_document

ARCHIVE_LIMIT = 1 << 30
EMPTY_CONFIG = {"config": {}}
ALLOWED = {
    "archive/models/model.json": "json",
    "archive/data/weights/model_weights_config.json": "empty-config",
    "archive/data/constants/model_constants_config.json": "empty-config",
    "archive/data/sample_inputs/model.pt": "empty",
    "archive/archive_format": "text",
    "archive/archive_version": "text",
    "archive/.data/version": "text",
    "archive/byteorder": "text",
    "archive/.data/serialization_id": "text",
}


def check_archive(name: str, data: bytes) -> dict:
    """The checked graph document of archive `name` (its models/model.json), or a PackageError."""

    def refuse(reason: str):
        raise PackageError(f"{name}: {reason}")

    if len(data) > ARCHIVE_LIMIT:
        refuse(f"{len(data)} bytes exceeds the {ARCHIVE_LIMIT} byte limit for a graph")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except zipfile.BadZipFile as exc:
        refuse(f"not a torch.export archive ({exc})")
    names, document = [e.filename for e in entries], None
    if len(set(names)) != len(names):
        refuse("archive has duplicate entries")
    for entry in entries:
        kind = ALLOWED.get(entry.filename)
        if kind is None:
            refuse(f"unexpected archive entry {entry.filename!r}; graphs carry no weights, constants or pickles")
        if entry.file_size > ARCHIVE_LIMIT:
            refuse(f"archive entry {entry.filename!r} is too large")
        body = archive.read(entry)
        if kind == "empty" and body:
            refuse(f"archive entry {entry.filename!r} must be empty (no pickled sample inputs)")
        if kind == "json":  # the graph: every string torch would resolve is checked first
            document = check_graph_json(name, body)
        if kind == "empty-config" and load_document(body, f"{name}: {entry.filename}") != EMPTY_CONFIG:
            refuse(f"archive entry {entry.filename!r} declares weights or constants; expected none")
    if "archive/models/model.json" not in names:
        refuse("archive has no archive/models/model.json graph")
    return document


ALLOWED_NAMESPACES = ("aten", NAMESPACE)
ALLOWED_PYTHON = {"operator.getitem"}


def check_graph_ops(name: str, graph) -> None:
    """A graph may call aten ops, our op set, getitem and the fixed-shape functional collectives
    (runtime/parallel/group.py; the reader refuses them in a package without a parallel
    mapping): nothing that reaches files, processes or other libraries' ops."""
    from b12x_toolchain.runtime.ops.opset import OPS

    known = set(OPS.values())
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            raise PackageError(f"{name}: node {node.name} is a {node.op}; graphs may only call functions")
        target = node.target
        namespace = getattr(target, "namespace", None)
        if namespace == NAMESPACE and target in known:
            continue
        if namespace == "aten" or collectives.is_allowed(target):
            continue
        qualified = f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', '')}"
        if qualified.replace("_operator.", "operator.") in ALLOWED_PYTHON:
            continue
        raise PackageError(f"{name}: node {node.name} calls {target}, which is outside op set v{OPSET_VERSION} and aten")

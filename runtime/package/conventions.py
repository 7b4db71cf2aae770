"""Each pass of a manifest, typed: its graph file, what a server drives it by and its calling
convention with every cache, staging and row input's info attached (contract.py, abi.py).

`read_passes` turns the manifest's `passes` and `buffers` entries into PassEntry objects,
strictly, and `shared_buffers` builds the one table of the package's cache and staging
buffers, refusing two passes that bind one buffer name with different specs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.contract import (
    BufferInfo,
    PassFields,
    buffer_table,
    check_row_inputs,
    described,
    pass_fields,
    row_input_info,
)


@dataclass(frozen=True)
class PassEntry:
    """A pass as the manifest declares it, before its graph is deserialised."""

    name: str
    graph: str  # the graph file (of rank 0 in a parallel package)
    rows_buckets: tuple[int, ...]
    width: int
    advances: str | None  # the input whose counts move the committed length; None: staging only
    reads_staging_of: str | None  # the pass whose staging this one makes persistent
    inputs: tuple[BufferSpec, ...]  # cache, staging and row inputs carry their info (kind...)
    outputs: tuple[BufferSpec, ...]

    @property
    def row_inputs(self) -> dict[str, str]:
        """Input name -> kind of every per-row input."""
        return {s.name: s.info.kind for s in self.inputs if s.role == "input"}

    def to_json(self) -> dict:
        return {
            "graph": self.graph,
            "rows_buckets": list(self.rows_buckets),
            "width": self.width,
            "advances": self.advances,
            "reads_staging_of": self.reads_staging_of,
            "row_inputs": self.row_inputs,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
        }


def read_passes(passes_json: dict, buffers_json) -> tuple[dict[str, PassEntry], dict[str, BufferInfo]]:
    """Every pass's entry and the `buffers` table, checked strictly (contract.py) before any file is used."""
    fields = {name: pass_fields(name, entry, set(passes_json)) for name, entry in passes_json.items()}
    buffers = buffer_table(buffers_json, _described_names(passes_json))
    out = {}
    for name, entry in passes_json.items():
        inputs, outputs = _specs(name, entry, fields[name], buffers)
        check_row_inputs(name, fields[name], inputs)
        f = fields[name]
        out[name] = PassEntry(name, entry["graph"], f.rows_buckets, f.width, f.advances, f.reads_staging_of,
                              tuple(inputs), tuple(outputs))
    return out, buffers


def shared_buffers(passes: dict[str, PassEntry]) -> dict[str, BufferSpec]:
    """Every cache and staging buffer any pass binds, by name, with its spec and info. Passes
    share a buffer by name, so they must bind it alike: the session allocates it once."""
    specs, bound_by = {}, {}
    for entry in passes.values():
        for spec in entry.inputs:
            if not described(spec.role):
                continue
            first = specs.setdefault(spec.name, spec)
            if first != spec:
                raise PackageError(f"manifest.json: buffer {spec.name}: passes {bound_by[spec.name]} and "
                                   f"{entry.name} bind it differently ({_describe(first)} and {_describe(spec)})")
            bound_by.setdefault(spec.name, entry.name)
    return {name: specs[name] for name in sorted(specs)}


def _describe(spec: BufferSpec) -> str:
    return f"{spec.role} {spec.dtype} {list(spec.shape)}"


def _specs(name: str, entry: dict, fields: PassFields, buffers: dict[str, BufferInfo]):
    """The calling convention with every cache, staging and row input's info attached."""
    try:
        inputs = [BufferSpec.from_json(s) for s in entry["inputs"]]
        outputs = [BufferSpec.from_json(s) for s in entry["outputs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PackageError(f"manifest.json: passes.{name}: bad calling convention ({exc})") from None
    return [_with_info(name, spec, fields, buffers) for spec in inputs], outputs


def _with_info(pass_name: str, spec: BufferSpec, fields: PassFields, buffers: dict[str, BufferInfo]) -> BufferSpec:
    if described(spec.role):
        info = buffers[spec.name]  # buffer_table: every described name has an entry
    elif spec.role == "input":
        if spec.name not in fields.row_inputs:
            raise PackageError(f"manifest.json: passes.{pass_name}.row_inputs: input {spec.name} has no kind")
        info = row_input_info(pass_name, spec.name, fields.row_inputs[spec.name])
    else:
        return spec
    try:
        info.check(spec)
    except ValueError as exc:
        raise PackageError(f"manifest.json: {exc}") from None
    return dataclasses.replace(spec, info=info)


def _described_names(passes_json: dict) -> set[str]:
    return {s.get("name") for e in passes_json.values() for s in (e.get("inputs") or [])
            if isinstance(s, dict) and described(s.get("role"))}

"""What a buffer is and what a pass does, as manifest data (format 3), read strictly.

The calling convention (abi.py) says how a buffer is bound: name, role, dtype, shape.
This says what it holds, so nothing downstream parses a name or switches on a pass name:

* `buffers` (top level, by name, every cache and staging buffer): kind (kinds.py), the
  target layer or draft stage it belongs to, the row format and decoded row width
  (dims), positions per row (ratio: 1 for rings, the compress ratio for entries), rows
  per slot for per-slot caches, the page spec of paged caches (CachePages: enough for an
  engine to allocate pages for a package it has never seen) and of paged staging.
* per pass: `width`, `advances` (the input whose per-row count moves the committed
  length, or null: the pass writes only staging), `reads_staging_of` (the pass whose
  staging this one makes persistent; it must run on the same rows just before) and
  `row_inputs` (the kind of every per-row input).

Every entry is checked against the buffer's calling convention, and a missing field, a
field of the wrong type or an unknown kind is refused naming the buffer and the field.
Both enter the ABI fingerprint: they are what a server binds by.
"""

from __future__ import annotations

from dataclasses import dataclass

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.formats.codecs import FORMATS, get_format, renamed
from b12x_toolchain.runtime.formats.layout import LAYOUTS
from b12x_toolchain.runtime.package.kinds import BUFFER_ROLES, ENCODED_ROWS, KINDS, kinds_for

BUFFER_FIELDS = ("kind", "layer", "stage", "format", "dims", "ratio", "rows_per_slot", "page")
PASS_FIELDS = ("graph", "rows_buckets", "width", "advances", "reads_staging_of", "row_inputs", "inputs", "outputs")


def _key_difference(data: dict, expected) -> str:
    missing, unknown = sorted(set(expected) - set(data)), sorted(set(data) - set(expected))
    return "; ".join(([f"fields missing {missing}"] if missing else []) + ([f"unknown fields {unknown}"] if unknown else []))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PageSpec:
    layout: str  # NHD or HND (runtime/formats/layout.py)
    page_size: int  # tokens per page

    def to_json(self) -> dict:
        return {"layout": self.layout, "page_size": self.page_size}


PAGE_LAYOUT = "entry_major"  # record e of a page at bytes [e * record_bytes, (e + 1) * record_bytes)
CACHE_PAGE_FIELDS = ("pool", "tokens_per_entry", "tokens_per_page", "entries_per_page", "record_bytes",
                     "page_bytes", "alignment", "pages_per_slot", "layout")


@dataclass(frozen=True)
class CachePages:
    """The page spec of a paged cache [pool, page_bytes], modelled on a serving engine's KV spec.

    Page p of a row's block table holds that row's entries for tokens
    [p * tokens_per_page, (p + 1) * tokens_per_page): entries_per_page records of
    record_bytes, entry-major. page_bytes is a multiple of alignment (one record), and a
    row's block table has pages_per_slot columns (ceil(max_seq_len / tokens_per_page)).
    Every cache of one pool shares its block table and page ids.
    """

    pool: str
    tokens_per_entry: int
    tokens_per_page: int
    entries_per_page: int
    record_bytes: int
    page_bytes: int
    alignment: int
    pages_per_slot: int
    layout: str = PAGE_LAYOUT

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in CACHE_PAGE_FIELDS}


@dataclass(frozen=True)
class BufferInfo:
    kind: str
    layer: int | None = None
    stage: int | None = None
    format: str | None = None
    dims: int | None = None
    ratio: int | None = None
    rows_per_slot: int | None = None
    page: PageSpec | CachePages | None = None

    def to_json(self) -> dict:
        out = {f: getattr(self, f) for f in BUFFER_FIELDS}
        out["page"] = self.page.to_json() if self.page is not None else None
        return out

    @classmethod
    def from_json(cls, name: str, data) -> "BufferInfo":
        """Types only; `check` compares the values with the buffer's calling convention."""
        if not isinstance(data, dict):
            raise ValueError(f"buffer {name}: expected an object, got {type(data).__name__}")
        if set(data) != set(BUFFER_FIELDS):
            raise ValueError(f"buffer {name}: {_key_difference(data, BUFFER_FIELDS)}; expected {list(BUFFER_FIELDS)}")
        for field in ("kind", "format"):
            if data[field] is not None and not isinstance(data[field], str):
                raise ValueError(f"buffer {name}: field {field!r}: {data[field]!r} is not a string")
        for field in ("layer", "stage", "dims", "ratio", "rows_per_slot"):
            if data[field] is not None and not _count(data[field]):
                raise ValueError(f"buffer {name}: field {field!r}: {data[field]!r} is not an integer or null")
        if data["kind"] not in KINDS:  # `check` refuses it, naming the kinds of the buffer's role
            return cls(**{**data, "page": None})
        paged = KINDS[data["kind"]].pool is not None
        return cls(**{**data, "page": (_cache_pages if paged else _page)(name, data["page"])})

    # -- consistency with the calling convention ----------------------------------------

    def check(self, spec) -> None:
        """Raise ValueError, naming the buffer and field, unless this describes `spec`."""
        where = f"buffer {spec.name}"
        kind = KINDS.get(self.kind)
        if kind is None or kind.role != spec.role:
            raise ValueError(f"{where}: field 'kind': {self.kind!r} is not a kind of {spec.role} buffer; "
                             f"expected one of {list(kinds_for(spec.role))}")
        for field in ("layer", "stage"):
            value, wanted = getattr(self, field), kind.owner == field
            if wanted and not (_count(value) and value >= 0):
                raise ValueError(f"{where}: field {field!r}: a {self.kind} buffer needs its {field} index, got {value!r}")
            if not wanted and value is not None:
                raise ValueError(f"{where}: field {field!r}: must be null for a {self.kind} buffer, got {value!r}")
        if kind.rows in ENCODED_ROWS:
            self._check_rows(where, spec, kind.rows)
        else:
            for field in ("format", "dims", "ratio", "rows_per_slot", "page"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{where}: field {field!r}: must be null for a {self.kind} buffer")
        if self.kind == "seq_len" and (spec.dtype != "int32" or tuple(spec.shape) != ("slots",)):
            raise ValueError(f"{where}: a seq_len buffer is int32 [slots], got {spec.dtype} {list(spec.shape)}")

    def _check_rows(self, where: str, spec, rows: str) -> None:
        if self.format not in FORMATS:
            hint = f" ({renamed(self.format)})" if renamed(self.format) else ""
            raise ValueError(f"{where}: field 'format': {self.format!r} is not one of {sorted(FORMATS)}{hint}")
        fmt = get_format(self.format)
        if not (_count(self.dims) and self.dims > 0 and self.dims % fmt.block == 0):
            raise ValueError(f"{where}: field 'dims': {self.dims!r} is not a positive multiple of {self.format}'s "
                             f"block of {fmt.block}")
        if not (_count(self.ratio) and self.ratio >= 1) or (rows == "ring" and self.ratio != 1):
            raise ValueError(f"{where}: field 'ratio': {self.ratio!r}; expected 1 for a ring, "
                             "the positions per row (at least 1) otherwise")
        if KINDS[self.kind].pool is not None:
            if spec.dtype != "uint8":
                raise ValueError(f"{where}: a paged cache is uint8, got {spec.dtype}")
            self._check_cache_pages(where, spec, fmt)
            return
        shape = tuple(spec.shape)
        if spec.dtype != "uint8" or not shape or shape[-1] != fmt.row_bytes(self.dims):
            raise ValueError(f"{where}: field 'dims': {self.dims} {self.format} values are uint8 rows of "
                             f"{fmt.row_bytes(self.dims)} bytes; the buffer is {spec.dtype} {list(shape)}")
        if spec.role == "cache":
            if len(shape) != 3 or shape[0] != "slots" or self.rows_per_slot != shape[1]:
                raise ValueError(f"{where}: field 'rows_per_slot': {self.rows_per_slot!r} does not match the "
                                 f"shape {list(shape)} ([slots, rows, bytes])")
        elif self.rows_per_slot is not None:
            raise ValueError(f"{where}: field 'rows_per_slot': must be null for staging (rows are per pass row)")
        if rows == "paged":
            self._check_pages(where, shape)
        elif self.page is not None:
            raise ValueError(f"{where}: field 'page': must be null for a {self.kind} buffer")
        elif spec.role == "staging" and (len(shape) != 3 or shape[0] != "rows"):
            raise ValueError(f"{where}: a {self.kind} buffer is [rows, positions, bytes], got {list(shape)}")

    def _check_cache_pages(self, where: str, spec, fmt) -> None:
        page, pool = self.page, KINDS[self.kind].pool
        if not isinstance(page, CachePages):
            raise ValueError(f"{where}: field 'page': a {self.kind} cache needs its page spec")
        if self.rows_per_slot is not None:
            raise ValueError(f"{where}: field 'rows_per_slot': must be null for a paged cache (see its page spec)")
        expected = {"pool": pool, "tokens_per_entry": self.ratio, "record_bytes": fmt.row_bytes(self.dims),
                    "tokens_per_page": page.entries_per_page * self.ratio, "alignment": page.record_bytes,
                    "page_bytes": page.entries_per_page * page.record_bytes, "layout": PAGE_LAYOUT}
        for field, value in expected.items():
            if getattr(page, field) != value:
                raise ValueError(f"{where}: field 'page': {field} is {getattr(page, field)!r}, expected {value!r}")
        if tuple(spec.shape) != (pool, page.page_bytes):
            raise ValueError(f"{where}: field 'page': a paged cache is [{pool}, {page.page_bytes}], "
                             f"got {list(spec.shape)}")

    def _check_pages(self, where: str, shape: tuple) -> None:
        if self.page is None:
            raise ValueError(f"{where}: field 'page': a {self.kind} buffer needs its page spec")
        head = (1, self.page.page_size) if self.page.layout == "HND" else (self.page.page_size, 1)
        if len(shape) != 5 or shape[0] != "rows" or tuple(shape[2:4]) != head:
            raise ValueError(f"{where}: field 'page': {self.page.to_json()} does not match the shape {list(shape)}")


def _cache_pages(name: str, data) -> CachePages:
    if not isinstance(data, dict) or set(data) != set(CACHE_PAGE_FIELDS):
        raise ValueError(f"buffer {name}: field 'page': expected an object with {list(CACHE_PAGE_FIELDS)}")
    for field in CACHE_PAGE_FIELDS:
        wanted_str = field in ("pool", "layout")
        if not (isinstance(data[field], str) if wanted_str else _count(data[field]) and data[field] > 0):
            raise ValueError(f"buffer {name}: field 'page': {field} {data[field]!r} is not "
                             f"{'a string' if wanted_str else 'a positive integer'}")
    return CachePages(**data)


def _page(name: str, data) -> PageSpec | None:
    if data is None:
        return None
    if not isinstance(data, dict) or set(data) != {"layout", "page_size"}:
        raise ValueError(f"buffer {name}: field 'page': expected null or an object with layout and page_size")
    if data["layout"] not in LAYOUTS or not (_count(data["page_size"]) and data["page_size"] > 0):
        raise ValueError(f"buffer {name}: field 'page': {data} needs a layout in {LAYOUTS} and a positive page_size")
    return PageSpec(data["layout"], data["page_size"])


# -- the manifest's tables ------------------------------------------------------------------


@dataclass(frozen=True)
class PassFields:
    """A pass entry's data besides its calling convention."""

    rows_buckets: tuple[int, ...]
    width: int
    advances: str | None
    reads_staging_of: str | None
    row_inputs: dict  # input name -> kind


def pass_fields(name: str, entry, pass_names) -> PassFields:
    where = f"manifest.json: passes.{name}"
    if not isinstance(entry, dict):
        raise PackageError(f"{where}: expected an object")
    if set(entry) != set(PASS_FIELDS):
        raise PackageError(f"{where}: {_key_difference(entry, PASS_FIELDS)}")
    buckets, width = entry["rows_buckets"], entry["width"]
    if not (isinstance(buckets, list) and buckets and all(_count(b) and b > 0 for b in buckets)):
        raise PackageError(f"{where}.rows_buckets: {buckets!r} is not a non-empty list of positive integers")
    if not (_count(width) and width > 0):
        raise PackageError(f"{where}.width: {width!r} is not a positive integer")
    for field in ("advances", "reads_staging_of"):
        if entry[field] is not None and not isinstance(entry[field], str):
            raise PackageError(f"{where}.{field}: {entry[field]!r} is neither a name nor null")
    staged_by = entry["reads_staging_of"]
    if staged_by is not None and (staged_by == name or staged_by not in pass_names):
        raise PackageError(f"{where}.reads_staging_of: {staged_by!r} is not another pass of this package")
    row_inputs = entry["row_inputs"]
    if not isinstance(row_inputs, dict) or not all(isinstance(k, str) for k in row_inputs.values()):
        raise PackageError(f"{where}.row_inputs: expected an object of input name -> kind")
    return PassFields(tuple(buckets), width, entry["advances"], staged_by, dict(row_inputs))


def check_row_inputs(name: str, fields: PassFields, inputs) -> None:
    """`inputs`: the pass's BufferSpecs (kinds attached). Every pass takes one slot_ids and one
    positions input, and no kind twice; `advances` names its one count input, or is null."""
    where = f"manifest.json: passes.{name}"
    declared = [s.name for s in inputs if s.role == "input"]
    if sorted(declared) != sorted(fields.row_inputs):
        raise PackageError(f"{where}.row_inputs: lists {sorted(fields.row_inputs)}; the inputs are {sorted(declared)}")
    kinds = [fields.row_inputs[n] for n in declared]
    for required in ("slot_ids", "positions"):
        if kinds.count(required) != 1:
            raise PackageError(f"{where}.row_inputs: {kinds.count(required)} inputs of kind {required}; expected one")
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:  # a replay takes its values by kind
        raise PackageError(f"{where}.row_inputs: {kinds.count(repeated[0])} inputs of kind {repeated[0]}; "
                           "expected one of each kind")
    tables = {KINDS[fields.row_inputs[n]].pool: n for n in declared if KINDS[fields.row_inputs[n]].pool}
    widths = {s.info.page.pool: s.info.page.pages_per_slot for s in inputs
              if s.role == "cache" and s.info is not None and isinstance(s.info.page, CachePages)}
    if sorted(tables) != sorted(widths) or len(tables) != sum(bool(KINDS[k].pool) for k in kinds):
        raise PackageError(f"{where}.row_inputs: block tables for pools {sorted(tables)}; the pass binds paged "
                           f"caches of pools {sorted(widths)} (one block table each)")
    for pool, name in tables.items():
        spec = next(s for s in inputs if s.name == name)
        if spec.dtype != "int32" or tuple(spec.shape) != ("rows", widths[pool]):
            raise PackageError(f"{where}: block table {name} is {spec.dtype} {list(spec.shape)}; expected int32 "
                               f"['rows', {widths[pool]}] (pages_per_slot of pool {pool})")
    counts = [n for n in declared if KINDS[fields.row_inputs[n]].count_min is not None]
    if counts != ([fields.advances] if fields.advances is not None else []):
        raise PackageError(f"{where}.advances: {fields.advances!r}; the pass's count inputs are {counts}")


def row_input_info(pass_name: str, name: str, kind) -> BufferInfo:
    if kind not in kinds_for("input"):
        raise PackageError(f"manifest.json: passes.{pass_name}.row_inputs.{name}: kind {kind!r} is not one of "
                           f"{list(kinds_for('input'))}")
    return BufferInfo(kind)


def buffer_table(table, names: set[str]) -> dict[str, BufferInfo]:
    """The top-level `buffers` table, typed; it must describe exactly the cache and staging
    buffers the passes bind (`names`). Values are checked against each spec when bound."""
    if not isinstance(table, dict):
        raise PackageError("manifest.json: 'buffers' is missing or not an object")
    missing, extra = sorted(names - set(table)), sorted(set(table) - names)
    if missing or extra:
        raise PackageError(f"manifest.json: buffers: {(missing or extra)[0]} is "
                           f"{'not described' if missing else 'described but bound by no pass'}")
    try:
        return {name: BufferInfo.from_json(name, table[name]) for name in sorted(table)}
    except ValueError as exc:
        raise PackageError(f"manifest.json: {exc}") from None


def described(role: str) -> bool:
    return role in BUFFER_ROLES

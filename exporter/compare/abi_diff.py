"""Differences between two packages' calling conventions: what a server binding them sees.

The ABI fingerprint says whether two packages bind the same way; this says how they do
not, one line per change: a pass added or removed, an input or output added, removed or
renamed (gone under one name, present under another with the same role, dtype and
shape, at the same place), reordered, or with another role, dtype or symbolic shape.
Since format 2 the manifest also records what each buffer is (kind, layer, format, dims,
ratio...) and what each pass does (width, advancing input, staging source, row input
kinds), and since format 4 whose bytes each cache format holds (cache_formats); those are
in the fingerprint, and a change to one is a line too. Only what
binding depends on is compared — not graphs, rewrites or weights' values — so fused and
unfused packages of one recipe have no differences.
"""

from __future__ import annotations

PASS_DATA = ("width", "advances", "reads_staging_of")


def _format(entry: dict | None) -> str:
    """A weights.formats entry as `fp8_e4m3 32x32 ue8m0`; no entry is fp32."""
    if entry is None:
        return "fp32"
    block = entry.get("block")
    parts = [entry.get("kind"), None if block is None else "x".join(map(str, block)), entry.get("scale_encoding")]
    return " ".join(str(p) for p in parts if p is not None)


def diff_weight_formats(a: dict, b: dict) -> list[str]:
    """One line per weight whose storage format changed, from the manifests' `weights` entries."""
    formats_a, formats_b = ((m.get("weights") or {}).get("formats") or {} for m in (a, b))
    return [f"weight {name}: format {_format(formats_a.get(name))} -> {_format(formats_b.get(name))}"
            for name in sorted(set(formats_a) | set(formats_b)) if formats_a.get(name) != formats_b.get(name)]


def _shape(spec: dict) -> str:
    return "[" + ", ".join(str(d) for d in spec["shape"]) + "]"


def _describe(spec: dict) -> str:
    return f"{spec['role']} {spec['dtype']} {_shape(spec)}"


def _key(spec: dict) -> tuple:
    return spec["role"], spec["dtype"], tuple(spec["shape"])


def _renames(removed: list[dict], added: list[dict], position: dict) -> dict[str, str]:
    """Pair a removed buffer with an added one of the same role, dtype, shape and place."""
    out, free = {}, list(added)
    for old in removed:
        match = next((new for new in free if _key(new) == _key(old) and position[new["name"]] == position[old["name"]]),
                     None)
        if match is not None:
            out[old["name"]] = match["name"]
            free.remove(match)
    return out


def diff_buffers(where: str, a: list[dict], b: list[dict]) -> list[str]:
    """`where` is e.g. "verify input"; a and b are BufferSpec JSON lists in order."""
    names_a, names_b = [s["name"] for s in a], [s["name"] for s in b]
    by_a, by_b = {s["name"]: s for s in a}, {s["name"]: s for s in b}
    position = {**{n: i for i, n in enumerate(names_a)}, **{n: i for i, n in enumerate(names_b)}}
    removed = [s for s in a if s["name"] not in by_b]
    added = [s for s in b if s["name"] not in by_a]
    renamed = _renames(removed, added, position)
    lines = [f"{where} {old}: renamed to {new}" for old, new in renamed.items()]
    lines += [f"{where} {s['name']}: removed ({_describe(s)})" for s in removed if s["name"] not in renamed]
    lines += [f"{where} {s['name']}: added ({_describe(s)})" for s in added if s["name"] not in renamed.values()]
    for name in names_a:
        if name not in by_b:
            continue
        old, new = by_a[name], by_b[name]
        if old["role"] != new["role"]:
            lines.append(f"{where} {name}: role {old['role']} -> {new['role']}")
        if old["dtype"] != new["dtype"]:
            lines.append(f"{where} {name}: dtype {old['dtype']} -> {new['dtype']}")
        if list(old["shape"]) != list(new["shape"]):
            lines.append(f"{where} {name}: shape {_shape(old)} -> {_shape(new)}")
    # Order matters: a graph takes its inputs positionally.
    kept = [renamed.get(n, n) for n in names_a if n in by_b or n in renamed]
    if kept != [n for n in names_b if n in set(kept)]:
        lines.append(f"{where}s: reordered")
    return lines


def diff_data(a: dict, b: dict) -> list[str]:
    """Changes to the buffer table and pass data of buffers and passes present in both."""
    lines = []
    formats_a, formats_b = a.get("cache_formats") or {}, b.get("cache_formats") or {}
    lines += [f"cache format {name}: {formats_a.get(name)!r} -> {formats_b.get(name)!r}"
              for name in sorted(set(formats_a) | set(formats_b)) if formats_a.get(name) != formats_b.get(name)]
    buffers_a, buffers_b = a.get("buffers") or {}, b.get("buffers") or {}
    for name in sorted(set(buffers_a) & set(buffers_b)):
        old, new = buffers_a[name], buffers_b[name]
        lines += [f"buffer {name}: {field} {old.get(field)} -> {new.get(field)}"
                  for field in sorted(set(old) | set(new)) if old.get(field) != new.get(field)]
    for name in (n for n in a["passes"] if n in b["passes"]):
        old, new = a["passes"][name], b["passes"][name]
        lines += [f"pass {name}: {field} {old.get(field)} -> {new.get(field)}"
                  for field in PASS_DATA if old.get(field) != new.get(field)]
        kinds_a, kinds_b = old.get("row_inputs") or {}, new.get("row_inputs") or {}
        lines += [f"{name} input {n}: kind {kinds_a[n]} -> {kinds_b[n]}"
                  for n in kinds_a if n in kinds_b and kinds_a[n] != kinds_b[n]]
    return lines


def diff_manifests(a: dict, b: dict) -> list[str]:
    lines = []
    major_a, major_b = (str(m.get("format_version", "")).split(".")[0] for m in (a, b))
    if major_a != major_b:
        lines.append(f"format: major version {major_a} -> {major_b}")
    if a.get("opset_version") != b.get("opset_version"):
        lines.append(f"op set: version {a.get('opset_version')} -> {b.get('opset_version')}")
    passes_a, passes_b = a["passes"], b["passes"]
    lines += [f"pass {name}: removed" for name in passes_a if name not in passes_b]
    lines += [f"pass {name}: added" for name in passes_b if name not in passes_a]
    for name in passes_a:
        if name in passes_b:
            for side in ("inputs", "outputs"):
                lines += diff_buffers(f"{name} {side[:-1]}", passes_a[name][side], passes_b[name][side])
    return lines + diff_data(a, b) + diff_weight_formats(a, b)

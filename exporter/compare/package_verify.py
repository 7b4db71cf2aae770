"""Replay two packages on the same random inputs and compare everything they write.

For every pass and rows bucket, both packages get the same random tokens, slots and
counts at the same committed positions; every reusable buffer (staging, static inputs
and outputs) is poisoned first, so a graph that read stale storage would show. Then the
outputs, the pass's staging rows and every persistent cache are compared: byte for
byte, or, given a tolerance, as values — floats directly, encoded cache rows decoded
with their format first. A pass that makes another's staging persistent (commit, whose
manifest entry says `reads_staging_of: verify`) runs right after that pass on the same
rows, and its staging is not poisoned in between. What a buffer holds (its row format
and dims) and how a pass's inputs are made come from the manifest's data, not from names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from b12x_toolchain.exporter.errors import VerifyError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.package.contract import CachePages
from b12x_toolchain.runtime.package.kinds import KINDS


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0


@dataclass
class Check:
    """One (pass, rows bucket), over all trials."""

    pass_name: str
    rows: int
    replays: int = 0
    buffers: int = 0
    differences: list[str] = field(default_factory=list)


def poison(session, staging: bool = True) -> None:
    """0xFF bytes, NaN floats, -1 integers in every buffer a replay may overwrite."""
    session.poison(keep_staging=not staging)


def buffer_format(spec) -> tuple[str, int] | None:
    """(format, dims) of the rows an encoded cache or staging buffer holds, as its manifest
    entry records them; None for buffers that are not encoded rows."""
    info = spec.info if spec is not None else None
    if info is None or info.format is None:
        return None
    return info.format, info.dims


def _values(spec, tensor: torch.Tensor) -> torch.Tensor | None:
    if tensor.dtype.is_floating_point:
        return tensor.double()
    fmt = buffer_format(spec) if tensor.dtype == torch.uint8 else None
    if fmt is None:
        return None
    codec = get_format(fmt[0])
    # Rows of the format's record size: a paged cache's live pages are [pages, page_bytes], whole records each.
    return codec.decode(tensor.reshape(-1, codec.row_bytes(fmt[1])), fmt[1]).double()


def compare(name: str, a: torch.Tensor, b: torch.Tensor, spec, tolerance: Tolerance | None) -> str | None:
    """None when equal (or within tolerance), else what differs; `spec` (None for outputs)
    says how encoded rows decode."""
    bytes_a, bytes_b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if torch.equal(bytes_a, bytes_b):
        return None
    values = (_values(spec, a), _values(spec, b)) if tolerance is not None else (None, None)
    if values[0] is None:
        count = int((bytes_a != bytes_b).sum())
        return f"{name}: {count} of {bytes_a.numel()} bytes differ"
    x, y = values
    close = torch.isclose(x, y, atol=tolerance.atol, rtol=tolerance.rtol, equal_nan=True)
    if bool(close.all()):
        return None
    worst = (x - y).abs().nan_to_num(nan=float("inf"))[~close].max().item()
    return f"{name}: {int((~close).sum())} of {close.numel()} values differ beyond tolerance (max abs diff {worst:.3g})"


def random_inputs(session, pass_name: str, row_ids: list[int], gen: torch.Generator) -> dict:
    """Replay values by input kind."""
    info = session.package.passes[pass_name]
    rows, out = len(row_ids), {}
    for spec in (s for s in info.inputs if s.role == "input"):
        kind = spec.info.kind
        if kind == "token_ids":
            out[kind] = torch.randint(0, session.package.vocab_size, spec.resolve({"rows": rows}), generator=gen,
                                      dtype=torch.int32)
        elif kind == "slot_ids":
            out[kind] = row_ids
        elif kind == "positions":
            out[kind] = [session.seq_lens[s] for s in row_ids]
        elif KINDS[kind].pool is not None:  # block tables: the session gives each row its pages
            continue
        elif KINDS[kind].count_min is not None:  # rows to make persistent: count_min..width
            out[kind] = torch.randint(KINDS[kind].count_min, info.width + 1, (rows,), generator=gen,
                                      dtype=torch.int32)
        else:
            raise VerifyError(f"pass {pass_name}: no way to make random values for input {spec.name} (kind {kind})")
    return out


class Pair:
    """Sessions of both packages, driven in lockstep."""

    def __init__(self, a, b, slots: int):
        self.sessions = (a.session(slots=slots, max_rows=slots), b.session(slots=slots, max_rows=slots))
        self.slots = slots

    def make_room(self, row_ids: list[int], width: int) -> None:
        limit = self.sessions[0].package.manifest.model.max_seq_len
        for slot in row_ids:
            if self.sessions[0].seq_lens[slot] + width > limit:
                for session in self.sessions:
                    session.reset_slot(slot)

    def replay(self, pass_name: str, inputs: dict, poison_staging: bool = True) -> tuple[dict, dict]:
        results = []
        for session in self.sessions:
            poison(session, staging=poison_staging)
            results.append(session.replay(pass_name, **inputs))
        return results[0], results[1]


def _compare_replay(pair: Pair, check: Check, trial: int, outputs: tuple, rows: int, tolerance) -> None:
    a, b = pair.sessions
    info, specs = a.package.passes[check.pass_name], a.package.buffers
    where = f"{check.pass_name} rows={rows} trial {trial}"
    found = [compare(name, outputs[0][name], outputs[1][name], None, tolerance) for name in outputs[0]]
    # Rows past `rows` (bucket padding) and the scratch slot hold padding: not part of the result.
    staging = [s.name for s in info.inputs if s.role == "staging"]
    found += [compare(n, a.staging[n][:rows], b.staging[n][:rows], specs[n], tolerance) for n in staging]
    found += [compare(n, *live_rows(a, b, n, pair.slots), specs[n], tolerance) for n in a.caches]
    # Both sessions hand out pages in the same order: their block tables must agree too.
    found += [compare(f"{pool} block tables", a.pages.tables[pool], b.pages.tables[pool], None, None)
              for pool in a.pages.tables]
    check.replays += 1
    check.buffers = len(found)
    check.differences += [f"{where}: {text}" for text in found if text]


def live_rows(a, b, name: str, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a cache holds for the request slots: their rows, or for a paged cache the pages
    some slot holds (free pages hold poison, which is no result)."""
    page = a.package.buffers[name].info.page
    if not isinstance(page, CachePages):
        return a.caches[name][:slots], b.caches[name][:slots]
    held = torch.tensor([p for p, refs in enumerate(a.pages.pools[page.pool].refs) if refs], dtype=torch.long)
    return a.caches[name][held], b.caches[name][held]


def verify_packages(a, b, seed: int = 0, trials: int = 1, tolerance: Tolerance | None = None) -> list[Check]:
    if a.abi_fingerprint != b.abi_fingerprint:
        raise VerifyError("the packages' ABIs differ (b12x abi diff shows how); only packages that bind the same "
                          "buffers can be replayed side by side")
    slots = max(max(info.rows_buckets) for info in a.passes.values())
    widest = max(info.width for info in a.passes.values())
    pair = Pair(a, b, slots)
    gen = torch.Generator().manual_seed(seed)
    checks = {(p, r): Check(p, r) for p in pass_order(a.passes) for r in a.passes[p].rows_buckets}
    for trial in range(trials):
        for (pass_name, rows), check in checks.items():
            row_ids = torch.randperm(slots, generator=gen)[:rows].tolist()
            pair.make_room(row_ids, widest)
            source = a.passes[pass_name].reads_staging_of  # it persists what that pass staged for these rows
            if source is not None:
                pair.replay(source, random_inputs(pair.sessions[0], source, row_ids, gen))
            inputs = random_inputs(pair.sessions[0], pass_name, row_ids, gen)
            outputs = pair.replay(pass_name, inputs, poison_staging=source is None)
            _compare_replay(pair, check, trial, outputs, rows, tolerance)
    return list(checks.values())


def pass_order(passes: dict) -> list[str]:
    """Passes that write persistent caches from their own inputs first, the widest first
    (prefill, then decode), so the others read caches that hold something; then passes whose
    staging another persists (verify), the other staging passes (draft), and last those that
    persist staging (commit)."""
    sources = {info.reads_staging_of for info in passes.values()}

    def rank(name):
        info = passes[name]
        if info.reads_staging_of is not None:
            return 3, 0, name
        if info.advances:
            return 0, -info.width, name
        return (1 if name in sources else 2), 0, name
    return sorted(passes, key=rank)

"""Replay two packages on the same random inputs and compare everything they write.

For every pass and rows bucket, both packages get the same random tokens, slots and
counts at the same committed positions; every reusable buffer (staging, static inputs
and outputs) is poisoned first, so a graph that read stale storage would show. Then the
outputs, the pass's staging rows and every persistent cache are compared: byte for
byte, or, given a tolerance, as values — floats directly, encoded cache rows decoded
with their format first. Commit reads what verify staged, so it runs right after a
verify of the same rows and its staging is not poisoned in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import yaml

from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import parse_recipe
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.exporter.errors import VerifyError  # noqa: F401  (re-exported)


PASS_ORDER = ("prefill", "verify", "draft", "commit")


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


def buffer_format(name: str, d: Dims) -> tuple[str, int] | None:
    """(format, dim) of the rows an encoded cache or staging buffer holds (exporter/model/buffers.py names)."""
    if name.endswith((".window", ".context")):
        return d.window_format, d.head_dim
    if name.endswith(".compressed"):
        return d.compressed_format, d.head_dim
    if name.endswith(".state"):
        return d.state_format, 2 * d.head_dim
    return None


def _values(name: str, tensor: torch.Tensor, d: Dims) -> torch.Tensor | None:
    if tensor.dtype.is_floating_point:
        return tensor.double()
    fmt = buffer_format(name, d) if tensor.dtype == torch.uint8 else None
    if fmt is None:
        return None
    return get_format(fmt[0]).decode(tensor.reshape(-1, tensor.shape[-1]), fmt[1]).double()


def compare(name: str, a: torch.Tensor, b: torch.Tensor, d: Dims, tolerance: Tolerance | None) -> str | None:
    """None when equal (or within tolerance), else what differs."""
    bytes_a, bytes_b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if torch.equal(bytes_a, bytes_b):
        return None
    values = (_values(name, a, d), _values(name, b, d)) if tolerance is not None else (None, None)
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
    info = session.package.passes[pass_name]
    rows, out = len(row_ids), {}
    for spec in (s for s in info.inputs if s.role == "input"):
        if spec.name == "tokens":
            out["tokens"] = torch.randint(0, session.package.vocab_size, spec.resolve({"rows": rows}), generator=gen,
                                          dtype=torch.int32)
        elif spec.name == "row_ids":
            out["row_ids"] = row_ids
        elif spec.name == "positions":
            out["positions"] = [session.seq_lens[s] for s in row_ids]
        elif spec.name in ("lengths", "accept_len"):  # rows to make persistent: 1..width, or 0..width
            low = 1 if spec.name == "lengths" else 0
            out[spec.name] = torch.randint(low, info.width + 1, (rows,), generator=gen, dtype=torch.int32)
        else:
            raise VerifyError(f"pass {pass_name}: no way to make random values for input {spec.name}")
    return out


class Pair:
    """Sessions of both packages, driven in lockstep."""

    def __init__(self, a, b, slots: int):
        self.sessions = (a.session(slots=slots, max_rows=slots), b.session(slots=slots, max_rows=slots))
        self.slots = slots

    def make_room(self, row_ids: list[int], width: int) -> None:
        limit = self.sessions[0].package.manifest["model"]["max_seq_len"]
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


def _compare_replay(pair: Pair, check: Check, trial: int, outputs: tuple, rows: int, d: Dims, tolerance) -> None:
    a, b = pair.sessions
    info = a.package.passes[check.pass_name]
    where = f"{check.pass_name} rows={rows} trial {trial}"
    found = [compare(name, outputs[0][name], outputs[1][name], d, tolerance) for name in outputs[0]]
    # Rows past `rows` (bucket padding) and the scratch slot hold padding: not part of the result.
    staging = [s.name for s in info.inputs if s.role == "staging"]
    found += [compare(n, a.staging[n][:rows], b.staging[n][:rows], d, tolerance) for n in staging]
    found += [compare(n, a.caches[n][: pair.slots], b.caches[n][: pair.slots], d, tolerance) for n in a.caches]
    check.replays += 1
    check.buffers = len(found)
    check.differences += [f"{where}: {text}" for text in found if text]


def verify_packages(a, b, seed: int = 0, trials: int = 1, tolerance: Tolerance | None = None) -> list[Check]:
    if a.abi_fingerprint != b.abi_fingerprint:
        raise VerifyError("the packages' ABIs differ (b12x abi diff shows how); only packages that bind the same "
                          "buffers can be replayed side by side")
    d = Dims.from_recipe(parse_recipe(yaml.safe_dump(a.manifest["recipe"]), file="manifest.json#recipe"))
    slots = max(max(info.rows_buckets) for info in a.passes.values())
    widest = max(info.width for info in a.passes.values())
    pair = Pair(a, b, slots)
    gen = torch.Generator().manual_seed(seed)
    # Prefill first, so the later passes read caches that hold something.
    order = sorted(a.passes, key=lambda p: (PASS_ORDER.index(p) if p in PASS_ORDER else len(PASS_ORDER), p))
    checks = {(p, r): Check(p, r) for p in order for r in a.passes[p].rows_buckets}
    for trial in range(trials):
        for (pass_name, rows), check in checks.items():
            row_ids = torch.randperm(slots, generator=gen)[:rows].tolist()
            pair.make_room(row_ids, widest)
            if pass_name == "commit":  # commit makes persistent what a verify of the same rows staged
                pair.replay("verify", random_inputs(pair.sessions[0], "verify", row_ids, gen))
            inputs = random_inputs(pair.sessions[0], pass_name, row_ids, gen)
            outputs = pair.replay(pass_name, inputs, poison_staging=pass_name != "commit")
            _compare_replay(pair, check, trial, outputs, rows, d, tolerance)
    return list(checks.values())

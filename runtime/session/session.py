"""A session: caller-owned buffers bound to a package's passes, replayed per rows bucket.

The session allocates (or accepts) every cache, staging buffer, input and output once,
validates each against the manifest, and prepares each pass per rows bucket. A replay
validates the caller's values, copies them into the bucket's static inputs (padding rows
point at the scratch slot, the last slot), runs the captured graph and copies results
into the bucket's static outputs. Buffers never move, so poisoning any reusable storage
before a replay changes no output.

Compressed entries and index keys are paged (page_tables.py). By default the session owns
the pages: `pages` (per pool, or one count for all), a `cache_bytes` budget for them, or
else what `memory_fraction` of the device's free memory holds, at most enough for every slot
to reach max_seq_len (memory.py); a replay then gives each row the pages its tokens need
and fills the block-table inputs itself. `contiguous` places slot s's pages at
s * pages_per_slot onwards, in order: the per-slot layout of format 2's caches, which
needs every slot's pages for max_seq_len whatever the budget.
A caller that owns its pages passes the block tables instead, and the session only
checks them.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.utils._pytree as pytree

from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.ops.qualify import check_fused_window
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.contract import CachePages
from b12x_toolchain.runtime.package.kinds import KINDS
from b12x_toolchain.runtime.package.weight_binding import place_weights
from b12x_toolchain.runtime.session.background_compile import BackgroundCompile
from b12x_toolchain.runtime.session.compile_worker import session_spec
from b12x_toolchain.runtime.session.compiled import CompiledGraph, cache_dir
from b12x_toolchain.runtime.session.graph_runner import GraphRunner
from b12x_toolchain.runtime.session.memory import (
    SessionMemoryError,
    after_capture,
    capture_headroom,
    default_fraction,
    free_bytes,
    zeros,
)
from b12x_toolchain.runtime.session.page_tables import PageTables
from b12x_toolchain.runtime.session.pages import PagePool, PagesExhausted
from b12x_toolchain.runtime.session.retarget import graph_on
from b12x_toolchain.runtime.session.transfers import upload
from b12x_toolchain.runtime.session.validate import (
    BufferError,
    OnDevice,
    check_buffer,
    concrete_device,
    validate_inputs,
)

FUSED = ops.window_snapshot_append.default


class Bucket:
    """Static inputs and outputs of one (pass, rows bucket), and the graph's argument list.

    Every argument is a fixed tensor (weights, caches, staging views, static inputs), so the
    flat argument list is built once; a replay calls the graph on it directly, with no
    pytree or shape-guard work (the session validated the values already).
    """

    def __init__(self, rows: int, inputs: dict, outputs: dict, staging: dict, graph, args: list, out_spec,
                 padding: dict):
        self.rows, self.inputs, self.outputs, self.staging = rows, inputs, outputs, staging
        self.graph, self.args, self.out_spec = graph, args, out_spec
        self.padding = padding  # per static input, the value of padding rows (scratch slot, no page, 0)

    def run(self) -> dict:
        return pytree.tree_unflatten(list(self.graph(*self.args)), self.out_spec)


class Session:
    def __init__(self, package, device="cpu", slots: int = 1, max_rows: int | None = None, buffers: dict | None = None,
                 pages: int | dict | None = None, cache_bytes: int | None = None, contiguous: bool = False,
                 compile=False, compile_cache=None, capture=None, passes=None, engram_tables="device",
                 memory_fraction: float | None = None, compile_in_background: bool | str = False):
        """memory_fraction: without pages or cache_bytes, the share of the device's free memory
        the page pools and the session's other buffers may take (memory.py; default 0.9 on
        CUDA, 0.25 on CPU). capture: how each bucket's step is captured (graph_runner.py): by
        default CUDA graphs on a CUDA device and none elsewhere; capture.RecordingCapture() runs the
        capture path off the GPU. passes: the pass names to prepare (default: all); only
        their graphs are deserialised (package/pass_graph.py). engram_tables: where the
        Engram tables live, "device" (as every weight) or "host" (pinned CPU memory, read
        in place by the lookup: package/weight_binding.py place_weights)."""
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.package, self.device = package, concrete_device(device)  # buffers are checked against it
        self.slots, self.scratch_slot = slots, slots  # one extra slot absorbs padding rows
        all_buckets = sorted({b for p in package.passes.values() for b in p.rows_buckets})
        self.max_rows = max_rows or all_buckets[-1]
        self.seq_lens = [0] * (slots + 1)  # host mirror of the seq_len cache: validation needs no sync
        self.weights = place_weights(package.weights, self.device, package.manifest.weights.engram_tables,
                                     engram_tables)
        self.caches, self.staging = {}, {}
        self.memory_budget = None  # what sized the default pools (_budget_counts), when it did; CUDA: + capture's
        page_specs = self._page_specs()
        self.pools = self._pools(page_specs, pages, cache_bytes, buffers or {}, contiguous, memory_fraction, passes)
        self._bind(buffers or {})
        paged = {pool: {name: self.caches[name] for name, _ in entries} for pool, entries in page_specs.items()}
        self.pages = PageTables(self.pools, paged, slots, self.device, contiguous)
        # The cache that holds committed lengths, by its recorded kind (contract.py).
        lengths = [n for n, s in self._shared_specs().items() if s.info is not None and s.info.kind == "seq_len"]
        if len(lengths) != 1:
            raise BufferError(f"expected one seq_len cache, the package has {lengths}")
        self.seq_len_buffer = lengths[0]
        self.graphs = GraphRunner(self.device, (self.caches, self.staging), capture)
        self.compiled_passes = self._compiled_passes(compile)
        self.compile_cache = cache_dir(package, self.device, compile_cache) if self.compiled_passes else None
        # In the background (background_compile.py), every bucket starts on its plain graph.
        self._compiled_now = () if compile_in_background else self.compiled_passes
        self._compile_here = compile_in_background == "here"  # compile_worker.py's own session
        # Only the passes it replays: each is deserialised when first prepared (pass_graph.py).
        self.buckets = {name: self._prepare(package.passes[name]) for name in self._replayed(passes)}
        self.compiler = self._start_compiler() if compile_in_background and self.compiled_passes else None
        if self.device.type == "cuda":  # what capture took beside the budgeted buffers (memory.py)
            self.memory_budget = after_capture(self.memory_budget, self.graphs.capture_memory,
                                               free_bytes(self.device), self.device)

    def _replayed(self, passes) -> tuple[str, ...]:
        """The passes this session prepares: all (None) or those named, in the package's order."""
        if passes is None:
            return tuple(self.package.passes)
        unknown = sorted(set(passes) - set(self.package.passes))
        if unknown or not passes:
            raise ValueError(f"passes={passes!r}: expected pass names among {sorted(self.package.passes)}")
        return tuple(name for name in self.package.passes if name in passes)

    def _compiled_passes(self, compile) -> tuple[str, ...]:
        """The passes replayed through Inductor (compiled.py): none, all (True) or those named."""
        if compile is False or compile is None:
            return ()
        if compile is True:
            return tuple(self.package.passes)
        names = (compile,) if isinstance(compile, str) else tuple(compile)
        unknown = [n for n in names if n not in self.package.passes]
        if unknown or not names:
            raise ValueError(f"compile={compile!r}: expected True, False or pass names among "
                             f"{sorted(self.package.passes)}")
        return names

    # -- binding ------------------------------------------------------------------------

    def _shared_specs(self) -> dict[str, BufferSpec]:
        return self.package.buffers  # the passes' agreement was checked at load

    def _page_specs(self) -> dict[str, list]:
        """Paged caches by pool: [(name, CachePages)]."""
        out = {}
        for name, spec in self._shared_specs().items():
            if spec.info is not None and isinstance(spec.info.page, CachePages):
                out.setdefault(spec.info.page.pool, []).append((name, spec.info.page))
        return out

    def _pools(self, specs: dict, pages, cache_bytes, given: dict, contiguous: bool, memory_fraction,
               passes) -> dict[str, PagePool]:
        """One pool per page pool of `specs` (`_page_specs`), sized by pages, cache_bytes, the
        paged caches the caller brought, or else by a share of the device's free memory
        (`_budget_counts`); contiguous placement gives every slot its pages for max_seq_len."""
        if pages is not None and cache_bytes is not None:
            raise ValueError("give pages or cache_bytes, not both")
        if memory_fraction is not None and (pages is not None or cache_bytes is not None):
            raise ValueError("memory_fraction sizes the pools when neither pages nor cache_bytes is given")
        if memory_fraction is not None and contiguous:
            raise ValueError("memory_fraction does not apply to contiguous=True: contiguous placement needs "
                             "every slot's pages for max_seq_len")
        brought = {pool: given[name].shape[0] for pool, entries in specs.items() for name, _ in entries
                   if isinstance(given.get(name), torch.Tensor) and given[name].dim() == 2}
        if brought and pages is None and cache_bytes is None:
            pages = brought if set(brought) == set(specs) else None  # caller-owned pages: their count
        first = {pool: entries[0][1] for pool, entries in specs.items()}
        set_bytes = {pool: sum(p.page_bytes for _, p in entries) for pool, entries in specs.items()}
        if cache_bytes is not None:
            counts = self._counts_for_bytes(cache_bytes, first, set_bytes)
        elif pages is None:
            counts = {p: self.slots * first[p].pages_per_slot for p in specs}  # every slot at max_seq_len
            if not contiguous:  # contiguous placement needs them all: slot s owns pages s * pages_per_slot on
                counts = self._budget_counts(counts, first, set_bytes, given, memory_fraction, passes)
        elif isinstance(pages, dict):
            if set(pages) != set(specs):
                raise ValueError(f"pages: {sorted(pages)} given; this package's page pools are {sorted(specs)}")
            counts = dict(pages)
        else:
            counts = {p: pages for p in specs}
        for pool, count in counts.items():
            if not (isinstance(count, int) and not isinstance(count, bool) and count >= 1):
                what = f"cache_bytes={cache_bytes!r} holds" if cache_bytes is not None else "pages:"
                raise ValueError(f"{what} {count!r} pages of pool {pool}; expected at least 1 "
                                 f"({set_bytes[pool]} bytes per page across its caches)")
        return {p: PagePool(p, counts[p], first[p].tokens_per_page, first[p].pages_per_slot, set_bytes[p])
                for p in specs}

    @staticmethod
    def _counts_for_bytes(cache_bytes, first: dict, set_bytes: dict) -> dict[str, int]:
        """Pages per pool that `cache_bytes` holds, each pool getting the same number of tokens."""
        per_token = sum(set_bytes[p] / first[p].tokens_per_page for p in first) or 1
        tokens = int(cache_bytes // per_token) if isinstance(cache_bytes, int) and cache_bytes > 0 else 0
        return {p: tokens // first[p].tokens_per_page for p in first}

    def _budget_counts(self, full: dict, first: dict, set_bytes: dict, given: dict, memory_fraction,
                       passes) -> dict[str, int]:
        """The default pools: `full` (every slot at max_seq_len) where the budget holds it, else
        the pages the budget holds, as long as one request of max_seq_len tokens fits."""
        fraction = default_fraction(self.device) if memory_fraction is None else memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"memory_fraction={memory_fraction!r}: expected a number in (0, 1]")
        free = free_bytes(self.device)
        other = self._other_buffer_bytes(given, passes, first)
        headroom = capture_headroom(self.device)  # CUDA: the graph pool and workspaces (memory.py)
        budget = max(int(fraction * free) - other - headroom, 0)
        self.memory_budget = {"memory_fraction": fraction, "free_bytes": free, "other_bytes": other,
                              "budget_bytes": budget}
        if headroom:
            self.memory_budget["capture_headroom_bytes"] = headroom
        counts = {p: min(n, full[p]) for p, n in self._counts_for_bytes(budget, first, set_bytes).items()}
        if any(counts[p] < first[p].pages_per_slot for p in first):
            one = sum(first[p].pages_per_slot * set_bytes[p] for p in first)
            # The smallest budget _counts_for_bytes turns into one request's pages of every pool: the
            # tokens of the longest pool at its bytes per token, the float division's rounding searched.
            tokens = max(first[p].pages_per_slot * first[p].tokens_per_page for p in first)
            per_token = sum(set_bytes[p] / first[p].tokens_per_page for p in first)
            needed = next(b for b in itertools.count(max(math.ceil(tokens * per_token) - 2, 0)) if all(
                n >= first[p].pages_per_slot for p, n in self._counts_for_bytes(b, first, set_bytes).items()))
            # Short of fraction * free (the budget itself stops at 0 when the other buffers outgrow it).
            short = needed + other + headroom - int(fraction * free)
            fits = math.ceil((needed + other + headroom) / free * 1000) / 1000 if free else math.inf
            raise SessionMemoryError(
                f"the page pools' memory budget is {budget} bytes ({fraction} of {free} bytes free on "
                f"{self.device}, less {other} bytes of the session's other buffers"
                + (f" and {headroom} bytes left for capture" if headroom else "") + "); bytes per page: "
                + ", ".join(f"{set_bytes[p]} in pool {p}" for p in first)
                + f"; one request of max_seq_len {self.package.manifest.model.max_seq_len} tokens needs "
                + ", ".join(f"{first[p].pages_per_slot} pages of pool {p}" for p in first)
                + f" ({one} bytes): {short} bytes short. Free {math.ceil(short / fraction)} bytes of memory, "
                + (f"raise memory_fraction to at least {fits}, " if fits <= 1 else "")
                + "or give pages or cache_bytes")
        return counts

    def _other_buffer_bytes(self, given: dict, passes, first: dict) -> int:
        """Bytes the session allocates beside its pages: per-slot caches and staging (those the
        caller did not bring), block tables, and the static inputs and outputs of every bucket."""
        symbols = {"slots": self.slots + 1, "rows": self.max_rows}
        paged = {name for name, spec in self._shared_specs().items()
                 if spec.info is not None and isinstance(spec.info.page, CachePages)}
        total = sum(math.prod(spec.resolve(symbols)) * spec.torch_dtype.itemsize
                    for name, spec in self._shared_specs().items() if name not in paged and name not in given)
        total += sum((self.slots + 1) * page.pages_per_slot * 4 for page in first.values())  # int32 tables
        for name in self._replayed(passes):
            info = self.package.passes[name]
            for rows in (b for b in info.rows_buckets if b <= self.max_rows):
                total += sum(math.prod(s.resolve({"rows": rows})) * s.torch_dtype.itemsize
                             for s in (*info.inputs, *info.outputs) if s.role in ("input", "output"))
        return total

    def _bind(self, given: dict) -> None:
        symbols = {"slots": self.slots + 1, "rows": self.max_rows, **{p: pool.count for p, pool in self.pools.items()}}
        specs = self._shared_specs()
        unknown = set(given) - set(specs)
        if unknown:
            raise BufferError(f"{sorted(unknown)[0]}: not a cache or staging buffer of this package")
        for name, spec in specs.items():
            shape = spec.resolve(symbols)
            tensor = given.get(name)
            if tensor is None:
                tensor = zeros(shape, spec.torch_dtype, self.device)  # CPU: committed as it is written
            check_buffer(spec, tensor, shape, self.device)
            (self.caches if spec.role == "cache" else self.staging)[name] = tensor

    def _prepare(self, info) -> dict[int, Bucket]:
        # Replayed or compiled, a pass needs only the graph module and calling spec
        # (pass_graph.PassGraph.replay): Inductor is handed fakes of the bucket's static shapes
        # (compiled.py), as the background compilation does. The program's own described values
        # are symbolic, and compiling from them failed inside torch's fake tensors.
        program = info.graph.replay
        for node in program.graph_module.graph.nodes:
            if node.op == "call_function" and node.target == FUSED:
                args = dict(zip((a.name for a in FUSED._schema.arguments), node.args))
                check_fused_window(args["history"], args["layout"], args["page_size"], where=f"pass {info.name}")
        buckets, graph = {}, graph_on(program, self.device)
        for rows in (b for b in info.rows_buckets if b <= self.max_rows):
            make = lambda s: torch.zeros(s.resolve({"rows": rows}), dtype=s.torch_dtype, device=self.device)
            inputs = {s.name: make(s) for s in info.inputs if s.role == "input"}
            outputs = {s.name: make(s) for s in info.outputs}
            staging = {s.name: self.staging[s.name][:rows] for s in info.inputs if s.role == "staging"}
            caches = {s.name: self.caches[s.name] for s in info.inputs if s.role == "cache"}
            args, spec = pytree.tree_flatten(((self.weights_for(info), caches, staging, inputs), {}))
            if spec != program.call_spec.in_spec:
                raise BufferError(f"pass {info.name}: bound buffers do not match the graph's inputs")
            padding = {name: -1 if name in info.block_tables.values() else 0 for name in inputs}
            padding[info.input_of("slot_ids")] = self.scratch_slot
            # Compiled per bucket: its shapes are static, and its arguments are these tensors.
            runs = CompiledGraph(graph, self.compile_cache) if info.name in self._compiled_now else graph
            buckets[rows] = Bucket(rows, inputs, outputs, staging, runs, args, program.call_spec.out_spec,
                                   padding)
            self.graphs.add(info.name, buckets[rows])
        if not buckets:
            raise BufferError(f"pass {info.name}: no rows bucket fits max_rows={self.max_rows}; buckets {info.rows_buckets}")
        return buckets

    def _start_compiler(self) -> BackgroundCompile:
        """Compile the compiled passes' buckets: from the local cache now when it holds them all,
        otherwise on a worker thread while the plain graphs serve (background_compile.py)."""
        buckets = [(name, bucket) for name in self.compiled_passes if name in self.buckets
                   for bucket in self.buckets[name].values()]
        compiler = BackgroundCompile(buckets, self.compile_cache,
                                     lambda name: graph_on(self.package.passes[name].graph.replay, self.device),
                                     self.graphs.recapture if self.graphs.captures else None, self.device)
        if compiler.cached or self._compile_here:
            compiler.compile_now()
        else:
            compiler.start(session_spec(self))
        return compiler

    def swap_in_compiled(self) -> bool:
        """Between steps, with no request in flight: replay compiled from now on if the background
        compilation has finished (background_compile.py). True when this call switched."""
        return self.compiler is not None and self.compiler.swap_in()

    # -- replay -------------------------------------------------------------------------

    def bucket_for(self, pass_name: str, rows: int) -> Bucket:
        return self.graphs.bucket_for(pass_name, rows)

    def replay(self, pass_name: str, **values) -> dict[str, torch.Tensor]:
        """Run one pass for len(slot_ids) rows; returns views of the static outputs by kind.

        Values are given by input kind (kinds.py) — token_ids, slot_ids, positions, the
        pass's count (new_tokens or accepted_tokens) and, for caller-owned pages, a block
        table per pool (entry_block_table, index_key_block_table) — never by the names the
        exporter gave the inputs. Outputs are keyed by kind too (logits, ...).

        Values are host data (lists or CPU tensors), checked on the host against the
        session's own bookkeeping, then copied up without waiting: a replay never waits for
        the device. token_ids may instead be `OnDevice(tensor)`, computed on the device from
        a pass's outputs (validate.py)."""
        if pass_name not in self.buckets:
            raise ValueError(f"unknown pass {pass_name!r}; this package has {sorted(self.buckets)}")
        info = self.package.passes[pass_name]
        host = validate_inputs(self, info, values)
        n = len(host["slot_ids"])
        if info.block_tables and not any(KINDS[kind].pool for kind in values):
            self._give_pages(info, host)
        bucket = self.bucket_for(pass_name, n)
        for name, static in bucket.inputs.items():
            value, pad = host[info.input_kinds[name]], bucket.padding[name]
            if isinstance(value, OnDevice):
                static[:n].copy_(value.tensor)
                static[n:] = pad
            else:  # padding rows are written with the real ones: one copy per input
                upload(static, value + [[pad] * static.shape[1] if static.dim() == 2 else pad] * (bucket.rows - n))
        self.graphs.replay(pass_name, bucket)  # CUDA: one graph replay; CPU: the graph, run directly
        self._advance(info, host)
        return {info.output_kinds[name]: out[:n] for name, out in bucket.outputs.items()}

    def _give_pages(self, info, host: dict) -> None:
        """Session-owned pages: grow each row's pages to what the pass reads and writes, then
        take its block-table rows from the host mirror of the session's tables (page_tables.py).
        Nothing is written unless every row fits."""
        slots, starts = host["slot_ids"], host["positions"]
        counts = host[info.advances_kind] if info.advances else [0] * len(slots)
        try:
            self.pages.grow([(slot, start, start + count) for slot, start, count in zip(slots, starts, counts)])
        except PagesExhausted as exc:
            raise PagesExhausted(f"pass {info.name}: {exc}") from None
        for pool, name in info.block_tables.items():
            host[info.input_kinds[name]] = [self.pages.row(pool, slot) for slot in slots]

    def weights_for(self, info) -> dict:
        return {s.name: self.weights[s.name] for s in info.inputs if s.role == "weight"}

    def _advance(self, info, host: dict) -> None:
        """Mirror what the graph wrote to the seq_len cache: the pass's `advances` input says
        how many rows became persistent (the manifest records it; no pass name decides it)."""
        if info.advances is None:
            return
        for slot, pos, count in zip(host["slot_ids"], host["positions"], host[info.advances_kind]):
            self.seq_lens[slot] = pos + count

    def reset_slot(self, slot: int) -> None:
        """Hand a slot to a new request: its old rows become invisible (positions restart) and
        its pages go back to their pools; pages reserved for the slot stay reserved."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is out of range [0, {self.slots})")
        self.set_committed_length(slot, 0)
        self.pages.release_slot(slot)

    def set_committed_length(self, slot: int, length: int) -> None:
        """The one writer of a slot's committed length outside the graphs (a reset, a restored
        snapshot): the seq_len cache the graphs read and its host mirror, together."""
        self.caches[self.seq_len_buffer][slot] = length
        self.seq_lens[slot] = length

    def retire_slot(self, slot: int) -> None:
        """reset_slot, and return the slot's reserved pages too: nobody is waiting to use them."""
        self.reset_slot(slot)
        self.pages.unreserve_slot(slot)

    def reusable_storage(self) -> list[torch.Tensor]:
        """Every buffer a replay may overwrite without notice: staging, static inputs, outputs."""
        out = list(self.staging.values())
        for buckets in self.buckets.values():
            for bucket in buckets.values():
                out += list(bucket.inputs.values()) + list(bucket.outputs.values())
        return out

    def poison(self, keep_staging: bool = False) -> None:
        """Fill reusable storage and free pages with garbage (0xFF bytes, NaN floats, -1 integers).

        Replays must not read anything they did not write first; tests and the verify
        command call this before each replay to prove it. keep_staging spares the staging
        buffers (commit reads what verify staged).
        """
        keep = {t.data_ptr() for t in self.staging.values()} if keep_staging else set()
        self.poison_free_pages()
        for tensor in self.reusable_storage():
            if tensor.data_ptr() in keep:
                continue
            if tensor.dtype == torch.uint8:
                tensor.fill_(0xFF)
            elif tensor.dtype.is_floating_point:
                tensor.fill_(float("nan"))
            else:
                tensor.fill_(-1)

    def poison_free_pages(self) -> None:
        """0xFF in every page no slot or snapshot holds: what a replay must never read."""
        for pool, ids in self.pages.free_pages().items():
            if ids:
                index = torch.tensor(ids, dtype=torch.long, device=self.device)
                for cache in self.pages.caches[pool].values():
                    cache[index] = 0xFF

    def buffer_addresses(self) -> dict[str, tuple[int, int]]:
        """(data pointer, bytes) of every caller-owned buffer and static input/output."""
        out = {n: (t.data_ptr(), t.nbytes) for n, t in {**self.caches, **self.staging}.items()}
        for pass_name, buckets in self.buckets.items():
            for rows, bucket in buckets.items():
                for n, t in {**bucket.inputs, **bucket.outputs}.items():
                    out[f"{pass_name}[{rows}].{n}"] = (t.data_ptr(), t.nbytes)
        return out

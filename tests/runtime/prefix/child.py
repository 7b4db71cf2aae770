"""Child processes for the prefix-cache tests: a writer killed mid-write, a writer and a
reader sharing one directory, and a fresh process hydrating from L2.

    python tests/runtime/prefix/child.py MODE ARGS...
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

from b12x_toolchain.runtime.prefix import l2 as prefix_l2  # noqa: E402
from b12x_toolchain.runtime.prefix.keys import token_bytes  # noqa: E402
from b12x_toolchain.runtime.prefix.l2 import L2Store  # noqa: E402
from runtime.prefix.helpers import fake_identity, is_intact, make_snapshot  # noqa: E402

IDENT = fake_identity()


def snap_of(i: int, row_bytes: int = 64, tag: int = 0):
    return make_snapshot(IDENT, [i] * 12 + [tag], row_bytes=row_bytes)


def crash_writer(directory: str) -> None:
    store = L2Store(directory, 64 << 20)
    store.put(snap_of(0))

    def stall(fileobj, chunks):
        fileobj.write(bytes(chunks[0]))
        fileobj.write(bytes(chunks[1]))
        fileobj.flush()
        print("WRITING", flush=True)
        time.sleep(120)  # the parent kills this process here

    prefix_l2._write_chunks = stall
    store.put(snap_of(1, row_bytes=1 << 16))


def writer(directory: str, count: str, budget: str, done: str) -> None:
    store = L2Store(directory, int(budget))
    assert store.writable
    print("READY", flush=True)
    go = Path(done + ".go")
    while not go.exists():  # the reader has opened the directory: start writing under its eyes
        time.sleep(0.01)
    seen = Path(done + ".seen")
    for i in range(int(count)):
        store.put(snap_of(i))
        store.lookup(IDENT, token_bytes([i // 2] * 12 + [0]))
        time.sleep(0.01)
        deadline = time.monotonic() + 60
        while i == int(count) // 2 and not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # halfway: wait until the reader has read something mid-stream
    stats = store.stats.as_dict()
    Path(done).write_text(json.dumps(stats))
    ack = Path(done + ".ack")
    while not ack.exists():  # the reader has stopped trying to write: now the lock may go
        time.sleep(0.01)
    store.close()
    print(json.dumps(stats), flush=True)


def reader(directory: str, count: str, budget: str, done: str) -> None:
    store = L2Store(directory, int(budget))
    out = {"writable_at_start": store.writable, "hits": 0, "bad": 0, "skipped_puts": 0}
    Path(done + ".go").write_text("")

    def sweep():
        hits = 0
        for i in range(int(count)):
            got = store.lookup(IDENT, token_bytes([i] * 12 + [0, 5]))
            if got is not None:
                hits += 1
                if not is_intact(got) or got.token_ids != [i] * 12 + [0]:
                    out["bad"] += 1
        return hits

    while not Path(done).exists():
        hits = sweep()
        out["hits"] += hits
        if not store.put(snap_of(0, tag=1)):
            out["skipped_puts"] += 1
        if hits:
            Path(done + ".seen").touch()
    Path(done + ".ack").write_text("")
    out["final_hits"] = sweep()
    deadline = time.monotonic() + 60
    while not store.put(snap_of(0, tag=1)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the writer is closing; its lock goes with it
    out["promoted_put"] = store.writable
    out["writable_at_end"] = store.writable
    out["stats"] = store.stats.as_dict()
    store.close()
    print(json.dumps(out), flush=True)


def roundtrip(package: str, directory: str, request: str, out: str) -> None:
    import safetensors.torch

    from b12x_toolchain.runtime import load
    from b12x_toolchain.runtime.prefix.cache import PrefixCache
    from b12x_toolchain.runtime.serving.speculative import Decoder
    from runtime.prefix.helpers import continue_slot

    data = json.loads(Path(request).read_text())
    pkg = load(package)
    session = pkg.session(slots=2, max_rows=1)
    with PrefixCache(pkg, l1_bytes=0, l2_dir=directory, write_behind=False) as cache:
        row = Decoder(session, prefix_cache=cache).prefill(1, data["prompt"])
        outs = continue_slot(session, 1, data["more"])
        stats = cache.stats_dict()
    safetensors.torch.save_file({f"out{i}": t.contiguous() for i, t in enumerate(outs)}, out)
    print(json.dumps({"pending": row.pending, "stats": stats}), flush=True)


if __name__ == "__main__":
    {"crash-writer": crash_writer, "writer": writer, "reader": reader, "roundtrip": roundtrip}[sys.argv[1]](*sys.argv[2:])

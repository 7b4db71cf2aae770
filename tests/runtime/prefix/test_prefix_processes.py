"""Processes: a writer killed mid-write, a writer and a reader on one directory, a restart hydrating from L2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch

from b12x_toolchain.runtime.prefix import l2 as prefix_l2
from b12x_toolchain.runtime.prefix import snapshot_file
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.l2 import L2Store, file_name
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from runtime.prefix.helpers import continue_slot, fake_identity, is_intact, make_snapshot

CHILD = Path(__file__).resolve().parent / "child.py"
IDENT = fake_identity()


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(proc: subprocess.Popen, line: str) -> None:
    got = proc.stdout.readline().strip()
    if got != line:
        proc.kill()
        raise AssertionError(f"child said {got!r}, expected {line!r}: {proc.stderr.read()[-3000:]}")


def test_a_writer_killed_mid_write_leaves_no_partial_file(tmp_path):
    proc = spawn("crash-writer", str(tmp_path))
    try:
        wait_for(proc, "WRITING")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    committed = make_snapshot(IDENT, [0] * 12 + [0])
    names = sorted(os.listdir(tmp_path))
    snapshots = [n for n in names if prefix_l2.NAME.match(n)]
    temps = [n for n in names if n.startswith(prefix_l2.TMP_PREFIX)]
    assert snapshots == [file_name(committed)] and len(temps) == 1  # the big one exists only as a temporary
    with L2Store(tmp_path, 64 << 20) as store:  # the next start cleans up and recounts from disk
        assert store.stats.orphans_removed == 1
        assert not any(n.startswith(prefix_l2.TMP_PREFIX) for n in os.listdir(tmp_path))
        assert store.tracked_bytes() == store.disk_bytes() == snapshot_file.encode(committed)[1]
        assert is_intact(store.lookup(IDENT, token_bytes([0] * 12 + [0])))
        assert store.lookup(IDENT, token_bytes([1] * 12 + [0])) is None


def test_a_writer_and_a_reader_process_share_one_directory(tmp_path):
    directory, done, count = tmp_path / "l2", tmp_path / "done.json", 40
    budget = 12 * snapshot_file.encode(make_snapshot(IDENT, [0] * 12 + [0]))[1]
    writer = spawn("writer", str(directory), str(count), str(budget), str(done))
    wait_for(writer, "READY")
    reader = spawn("reader", str(directory), str(count), str(budget), str(done))
    w_out, w_err = writer.communicate(timeout=300)
    r_out, r_err = reader.communicate(timeout=300)
    assert writer.returncode == 0, w_err[-3000:]
    assert reader.returncode == 0, r_err[-3000:]
    w, r = json.loads(w_out.strip().splitlines()[-1]), json.loads(r_out.strip().splitlines()[-1])
    assert w["writes"] == count and w["evictions"] == count - 12
    assert not r["writable_at_start"] and r["bad"] == 0  # every hit the reader got was whole
    assert r["hits"] > 0 and r["skipped_puts"] > 0  # it read while the writer wrote, and did not write
    assert r["final_hits"] == 12  # everything the writer kept is visible, nothing lost
    assert r["promoted_put"] and r["writable_at_end"]  # once the writer left, the reader took over
    assert r["stats"]["hits"] + r["stats"]["misses"] == r["stats"]["lookups"]
    with L2Store(directory, budget) as store:  # a full scrub finds every file sound
        s = store.stats
        assert s.checksum_failures == s.load_errors == s.orphans_removed == 0
        assert len(store.names()) == 12 and store.tracked_bytes() == store.disk_bytes() <= budget


def test_a_new_process_hydrates_from_l2_and_continues_bitwise(small_pkg, small_path, tmp_path):
    gen = torch.Generator().manual_seed(21)
    prompt, more = random_tokens(gen, 301), random_tokens(gen, 80)
    session = small_pkg.session(slots=1, max_rows=1)
    with PrefixCache(small_pkg, l2_dir=tmp_path / "l2", write_behind=False) as cache:
        row = Decoder(session, prefix_cache=cache).prefill(0, prompt)
        assert cache.stats_dict()["l2"]["writes"] == 1
    want = continue_slot(session, 0, more)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": prompt, "more": more}))
    out = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, str(CHILD), "roundtrip", str(small_path), str(tmp_path / "l2"),
                           str(request), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["stats"]["exact_hits"] == 1 and report["stats"]["prefill_tokens_saved"] == 301
    assert report["pending"] == row.pending
    got = safetensors.torch.load_file(str(out))
    assert all(torch.equal(got[f"out{i}"], w) for i, w in enumerate(want))

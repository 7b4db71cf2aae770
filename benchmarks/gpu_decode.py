"""The shipped model (dsv41-mini) decoded on a device, against what the CPU decoded:

    python benchmarks/gpu_decode.py PACKAGE --device cpu --write-expect EXPECT.json [--quick] [--expect-only]
    python benchmarks/gpu_decode.py PACKAGE --device cuda --expect EXPECT.json [--out REPORT.json]

The CPU run fixes the workload and writes it with its results (the expectations): four
prompts (the package's tokenizer over examples/demo_prompt.jsonl and three short code and
prose texts) x 64 new tokens, speculative and greedy token ids, each token's margin (the
top-2 logit gap behind it), tokens per step, and the first prompt's prefill logits. A run
given `--expect` decodes that same workload and reports one row per question:

* session open: seconds to open the session (on CUDA: the graph session, every bucket
  warmed up and captured, an eager one that runs each step directly, and one with the
  Engram tables in host memory);
* graph = eager tokens [CUDA]: CUDA graphs change nothing;
* CUDA = CPU tokens [CUDA]: equal up to the first near tie, a position whose CPU margin is
  under 8x the measured logit error (the largest |CUDA - CPU| prefill logit of the first
  prompt), where float rounding may legitimately pick the other token;
* speculative = greedy: token for token, as the op set's row invariance promises;
* tokens per step vs CPU [CUDA]: the drafter is accepted as often (ratio);
* tokens/s graph vs eager [CUDA]: what capture buys, both measured in this run;
* prefix L1 hit = cold prefill: a prompt resumed from an L1 snapshot (runtime/prefix/cache.py)
  has bitwise the cold prefill's logits;
* host Engram tables = device tables: the same tokens and prefill logits;
* quantized weights inside the graphs: the FP8/FP4 linears and FP8 Engram lookups of every
  replayed pass read the quantized tensors the session bound on its device;
* b12x serve request = engine: a `b12x serve PACKAGE --device DEV` child on a loopback port
  answers one request through the official `openai` client with the engine's tokens.

A row is pass, FAIL or "not run" (rows marked [CUDA] on a CPU device); a check that raises
is a FAIL row naming it, and the others still run. The table goes to stdout and, with
`--out`, the rows as JSON (rewritten after every row, so a run stopped by a timeout keeps
what it finished). Runtime imports only: nothing of the exporter is loaded in this process
(the server child is `b12x serve`, the command line's module), so a machine whose torch
cannot export still runs it. The eager session needs no runtime hook: a capture backend
that records each step as it is (session/capture.py RecordingCapture) runs it directly.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the benchmarks package beside it
    sys.path.insert(0, str(ROOT))
EXPECT_FORMAT = 1
NEW_TOKENS, QUICK_PROMPTS, QUICK_TOKENS = 64, 2, 16
NEAR_TIE = 8.0  # a CPU margin under this many logit errors may flip on another device
MIN_STEP_RATIO = 0.9  # tokens per step on the device against the CPU's
TIMED_ROUNDS = 2  # graph / eager decode rounds each, alternating
SERVE_START_S = {"cpu": 120.0, "cuda": 150.0}  # a CUDA server captures every bucket first
TEXTS = (
    json.loads((ROOT / "examples" / "demo_prompt.jsonl").read_text().splitlines()[0])["prompt"],
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n',
    "    for index, line in enumerate(lines):\n        if not line.strip():\n",
    "The standard library's modules are documented in the reference manual; this one reads",
)
ROWS = ("session open", "graph = eager tokens", "CUDA = CPU tokens (to the first near tie)", "speculative = greedy",
        "tokens per step vs CPU", "tokens/s graph vs eager", "prefix L1 hit = cold prefill",
        "host Engram tables = device tables", "quantized weights inside the graphs", "b12x serve request = engine")
CUDA_ONLY = {"graph = eager tokens", "CUDA = CPU tokens (to the first near tie)", "tokens per step vs CPU",
             "tokens/s graph vs eager"}


class Skip(Exception):
    """A row that cannot run here (a CUDA-only question on a CPU device): "not run"."""


# ---------------------------------------------------------------- report


class Report:
    def __init__(self, out: Path | None, environment: dict):
        self.out, self.environment, self.rows = out, environment, []
        self.started = time.perf_counter()

    def add(self, check: str, result: str, figure: str = "", detail: str = "") -> None:
        self.rows.append({"check": check, "result": result, "figure": figure, "detail": detail})
        print(f"[{result}] {check}: {figure} {detail}".rstrip(), flush=True)
        self.write()

    def run(self, check: str, fn) -> None:
        """One row: fn() -> (ok, figure, detail); Skip -> "not run"; anything raised -> FAIL."""
        try:
            ok, figure, detail = fn()
        except Skip as why:
            self.add(check, "not run", "", str(why))
        except Exception as error:  # a qualification reports every failure, not the first
            traceback.print_exc()
            first = str(error).splitlines()[0] if str(error) else ""
            self.add(check, "FAIL", "raised", f"{type(error).__name__}: {first}"[:300])
        else:
            self.add(check, "pass" if ok else "FAIL", figure, detail)

    def write(self) -> None:
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        body = {"environment": self.environment, "seconds": round(time.perf_counter() - self.started, 1),
                "rows": self.rows}
        self.out.write_text(json.dumps(body, indent=2))

    def table(self) -> str:
        return markdown_table(self.rows, ("check", "result", "figure", "detail"))


def markdown_table(rows: list[dict], columns: tuple[str, ...]) -> str:
    cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def environment(device: str) -> dict:
    """gpu_check's versions and device, and where the project was imported from: an installed
    copy or a checkout mapped by path."""
    import b12x_toolchain
    from benchmarks.gpu_check import environment as versions

    return versions(device) | {"import_root": str(Path(b12x_toolchain.__file__).parent)}


# ---------------------------------------------------------------- workload and decoding


def workload(package, quick: bool) -> dict:
    prompts = [package.tokenizer.encode(text) for text in TEXTS]
    count, tokens = (QUICK_PROMPTS, QUICK_TOKENS) if quick else (len(prompts), NEW_TOKENS)
    return {"texts": list(TEXTS[:count]), "prompts": prompts[:count], "new_tokens": tokens}


def decode(session, prompts: list[list[int]], new_tokens: int, speculative: bool) -> dict:
    """Every prompt in one engine, decoded together (greedy), with what each token rested on."""
    from b12x_toolchain.runtime.serving.engine import Engine
    from b12x_toolchain.runtime.serving.requests import Request

    engine = Engine(session, speculative=speculative)
    states = engine.generate([Request(list(p), new_tokens) for p in prompts])
    stats = engine.stats.as_dict()
    return {"tokens": [s.tokens for s in states], "margins": [s.margins for s in states],
            "tokens_per_step": stats["tokens_per_step"], "tokens_per_second": stats["decode_tokens_per_second"]}


def prefill_logits(session, prompt: list[int], slot: int = 0) -> torch.Tensor:
    """float32 [len(prompt), vocab] on the CPU: the prompt prefilled chunk by chunk into an
    emptied `slot`, as the engine prefills it; the slot is handed back after."""
    session.reset_slot(slot)
    logits = prefill_into(session, slot, prompt)
    session.retire_slot(slot)
    return logits


def prefill_into(session, slot: int, tokens: list[int], start: int = 0) -> torch.Tensor:
    """Prefill `tokens` into `slot` from position `start` (the slot holds `start` tokens): every
    position's logits, float32 on the CPU. The slot keeps what it holds."""
    chunk = session.package.passes["prefill"].width
    logits = []
    for offset in range(0, len(tokens), chunk):
        piece = tokens[offset : offset + chunk]
        out = session.replay("prefill", token_ids=[piece + [0] * (chunk - len(piece))], slot_ids=[slot],
                             positions=[start + offset], new_tokens=[len(piece)])
        logits.append(out["logits"][0, : len(piece)].float().cpu().clone())  # the next replay reuses out
    return torch.cat(logits)


def tensor_json(t: torch.Tensor) -> dict:
    data = t.contiguous().to(torch.float32).numpy().astype("<f4").tobytes()
    return {"shape": list(t.shape), "float32_base64": base64.b64encode(data).decode("ascii")}


def tensor_from_json(obj: dict) -> torch.Tensor:
    data = bytearray(base64.b64decode(obj["float32_base64"]))
    return torch.frombuffer(data, dtype=torch.float32).reshape(obj["shape"]).clone()


# ---------------------------------------------------------------- the run's shared state


class Run:
    """What the rows share, made on first use: sessions, decodes, prefill logits. A part that
    raised raises again for every row that needs it (each row then names itself)."""

    def __init__(self, package_path: Path, device: str, expect: dict | None, quick: bool):
        from b12x_toolchain.runtime import load

        self.path, self.device, self.expect = package_path, device, expect
        self.package = load(package_path)
        if expect is not None and expect["abi"] != self.package.abi_fingerprint:
            raise ValueError(f"the expectations are of ABI {expect['abi']}, the package is "
                             f"{self.package.abi_fingerprint}: prepare them from this package")
        self.work = {k: expect[k] for k in ("texts", "prompts", "new_tokens")} if expect else workload(self.package, quick)
        self.slots = max(2, len(self.work["prompts"]))  # the prefix row uses two slots
        self._made: dict = {}
        self.open_seconds: dict[str, float] = {}

    def made(self, key, make):
        if key not in self._made:
            try:
                self._made[key] = (True, make())
            except Exception as error:
                self._made[key] = (False, error)
        ok, value = self._made[key]
        if not ok:
            raise RuntimeError(f"{key} failed earlier: {type(value).__name__}: {value}") from value
        return value

    def _open(self, label: str, **options):
        start = time.perf_counter()
        session = self.package.session(device=self.device, slots=self.slots, **options)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.open_seconds[label] = time.perf_counter() - start
        return session

    def session(self, label: str = "graph"):
        """graph: the device's default (CUDA graphs on CUDA); eager: each step run directly,
        through a capture backend that records the step itself (session/capture.py); host:
        the default with the Engram tables in pinned host memory."""
        from b12x_toolchain.runtime.session.capture import RecordingCapture

        options = {"graph": {}, "eager": {"capture": RecordingCapture()}, "host": {"engram_tables": "host"}}[label]
        return self.made(("session", label), lambda: self._open(label, **options))

    def decoded(self, label: str, speculative: bool) -> dict:
        return self.made(("decode", label, speculative), lambda: decode(
            self.session(label), self.work["prompts"], self.work["new_tokens"], speculative))

    def prefill(self, label: str) -> torch.Tensor:
        return self.made(("prefill", label), lambda: prefill_logits(self.session(label), self.work["prompts"][0]))

    def needs_cuda(self) -> None:
        if self.device != "cuda":
            raise Skip("CUDA only")
        if self.expect is None:
            raise Skip("no CPU expectations given (--expect)")

    def expectations(self) -> dict:
        """The CPU's results of this workload, to write with --write-expect."""
        return {"format": EXPECT_FORMAT, "package": self.package.path.name, "abi": self.package.abi_fingerprint,
                "torch": torch.__version__, **self.work,
                "speculative": self.decoded("graph", True), "greedy": self.decoded("graph", False),
                "prefill_logits": tensor_json(self.prefill("graph"))}


# ---------------------------------------------------------------- rows


def session_open(run: Run):
    run.session("graph")
    if run.device == "cuda":
        run.session("eager"), run.session("host")
        seconds = run.open_seconds
        return True, f"graph {seconds['graph']:.1f} s, eager {seconds['eager']:.1f} s, host tables {seconds['host']:.1f} s", \
            (f"{run.slots} slots; graph and host tables: every bucket of every pass warmed up and captured, "
             "eager: warmed up only; the first to open (graph) also compiled the Triton kernels")
    return True, f"{run.open_seconds['graph']:.1f} s", f"{run.slots} slots, no capture on the CPU"


def graph_vs_eager_tokens(run: Run):
    run.needs_cuda()
    graph, eager = run.decoded("graph", True)["tokens"], run.decoded("eager", True)["tokens"]
    same = sum(g == e for g, e in zip(graph, eager))
    return same == len(graph), f"{same}/{len(graph)} prompts", "speculative tokens, CUDA graphs vs each step run directly"


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def near_tie(margins: list[float], error: float) -> int | None:
    """The first position whose CPU margin another device's rounding could overturn."""
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE * error), None)


def tokens_vs_cpu(run: Run):
    run.needs_cuda()
    cpu_logits = tensor_from_json(run.expect["prefill_logits"])
    error = (run.prefill("graph") - cpu_logits).abs().max().item()
    if error != error:  # NaN: nothing below compares
        return False, "logit error NaN", "the device's prefill logits hold NaN"
    ok, parts = True, []
    for mode, speculative in (("speculative", True), ("greedy", False)):
        device = run.decoded("graph", speculative)["tokens"]
        cpu = run.expect[mode]
        verdicts = []
        for i, (got, want, margins) in enumerate(zip(device, cpu["tokens"], cpu["margins"])):
            diff, tie = first_difference(got, want), near_tie(margins, error)
            fine = diff is None or (tie is not None and diff >= tie)
            ok &= fine
            where = "equal" if diff is None else f"differs at {diff}"
            verdicts.append(f"p{i} {where}" + (f" (near tie at {tie})" if tie is not None else "")
                            + ("" if fine else " BEFORE any near tie"))
        parts.append(f"{mode}: " + ", ".join(verdicts))
    return ok, f"logit error {error:.2e}", "; ".join(parts)


def speculative_vs_greedy(run: Run):
    spec, greedy = run.decoded("graph", True)["tokens"], run.decoded("graph", False)["tokens"]
    same = sum(s == g for s, g in zip(spec, greedy))
    firsts = [first_difference(s, g) for s, g in zip(spec, greedy)]
    detail = "token for token" if same == len(spec) else f"first differences at {firsts}"
    return same == len(spec), f"{same}/{len(spec)} prompts", f"{run.work['new_tokens']} new tokens each, {detail}"


def steps_vs_cpu(run: Run):
    run.needs_cuda()
    device, cpu = run.decoded("graph", True)["tokens_per_step"], run.expect["speculative"]["tokens_per_step"]
    ratio = device / cpu
    return ratio >= MIN_STEP_RATIO, f"{ratio:.3f}x", \
        f"CUDA {device:.2f}, CPU {cpu:.2f} tokens per speculative step (needs {MIN_STEP_RATIO}x or more)"


def rates_graph_vs_eager(run: Run):
    """Decode tokens/s of both sessions over the same workload, in alternating rounds after
    the first decode of each (which compiled and warmed everything): the medians' ratio."""
    run.needs_cuda()
    run.decoded("graph", True), run.decoded("eager", True)
    rates = {"graph": [], "eager": []}
    for round_no in range(TIMED_ROUNDS):
        for label in (("graph", "eager") if round_no % 2 == 0 else ("eager", "graph")):
            result = decode(run.session(label), run.work["prompts"], run.work["new_tokens"], True)
            rates[label].append(result["tokens_per_second"])
    graph, eager = statistics.median(rates["graph"]), statistics.median(rates["eager"])
    return graph > eager, f"{graph / eager:.2f}x", f"graph {graph:,.0f} tokens/s, eager {eager:,.0f} tokens/s (decode, speculative)"


def prefix_prompts(package) -> tuple[list[int], list[int], int]:
    """Two prompts sharing their first prefill chunk, then different tails: the second resumes
    from the snapshot the first leaves at the chunk's end."""
    chunk = package.passes["prefill"].width
    stream = []
    while len(stream) < chunk + 12:
        stream += [t for text in TEXTS for t in package.tokenizer.encode(text)]
    return stream[: chunk + 5], stream[: chunk] + stream[chunk + 5 : chunk + 12], chunk


def prefix_hit(run: Run):
    """A snapshot is stored where a chunk ends, so a prefill resumed from it replays the cold
    prefill's chunks exactly: the logits must be bitwise equal (runtime/prefix/cache.py)."""
    from b12x_toolchain.runtime.prefix.cache import PrefixCache

    session = run.session("graph")
    first, second, chunk = prefix_prompts(run.package)
    cache = PrefixCache(run.package, l1_bytes=64 << 20, every=chunk, end_of_prompt=False)
    if not cache.enabled:
        return False, "snapshots off", cache.reason
    # The first request stores its first chunk from the slot that holds exactly it, as the
    # engine does at a boundary, then goes on writing its own pages.
    session.reset_slot(0)
    stored = prefill_into(session, 0, first[:chunk])[-1]
    cache.store(session, 0, first[:chunk], stored)
    prefill_into(session, 0, first[chunk:], start=chunk)
    session.retire_slot(0)
    session.reset_slot(1)
    hit = cache.restore(session, 1, second)
    if hit is None:
        return False, "miss", f"no L1 hit for a prompt sharing its first {chunk} tokens"
    resumed = prefill_into(session, 1, second[hit.length :], start=hit.length)[-1]
    session.retire_slot(1)
    cold = prefill_logits(session, second, slot=1)[-1]
    same = torch.equal(resumed, cold)
    return same and hit.tier == "l1", f"{hit.tier} hit of {hit.length} tokens", \
        ("last-position logits bitwise equal to a cold prefill" if same
         else f"logits differ by up to {(resumed - cold).abs().max().item():.2e}")


def host_tables(run: Run):
    host = run.session("host")
    tables = run.package.manifest.weights.engram_tables
    pinned = [name for name in tables if host.weights[name].device.type == "cpu" and run.device == "cuda"
              and host.weights[name].is_pinned()]
    same_tokens = run.decoded("host", True)["tokens"] == run.decoded("graph", True)["tokens"]
    same_logits = torch.equal(run.prefill("host"), run.prefill("graph"))
    where = f"{len(pinned)}/{len(tables)} table tensors pinned in host memory" if run.device == "cuda" \
        else "on a CPU device both places are the same memory"
    return same_tokens and same_logits and (run.device != "cuda" or len(pinned) == len(tables)), \
        f"tokens {'equal' if same_tokens else 'differ'}, logits {'equal' if same_logits else 'differ'}", where


QUANTIZED = {"fp8_block_linear": "weight", "fp4_expert_linear": "weight", "engram_lookup": "table"}
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)  # FP8 values; FP4 pairs packed in bytes


def _source(node):
    """The placeholder a weight argument is read from, through views and slices."""
    while node.op == "call_function":
        node = node.args[0]
    return node


def quantized_nodes(session) -> tuple[dict, list[str]]:
    """Per pass, the count of each quantized op's nodes in the graph the session replays, and
    what is wrong with the tensors they read (not quantized, or not where the session runs)."""
    from b12x_toolchain.runtime.ops.opset import OPS

    counts, problems = {}, []
    for pass_name, buckets in session.buckets.items():
        bucket = buckets[min(buckets)]  # every bucket runs the same graph module on its own buffers
        module = bucket.graph
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        bound = dict(zip(placeholders, bucket.args))
        counts[pass_name] = dict.fromkeys(QUANTIZED, 0)
        for node in module.graph.nodes:
            op = next((name for name in QUANTIZED if node.op == "call_function" and node.target == OPS[name]), None)
            if op is None:
                continue
            counts[pass_name][op] += 1
            names = [a.name for a in OPS[op]._schema.arguments]
            tensor = bound.get(_source(dict(zip(names, node.args))[QUANTIZED[op]]))
            if tensor is None or tensor.dtype not in QUANTIZED_DTYPES:
                problems.append(f"{pass_name}: {op} reads {None if tensor is None else tensor.dtype}")
            elif tensor.device != session.device and not (op == "engram_lookup" and tensor.is_pinned()):
                problems.append(f"{pass_name}: {op} reads a tensor on {tensor.device}")
        if session.graphs.captures and session.graphs.graph(pass_name, bucket.rows) is None:
            problems.append(f"{pass_name}: no captured graph")
    return counts, problems


def quantized_inside(run: Run):
    session = run.session("graph")
    counts, problems = quantized_nodes(session)
    totals = {op: sum(c[op] for c in counts.values()) for op in QUANTIZED}
    present = all(totals.values())
    figure = ", ".join(f"{op} {n}" for op, n in totals.items()) + " nodes"
    where = "in the captured CUDA graphs" if session.graphs.captures else "in the graphs run directly"
    detail = "; ".join(problems[:3]) or (f"every one reads quantized weights on {session.device}, {where}; per pass: "
                                         + ", ".join(f"{p} {sum(c.values())}" for p, c in counts.items()))
    return present and not problems, figure, detail


# ---------------------------------------------------------------- b12x serve


def serve_command(run: Run) -> list[str]:
    """`b12x serve`, through the module the console script runs (no install needed)."""
    return [sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(run.path), "--device", run.device,
            "--port", "0", "--slots", str(run.slots), "--threads", str(torch.get_num_threads())]


def wait_for_url(process, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"at (http://\S+)/v1", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise RuntimeError(f"b12x serve did not start in {timeout:.0f} s (exit {process.poll()}): {' / '.join(tail)}")


def stop(process) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve_request(run: Run):
    import openai

    prompt, new_tokens = run.work["prompts"][0], run.work["new_tokens"]
    want = run.decoded("graph", True)["tokens"][0]
    eos = run.package.tokenizer.eos_id
    if eos in want:  # the server stops at the tokenizer's end of sequence; the engine was not asked to
        want = want[: want.index(eos) + 1]
    with tempfile.TemporaryDirectory(prefix="b12x-serve-") as tmp:
        log = Path(tmp) / "serve.log"
        start = time.perf_counter()
        with open(log, "w") as stderr:
            process = subprocess.Popen(serve_command(run), stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            url = wait_for_url(process, log, SERVE_START_S[run.device])
            ready = time.perf_counter() - start
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            answer = client.completions.create(model=run.path.name.removesuffix(".b12x"), prompt=prompt,
                                               max_tokens=new_tokens, temperature=0)
        finally:
            stop(process)
    got = list(answer.choices[0].token_ids)
    diff = first_difference(got, want)
    return diff is None, f"{len(got)} tokens", \
        (f"equal to the engine's; server ready in {ready:.1f} s" if diff is None
         else f"first difference at {diff} of {len(want)} (finish_reason {answer.choices[0].finish_reason})")


CHECKS = {
    "session open": session_open,
    "graph = eager tokens": graph_vs_eager_tokens,
    "CUDA = CPU tokens (to the first near tie)": tokens_vs_cpu,
    "speculative = greedy": speculative_vs_greedy,
    "tokens per step vs CPU": steps_vs_cpu,
    "tokens/s graph vs eager": rates_graph_vs_eager,
    "prefix L1 hit = cold prefill": prefix_hit,
    "host Engram tables = device tables": host_tables,
    "quantized weights inside the graphs": quantized_inside,
    "b12x serve request = engine": serve_request,
}
assert tuple(CHECKS) == ROWS


# ---------------------------------------------------------------- main


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path, help="the exported dsv41-mini package (NAME.b12x)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--expect", type=Path, help="the CPU's expectations (--write-expect of a CPU run): "
                                                    "their workload is decoded and compared")
    parser.add_argument("--write-expect", type=Path, help="CPU only: write this run's results as expectations")
    parser.add_argument("--expect-only", action="store_true", help="with --write-expect: write them and stop")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_PROMPTS} prompts x {QUICK_TOKENS} tokens (without --expect; a test's dry run)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.write_expect and args.device != "cpu":
        parser.error("--write-expect: expectations come from a CPU run")
    if args.expect_only and not args.write_expect:
        parser.error("--expect-only needs --write-expect")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    expect = json.loads(args.expect.read_text()) if args.expect else None
    report = Report(args.out, environment(args.device))
    try:
        run = Run(args.package, args.device, expect, args.quick)
    except Exception as error:
        report.add("package", "FAIL", "raised", f"{type(error).__name__}: {error}"[:300])
        print(report.table())
        return 1
    if args.write_expect:
        args.write_expect.parent.mkdir(parents=True, exist_ok=True)
        args.write_expect.write_text(json.dumps(run.expectations()))
        print(f"wrote {args.write_expect}: {len(run.work['prompts'])} prompts x {run.work['new_tokens']} tokens",
              flush=True)
        if args.expect_only:
            return 0
    for check, fn in CHECKS.items():
        report.run(check, lambda fn=fn: fn(run))
    print()
    print(report.table())
    failed = [row["check"] for row in report.rows if row["result"] == "FAIL"]
    print(f"\n{sum(r['result'] == 'pass' for r in report.rows)} passed, {len(failed)} failed, "
          f"{sum(r['result'] == 'not run' for r in report.rows)} not run in {time.perf_counter() - report.started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

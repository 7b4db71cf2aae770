"""Peak resident memory of loading a package, against the bytes of the weights it stores.

A `dsv41-tiny` variant wide enough that its weights dominate (hidden 1024, experts of 2048,
vocabulary 8192: 291 MiB in the V4.1 release's formats, 1.8 GiB as fp32) is exported twice,
quantized and as its fp32 twin (quantized_recipes.py). Each sample is a fresh process
(`python -m benchmarks.load_memory PACKAGE`) that imports torch and the runtime, resets its
peak-RSS mark (/proc/self/clear_refs), then runs `load()` and `package.session(slots=1)`;
the peak (VmHWM) minus the RSS after the imports is what loading cost. Every row's baseline
is the stored weight bytes, so ratio = peak increase / weight bytes: 1 would be the weights
alone. What a session adds beside the weights (graphs, caches, allocator slack) does not
grow with them: it is the fixed allowance the README states.

The quantized and fp32 children run in alternating rounds, at most ROUNDS whatever --repeat
says (peak memory hardly varies from run to run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.quantized_recipes import exported, twins
from benchmarks.registry import Measurement, Settings, benchmark, compare_counts

ROOT = Path(__file__).resolve().parent.parent
MARK = "load_memory: "
ROUNDS = 3
MIB = 1 << 20
WIDE = {"model.hidden_size": 1024, "model.vocab_size": 8192, "model.moe.experts": 8,
        "model.moe.intermediate_size": 2048, "model.draft.moe.experts": 8, "model.draft.moe.intermediate_size": 2048}


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Make VmHWM restart from the current RSS (Linux 4.0+); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _measure(package: str) -> dict:
    """What one child reports: bytes, relative to its RSS once everything is imported."""
    import torch

    torch.set_num_threads(1)
    from b12x_toolchain.runtime import load
    from b12x_toolchain.runtime.session import session as _session  # noqa: F401  (its imports are not loading)

    reset = _reset_peak()
    base = _status("VmRSS")
    loaded = load(package)
    after_load = _status("VmHWM")
    session = loaded.session(slots=1)
    weights = loaded.weights.values()
    return {"rss_after_imports": base, "load_peak": after_load - base, "session_peak": _status("VmHWM") - base,
            "rss_after_session": _status("VmRSS") - base, "weight_bytes": sum(t.nbytes for t in weights),
            "weight_buffers": len({t.untyped_storage().data_ptr() for t in weights}),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in weights}),
            "peak_was_reset": reset, "slots": session.slots}


def child(package: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", str(package)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"load_memory {package.name}: child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def measure(packages: dict[str, Path], rounds: int) -> list[Measurement]:
    """packages: label -> path, each measured `rounds` times in alternating order."""
    samples = {label: [] for label in packages}
    for i in range(rounds):
        for label in list(packages) if i % 2 == 0 else reversed(packages):
            samples[label].append(child(packages[label]))
    rows = []
    for label, runs in samples.items():
        weights = runs[0]["weight_bytes"] / MIB
        for phase, what in (("load_peak", "load()"), ("session_peak", "load() + session")):
            peaks = [run[phase] / MIB for run in runs]
            peak = statistics.median(peaks)
            params = {"package": packages[label].name, "rounds": rounds, "over_weights_mib": peak - weights,
                      **{k: runs[-1][k] for k in ("weight_buffers", "dtypes", "peak_was_reset")},
                      "rss_after_imports_mib": statistics.median(r["rss_after_imports"] / MIB for r in runs)}
            rows.append(Measurement("load_memory.peak", f"{label}, {what}", "MiB", "stored weight bytes",
                                    "peak RSS increase", weights, peak, peak / weights, params, [weights], peaks))
    first, *others = samples
    for label in others:  # every other package's weight bytes against the first's
        rows.append(compare_counts("load_memory.weight_bytes", f"{label} / {first}", samples[first][0]["weight_bytes"],
                                   samples[label][0]["weight_bytes"], "B", first, label))
    return rows


@benchmark("load_memory")
def run(settings: Settings) -> list[Measurement]:
    quantized, fp32 = twins(WIDE, "dsv41-wide")
    with tempfile.TemporaryDirectory(prefix="b12x-load-memory-") as scratch:
        folder = Path(settings.exports or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        packages = {"fp32 twin": exported(fp32, folder), "quantized": exported(quantized, folder)}
        return measure(packages, min(settings.repeat, ROUNDS))


if __name__ == "__main__":  # one child process: python -m benchmarks.load_memory PACKAGE
    print(MARK + json.dumps(_measure(sys.argv[1])), flush=True)

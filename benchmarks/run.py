"""Run the registered benchmarks, print a table of ratios and write every measurement as JSON.

    python benchmarks/run.py [--only NAME] [--json PATH] [--repeat N] [--warmup N] [--threads N]

Every module in this folder is imported so that its `@benchmark` functions register
themselves; a new benchmark is a new module, with no list here to update.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script, only this folder is on the path; `benchmarks.*` needs its parent
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.registry import REGISTRY, Settings  # noqa: E402

DEFAULT_JSON = HERE / "results" / "latest.json"
NOT_BENCHMARKS = {"run", "registry"}


def discover() -> dict:
    for info in pkgutil.iter_modules([str(HERE)]):
        if info.name not in NOT_BENCHMARKS:
            importlib.import_module(f"benchmarks.{info.name}")
    return dict(sorted(REGISTRY.items()))


def cpus_available() -> int:
    # The CPUs this process may run on, which can be fewer than the machine has.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    # Other work on the machine is the main source of noise; recorded so a reader can judge it.
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus_available": cpus_available(),
        "torch_threads": torch.get_num_threads(),
    }


def format_value(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:g} {unit}"


def table(measurements: list) -> Table:
    out = Table(title="b12x benchmarks (ratio = candidate / baseline)")
    for name, justify in (("benchmark", "left"), ("case", "left"), ("baseline", "right"),
                          ("candidate", "right"), ("ratio", "right")):
        out.add_column(name, justify=justify)
    for m in measurements:
        out.add_row(m.benchmark, m.case, format_value(m.baseline, m.unit), format_value(m.candidate, m.unit),
                    format_ratio(m.ratio))
    return out


def format_ratio(ratio: float) -> str:
    # Byte counts can differ by orders of magnitude: a tiny ratio keeps its digits.
    return f"{ratio:.3f}" if ratio == 0 or abs(ratio) >= 0.01 else f"{ratio:.2e}"


def run(benchmarks: dict, names: list[str], settings: Settings, console: Console) -> list:
    measurements = []
    for name in names:
        started = time.perf_counter()
        with console.status(f"running {name}"):
            measurements += benchmarks[name](settings)
        console.print(f"{name}: {time.perf_counter() - started:.1f} s", style="dim")
    return measurements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="NAME", action="append",
                        help="run only this benchmark (may be given more than once)")
    parser.add_argument("--json", metavar="PATH", type=Path, default=DEFAULT_JSON,
                        help="where to write the measurements (default: benchmarks/results/latest.json)")
    parser.add_argument("--repeat", metavar="N", type=int, default=Settings.repeat,
                        help=f"timed baseline/candidate rounds per case (default {Settings.repeat})")
    parser.add_argument("--warmup", metavar="N", type=int, default=Settings.warmup,
                        help=f"untimed rounds before timing (default {Settings.warmup})")
    parser.add_argument("--threads", metavar="N", type=int,
                        help="torch intra-op threads (default: torch's own choice); on a machine busy with "
                             "other work, 1 avoids threads waiting on each other and steadies the timings")
    parser.add_argument("--packages", metavar="PKG", type=Path, nargs=2,
                        help="replay: reuse these fused and unfused packages of its recipe instead of exporting them")
    parser.add_argument("--exports", metavar="DIR", type=Path,
                        help="context_scaling, paged_memory, prefix_hit_ttft: export their recipe variants into DIR, "
                             "reusing those already there")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        parser.error("--repeat and --threads must be at least 1, --warmup at least 0")

    # Check names before any benchmark runs: a typo should not cost a full run first.
    known = discover()
    names = args.only or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(known)}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Piped output would otherwise wrap at 80 columns and split every row in two.
    console = Console(width=None if sys.stdout.isatty() else 120)
    load_before = load_average()
    settings = Settings(repeat=args.repeat, warmup=args.warmup,
                        packages=tuple(args.packages) if args.packages else None, exports=args.exports)
    measurements = run(known, names, settings, console)
    console.print(table(measurements))

    report = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "environment": environment(),
        "load_average": {"before": load_before, "after": load_average()},
        "settings": {"repeat": settings.repeat, "warmup": settings.warmup},
        "benchmarks": names,
        "measurements": [m.to_json() for m in measurements],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    shown = args.json.resolve()
    console.print(f"wrote {shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

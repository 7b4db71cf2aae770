#!/usr/bin/env bash
# Every GPU question of the CUDA path in one prepared run (benchmarks/README.md, "gpu_qualify.sh").
#
#   benchmarks/gpu_qualify.sh prepare OUT [--no-wheels] [--python-version X.Y] [--quick]
#                                         [--mini PKG] [--tiny-fused PKG] [--tiny-unfused PKG]
#   benchmarks/gpu_qualify.sh run OUT [--device cuda|cpu] [--quick]
#
# prepare runs here, on a CPU machine with the project installed (its torch exports):
#   - exports dsv41-mini from checkpoints/dsv41-mini (fused, as `make demo` does) into
#     OUT/packages/mini, and the tiny recipe fused and unfused into OUT/packages/tiny/{fused,unfused}
#     (for gpu_check.py --packages); --mini/--tiny-* copy packages exported already instead;
#   - writes the CPU's expectations, OUT/expect.json (gpu_decode.py --device cpu --write-expect):
#     4 prompts x 64 new tokens, or 2 x 16 with --quick;
#   - carries the tiny packages' shared weights once (run puts the copy back);
#   - downloads into OUT/wheels the wheels a GPU machine may lack (WHEELS below, pinned to the
#     versions installed here, the ones the tests ran), one binary build per package for
#     --python-version (default 3.12; give the GPU machine's own: the C extensions among them,
#     pydantic-core, jiter and markupsafe, install on that version only). --no-wheels skips it.
# Carry OUT to the GPU machine with the checkout (nothing there is fetched from a network).
#
# run runs on the GPU machine from that checkout, as it is (no `pip install -e`: the
# project's torch floor is above what such a machine may have; the runtime loads packages
# on its torch, only exporting needs the newer one):
#   - installs the carried wheels its Python does not already have at the very same version
#     into OUT/site (pip --no-index --target), and maps the import root as
#     pyproject.toml's package-dir does (links in OUT/src); both go on PYTHONPATH;
#   - runs gpu_decode.py --device DEV --expect OUT/expect.json, then gpu_check.py --packages,
#     each under `timeout` (their JSON is rewritten as they go: a part stopped by its timeout
#     keeps the rows it finished);
#   - writes OUT/qualify.md: the device, driver, torch and Triton versions, then one table of
#     every row of both parts (and the kernels' roofline), also printed.
# Expected time on one H100 or H200: wheels and imports ~15 s; gpu_decode ~2.5 min (the
# mini model's Triton kernels compile on first use, ~1 min; three sessions capture or warm up
# every bucket; decoding is seconds; a `b12x serve` child captures its own, its kernels now
# cached on disk); gpu_check ~3.5 min (its kernel groups, bandwidth and sparse timing took
# 118 s on the last H200 run; its sessions part, never finished there, ~1-1.5 min). Each part
# has a timeout (DECODE_TIMEOUT 210 s, CHECK_TIMEOUT 240 s; set either in the environment to
# change it), so the whole run stays under 8 minutes, leaving time for a second try.
# `run OUT --device cpu --quick` runs the same here in under a minute on two idle cores
# (CUDA-only rows "not run"), as the test suite does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DECODE_TIMEOUT="${DECODE_TIMEOUT:-210}"
CHECK_TIMEOUT="${CHECK_TIMEOUT:-240}"
# What `b12x serve`, the text codec, the package reader and the official client need beyond
# torch, with their own needs (tokenizers' hub client is left out: nothing here downloads).
# WHEELS set in the environment replaces the list (to leave out what the GPU machine is known to have).
WHEELS="${WHEELS:-fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
typing-extensions annotated-doc opentelemetry-api anyio idna sniffio h11 click prometheus-client tokenizers
safetensors rich markdown-it-py mdurl pygments jinja2 markupsafe openai jiter httpx httpcore httpx2 httpcore2
certifi truststore}"
SHARED_WEIGHTS=WEIGHTS_ARE_FUSED  # marker: the unfused package's weights were carried once, as the fused one's

usage() { sed -n '4,6p' "$0" | sed 's/^#   //' >&2; exit 2; }
say() { echo "gpu_qualify: $*" >&2; }

# ---------------------------------------------------------------- prepare

copy_or_export() {  # DEST_DIR GIVEN_PKG EXPORT_ARGS...: one package in DEST_DIR
    local dest="$1" given="$2"; shift 2
    rm -rf "$dest" && mkdir -p "$dest"
    if [[ -n "$given" ]]; then
        cp -R "$given" "$dest/"
    else
        "$PY" -m b12x_toolchain.exporter.cli.main export --out "$dest" "$@" >/dev/null
    fi
}

carry_weights_once() {  # OUT: the tiny packages share their weights' bytes; carry them once
    local fused unfused
    fused="$(echo "$1"/packages/tiny/fused/*.b12x)" unfused="$(echo "$1"/packages/tiny/unfused/*.b12x)"
    if cmp -s "$fused/weights.safetensors" "$unfused/weights.safetensors"; then
        rm "$unfused/weights.safetensors"
        touch "$1/packages/tiny/unfused/$SHARED_WEIGHTS"
    fi
}

restore_weights() {  # OUT: undo carry_weights_once (the package's own hashes check the copy)
    local fused unfused
    fused="$(echo "$1"/packages/tiny/fused/*.b12x)" unfused="$(echo "$1"/packages/tiny/unfused/*.b12x)"
    if [[ -f "$1/packages/tiny/unfused/$SHARED_WEIGHTS" && ! -f "$unfused/weights.safetensors" ]]; then
        cp "$fused/weights.safetensors" "$unfused/weights.safetensors"
    fi
}

pinned_wheels() {  # each of WHEELS as name==version installed here (name alone if it is not)
    "$PY" - $WHEELS <<'EOF'
import importlib.metadata as md
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(name)
EOF
}

download_wheels() {  # OUT PYTHON_VERSION
    local wheels="$1/wheels" version="$2"
    rm -rf "$wheels" && mkdir -p "$wheels"
    # --no-deps over an explicit list: no resolver, so it is quick and the same every time.
    # shellcheck disable=SC2046
    "$PY" -m pip download -q --only-binary=:all: --no-deps -d "$wheels" --python-version "$version" \
        --implementation cp --abi "cp${version/./}" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        $(pinned_wheels)
    say "$(ls "$wheels" | wc -l) wheels for Python $version, $(du -sh "$wheels" | cut -f1) in $wheels"
}

prepare() {
    local out="$1"; shift
    local mini="" fused="" unfused="" wheels=1 version=3.12 quick=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --mini) mini="$(realpath "$2")"; shift 2 ;;
            --tiny-fused) fused="$(realpath "$2")"; shift 2 ;;
            --tiny-unfused) unfused="$(realpath "$2")"; shift 2 ;;
            --no-wheels) wheels=0; shift ;;
            --python-version) version="$2"; shift 2 ;;
            --quick) quick="--quick"; shift ;;
            *) usage ;;
        esac
    done
    mkdir -p "$out"
    copy_or_export "$out/packages/mini" "$mini" --recipe dsv41-mini --checkpoint "$ROOT/checkpoints/dsv41-mini"
    copy_or_export "$out/packages/tiny/fused" "$fused" --recipe dsv41-tiny
    copy_or_export "$out/packages/tiny/unfused" "$unfused" --recipe dsv41-tiny --no-fuse
    carry_weights_once "$out"
    "$PY" "$ROOT/benchmarks/gpu_decode.py" "$out"/packages/mini/*.b12x --device cpu \
        --write-expect "$out/expect.json" --expect-only $quick
    if [[ $wheels == 1 ]]; then download_wheels "$out" "$version"; fi
    say "prepared $out ($(du -sh "$out" | cut -f1)); carry it with the checkout and run: $0 run $out --device cuda"
}

# ---------------------------------------------------------------- run

install_wheels() {  # OUT: the carried wheels this Python lacks, into OUT/site
    local out="$1"
    [[ -d "$out/wheels" ]] || { say "no wheels carried: using this Python's packages"; return 0; }
    local missing
    missing="$("$PY" - "$out/wheels" <<'EOF'
import importlib.metadata as md
import sys
from pathlib import Path

wanted = set()
for wheel in Path(sys.argv[1]).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    # Only the very version is skipped: the carried wheels are the set the tests ran, and one
    # older or newer here can break it (pydantic needs typing-inspection >= 0.4.4 and exactly
    # its own pydantic-core); installed into OUT/site they come first on the path.
    if have != version:
        wanted.add(f"{name}=={version}")
print(" ".join(sorted(wanted)))
EOF
)"
    if [[ -z "$missing" ]]; then say "every carried wheel is installed already"; return 0; fi
    say "installing into $out/site: $missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$out/site" \
        --find-links "$out/wheels" $missing
}

import_root() {  # OUT: OUT/src/<import root> -> this checkout's folders, as pyproject maps them
    "$PY" - "$ROOT" "$1/src" <<'EOF'
import sys
import tomllib
from pathlib import Path

root, src = Path(sys.argv[1]), Path(sys.argv[2])
mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
top = min(mapping, key=len)  # the import root; the others are its sub-packages
(src / top).mkdir(parents=True, exist_ok=True)
for package, folder in mapping.items():
    link = src / top / "__init__.py" if package == top else src / Path(*package.split("."))
    target = root / folder / "__init__.py" if package == top else root / folder
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
EOF
}

driver() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
    else
        echo "none (no nvidia-smi)"
    fi
}

part() {  # NAME LIMIT_S LOG COMMAND...: run one part under its timeout; records "NAME rc seconds"
    local name="$1" limit="$2" log="$3"; shift 3
    local start=$SECONDS rc=0
    say "$name (timeout ${limit}s)"
    timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1 || rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$OUT_DIR/parts.txt"
    tail -n 3 "$log" >&2
}

report() {  # OUT DEVICE: OUT/qualify.md from both parts' JSON
    "$PY" - "$1" "$2" "$(driver)" <<'EOF'
import json
import sys
from pathlib import Path

out, device, driver = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
parts = {name: (int(rc), int(s)) for name, rc, s in (l.split() for l in (out / "parts.txt").read_text().splitlines())}
rows, env, roof = [], {}, []

def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")

def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None

decode = load("decode")
if decode:
    env.update(decode["environment"])
    rows += [("decode", r["check"], r["result"], r["figure"], r["detail"]) for r in decode["rows"]]
check = load("check")
if check:
    env.update({k: v for k, v in check["environment"].items() if k not in env})
    for c in check["checks"]:
        result = {True: "pass", False: "FAIL", None: "info"}[c["ok"]]
        r = c.get("roofline")
        figure = f"{r['fraction']:.0%} of floor" if r else ""
        rows.append(("check", c["name"], result, figure, c["detail"]))
        if r:
            roof.append((c["name"], r))
for name in ("decode", "check"):
    rc, seconds = parts.get(name, (None, 0))
    if rc == 124 or rc == 137:
        rows.append((name, "(part)", "FAIL", f"timed out after {seconds} s", "rows above are those it finished"))
    elif rc not in (0, 1):
        rows.append((name, "(part)", "FAIL", f"exit {rc}", f"see {name}.log"))
    if load(name) is None:
        rows.append((name, "(part)", "FAIL", "no report", f"exit {rc}; see {name}.log"))

counts = {k: sum(r[2] == k for r in rows) for k in ("pass", "FAIL", "not run", "info")}
lines = ["# GPU qualification", "",
         f"- device: {env.get('gpu', device)} (capability {env.get('capability', '-')}, CUDA {env.get('cuda', '-')}), "
         f"driver: {driver}",
         f"- torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, Python {env.get('python', '?')}",
         "- parts: " + ", ".join(f"{n} {s} s (exit {rc})" for n, (rc, s) in parts.items()),
         f"- rows: {counts['pass']} pass, {counts['FAIL']} FAIL, {counts['not run']} not run, {counts['info']} info",
         "", "| part | check | result | figure | detail |", "|---|---|---|---|---|"]
lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
if roof:
    lines += ["", f"Roofline (peaks: {roof[0][1]['peaks']}): floor = max(bytes / bandwidth, FLOPs / dot rate)", "",
              "| kernel | measured | bytes | FLOPs | floor | floor/measured | bound |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['seconds'] * 1e6:.1f} us | {r['bytes']:.3g} | {r['flops']:.3g} | "
              f"{r['floor_seconds'] * 1e6:.2f} us | {r['fraction']:.1%} | {r['bound']} |" for n, r in roof]
(out / "qualify.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(1 if counts["FAIL"] else 0)
EOF
}

run() {
    local out="$1"; shift
    local device=cuda quick=""
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --device) device="$2"; shift 2 ;;
            --quick) quick="--quick"; shift ;;
            *) usage ;;
        esac
    done
    [[ -f "$out/expect.json" ]] || { say "$out/expect.json is missing: run prepare first"; exit 2; }
    OUT_DIR="$(realpath "$out")"
    rm -f "$OUT_DIR"/parts.txt "$OUT_DIR"/decode.json "$OUT_DIR"/check.json "$OUT_DIR"/qualify.md
    install_wheels "$OUT_DIR"
    import_root "$OUT_DIR"
    restore_weights "$OUT_DIR"
    export PYTHONPATH="$OUT_DIR/src:$OUT_DIR/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    cd "$ROOT"
    part decode "$DECODE_TIMEOUT" "$OUT_DIR/decode.log" "$PY" benchmarks/gpu_decode.py \
        "$OUT_DIR"/packages/mini/*.b12x --device "$device" --expect "$OUT_DIR/expect.json" --out "$OUT_DIR/decode.json"
    part check "$CHECK_TIMEOUT" "$OUT_DIR/check.log" "$PY" benchmarks/gpu_check.py --device "$device" \
        --packages "$OUT_DIR/packages/tiny" --json "$OUT_DIR/check.json" $quick
    report "$OUT_DIR" "$device"
}

[[ $# -ge 2 ]] || usage
verb="$1" out="$2"; shift 2
case "$verb" in
    prepare) prepare "$out" "$@" ;;
    run) run "$out" "$@" ;;
    *) usage ;;
esac

"""The background compilation's own process: compile a session's buckets into the local cache.

A server compiling on a thread of its own would hold the interpreter for Inductor's Python
half of the time and share its cores with the C++ builds: measured with the shipped model's
`b12x run` on two cores, 4.5 tokens/s instead of 19 while it compiled, and an interpreter torn
down under a running compilation aborts at exit. So the compiling is done here, in a child
process at the lowest priority that dies with its parent: it opens the package with the
parent session's exact shapes (slots, rows, page counts, passes), compiles every bucket into
the cache and writes the set's record (background_compile.py). The parent then loads the
graphs from the cache, seconds of its own time, and swaps them in.

The parent writes what to open as JSON on the child's stdin; nothing from the package is run.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def session_spec(session) -> dict | None:
    """What a child needs to open `session`'s twin, or None where it cannot (a package without
    a folder, or whose weights were bound from elsewhere)."""
    package = session.package
    if package.path is None or package.external_weights or package.mapping is not None:
        return None
    return {"package": str(package.path), "device": str(session.device), "slots": session.slots,
            "max_rows": session.max_rows, "pages": {p: pool.count for p, pool in session.pools.items()},
            "contiguous": session.pages.contiguous, "passes": list(session.buckets),
            "compile": list(session.compiled_passes), "cache": str(session.compile_cache.parent.parent)}


def _die_with_parent() -> None:
    os.nice(19)
    try:  # Linux: SIGTERM when the parent goes away
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_child(spec: dict) -> tuple[int, str]:
    """Compile in a child process; (its exit status, the end of what it wrote to stderr)."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
    child = subprocess.run([sys.executable, "-m", "b12x_toolchain.runtime.session.compile_worker"],
                           input=json.dumps(spec), capture_output=True, text=True, env=env,
                           preexec_fn=_die_with_parent)
    return child.returncode, child.stderr[-2000:]


def main() -> None:
    from b12x_toolchain.runtime import load

    spec = json.loads(sys.stdin.read())
    session = load(spec["package"]).session(
        device=spec["device"], slots=spec["slots"], max_rows=spec["max_rows"], pages=spec["pages"],
        contiguous=spec["contiguous"], passes=spec["passes"], compile=tuple(spec["compile"]),
        compile_cache=spec["cache"], compile_in_background="here")
    if session.compiler.error is not None:
        sys.exit(session.compiler.error)


if __name__ == "__main__":
    main()

"""The torch releases the runtime supports, in one place, and how a torch version string is read.

The runtime builds and replays graphs through torch APIs that change between releases
(graph_loader.py), so it names the releases it supports: a package exported with a torch
outside them (its manifest's `versions.torch`, written by exporter/pipeline/export.py), or a
running torch outside them, is refused at load by name, before a graph is built, not at its
first graph build with an error about torch's internals.
"""

from __future__ import annotations

import re

import torch

from b12x_toolchain.runtime.errors import PackageError

# (major, minor): from the lowest supported release up to, not including, the first that is not.
# 2.11 is the oldest torch the runtime builds graphs on (graph_enums.py says what it lacks);
# 2.16 and later are not supported until the runtime has been checked on them.
SUPPORTED = ((2, 11), (2, 16))
RANGE = f"torch >= {SUPPORTED[0][0]}.{SUPPORTED[0][1]}, < {SUPPORTED[1][0]}.{SUPPORTED[1][1]}"

# MAJOR.MINOR at the start, whatever follows: a patch, a local build (+cpu, +cu130), a
# pre-release (a0, rc1) or a nightly (.dev20260101). A nightly of a release counts as it.
_RELEASE = re.compile(r"(\d+)\.(\d+)(?!\d)")


def release(version) -> tuple[int, int]:
    """(major, minor) of a torch version string, or a PackageError naming the string."""
    match = _RELEASE.match(version) if isinstance(version, str) else None
    if match is None:
        raise PackageError(f"torch version {str(version)[:80]!r} is not of the form MAJOR.MINOR[.PATCH][+LOCAL]")
    return int(match[1]), int(match[2])


def supported(version) -> bool:
    """Whether torch `version` is in the supported range."""
    return SUPPORTED[0] <= release(version) < SUPPORTED[1]


def running_torch() -> str:
    """The running torch's version string (read at each call: tests stand in other releases)."""
    return str(torch.__version__)


def check_package_torch(recorded, where: str = "manifest.json") -> None:
    """Refuse a package whose recorded torch, or the running torch, is outside the supported range.

    `recorded` is the manifest's versions.torch; every message names it, the running torch and the range."""
    running = running_torch()
    if not supported(running):
        raise PackageError(f"this is torch {running}, which this runtime does not support ({RANGE}); "
                           f"the package was exported with torch {recorded}")
    if recorded is None:
        raise PackageError(f"{where}: versions.torch is missing: the torch the package was exported with "
                           f"must be recorded ({RANGE}); running torch {running}")
    try:
        inside = supported(recorded)
    except PackageError as exc:
        raise PackageError(f"{where}: versions.torch: {exc}; running torch {running}") from None
    if not inside:
        raise PackageError(f"{where}: versions.torch {recorded} is outside the torch releases this runtime loads "
                           f"packages of ({RANGE}); running torch {running}: export it again with a torch in range")

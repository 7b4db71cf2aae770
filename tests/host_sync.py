"""A guard that makes every host-device synchronisation raise, for tests on the CPU.

On a GPU, `.item()`, `.tolist()`, `bool()`, `int()`/`float()` of a tensor, `.cpu()`,
`.numpy()` and `nonzero` wait for the device; on the CPU they cost nothing, so a sync left
in the serving path would go unnoticed here. Inside the guard each of them raises, on any
tensor, with two exceptions:

- the graph itself (GraphRunner.replay): on CUDA it is one captured-graph launch, which runs
  no host code (capture fails on a sync), while on the CPU it runs the ops' references;
- `transfers.download`, the one transfer an engine step may make: it is counted instead.

`allow` names source files whose host code works on data already downloaded (sampling.py's
draws over fetched distributions): calls made from them are let through.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from b12x_toolchain.runtime.serving import executor as executor_module
from b12x_toolchain.runtime.session import transfers
from b12x_toolchain.runtime.session.graph_runner import GraphRunner

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero")


_INHERITED = object()  # a patched name the class did not define itself


class HostSync(AssertionError):
    """A sync-like call where the serving path must not wait for the device."""


class Guard:
    def __init__(self, allow: tuple[str, ...] = ()):
        self.allow, self.suspended = allow, 0
        self.downloads = 0  # transfers.download calls made inside the guard
        self.replays = 0  # graph replays run inside the guard

    def _allowed(self) -> bool:
        if self.suspended:
            return True
        caller = Path(sys._getframe(2).f_code.co_filename).name
        return caller in self.allow

    def _wrap(self, name: str, original):
        def guarded(*args, **kwargs):
            if not self._allowed():
                raise HostSync(f"Tensor.{name} called inside a replay or engine step")
            return original(*args, **kwargs)
        return guarded

    def _suspending(self, original, counter: str):
        def suspended(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            self.suspended += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.suspended -= 1
        return suspended


@contextmanager
def no_host_sync(allow: tuple[str, ...] = ()):
    """Yield a Guard; every sync-like call inside raises HostSync (see the module's docstring)."""
    guard = Guard(allow)
    patches = [(torch.Tensor, name, guard._wrap(name, getattr(torch.Tensor, name))) for name in SYNC_METHODS]
    patches.append((torch, "nonzero", guard._wrap("nonzero", torch.nonzero)))
    patches.append((GraphRunner, "replay", guard._suspending(GraphRunner.replay, "replays")))
    download = guard._suspending(transfers.download, "downloads")
    patches += [(transfers, "download", download), (executor_module, "download", download)]
    saved = [(owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield guard
    finally:
        for owner, name, value in saved:
            if value is _INHERITED:
                delattr(owner, name)  # the class's own attribute goes; the inherited one shows again
            else:
                setattr(owner, name, value)

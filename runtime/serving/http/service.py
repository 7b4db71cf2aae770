"""What one server holds: the package, its session and engine, the prefix cache, the text codec,
the engine loop and the metrics — built from the `b12x serve` options (the engine from the
same EngineOptions `b12x run` and the loader API use), closed in order.

The session and its engine are built on the engine loop's thread (engine_loop.py), which
replays them: CUDA graphs, the current device and the current stream are per thread. A
session that cannot open (a device torch cannot use, memory that does not hold it) raises
its error from Service(...), before the server listens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from b12x_toolchain.runtime.serving.http.engine_loop import EngineLoop
from b12x_toolchain.runtime.serving.http.metrics import ServerMetrics
from b12x_toolchain.runtime.serving.http.protocol import Limits
from b12x_toolchain.runtime.serving.options import EngineOptions, open_engine, open_prefix_cache
from b12x_toolchain.runtime.serving.ranks import RankContext


@dataclass
class ServeOptions:
    package: str
    engine: EngineOptions = field(default_factory=EngineOptions)  # what run and the loader API build from too
    model_name: str | None = None
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body must arrive within this; a trickled one gets 408
    header_timeout_s: float = 30.0  # a request's headers must arrive within this, or the connection closes


class Service:
    def __init__(self, options: ServeOptions, rank: RankContext | None = None):
        """rank: rank 0 of a parallel package, whose other ranks follow its engine (ranks.py)."""
        from b12x_toolchain.runtime import load
        from b12x_toolchain.runtime.session.device import session_device

        self.options, self.rank = options, rank
        self.started = time.time()
        self.on_failure = None  # called with the error once the engine failed (the server sets it)
        # Checked first, and here: a bare "cuda" is the caller's current device, not the loop thread's.
        self.device = session_device(options.engine.device)
        self.package = load(options.package) if rank is None else \
            load(options.package, rank=rank.rank, peer_timeout=rank.join_timeout_s)
        model = self.package.manifest.model
        self.limits = Limits(model.vocab_size, model.max_seq_len)
        self.model_name = options.model_name or Path(options.package).name.removesuffix(".b12x")
        self.codec = self.package.tokenizer
        self.prefix_cache = open_prefix_cache(self.package, options.engine, None if rank is None else rank.rank)
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(self._open_engine, self.metrics, options.max_queue, self._failed)
        try:
            self.loop.start()  # builds the engine on the loop thread: _open_engine
        except BaseException:
            if self.prefix_cache is not None:
                self.prefix_cache.close()
            raise
        self.engine = self.loop.engine
        self.session = self.engine.session
        self._closed = False

    def _open_engine(self):
        """The session and its engine; runs on the engine loop's thread, which replays them."""
        from b12x_toolchain.runtime.session.device import make_current

        make_current(self.device)  # CUDA: this thread's device, where its captures and replays launch
        return open_engine(self.package, replace(self.options.engine, device=str(self.device)), self.prefix_cache,
                           channel=None if self.rank is None else self.rank.channel)

    def _failed(self, error: str) -> None:
        if self.on_failure is not None:
            self.on_failure(error)

    def close(self, grace_seconds: float = 0.0) -> None:
        """Stop the engine loop (cancelling what still runs) and write the L2 prefix cache out."""
        if self._closed:
            return
        self._closed = True
        if self.session.compiler is not None:
            self.session.compiler.stop()  # no further pass graph: the server is going away
        self.loop.stop(timeout=max(grace_seconds, 1.0) + 30.0)
        if self.rank is not None and self.loop.engine is not None:
            self.loop.engine.session.stop()  # the other ranks' loops return
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # waits for queued snapshots to reach the directory

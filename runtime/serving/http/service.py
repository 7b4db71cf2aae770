"""What one server holds: the package, its session and engine, the prefix cache, the text codec,
the engine loop and the metrics — built from the `b12x serve` options, closed in order.

The session and its engine are built on the engine loop's thread (engine_loop.py), which
replays them: CUDA graphs, the current device and the current stream are per thread. A
session that cannot open (a device torch cannot use, memory that does not hold it) raises
its error from Service(...), before the server listens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from b12x_toolchain.runtime.serving.http.codec import load_codec
from b12x_toolchain.runtime.serving.http.engine_loop import EngineLoop
from b12x_toolchain.runtime.serving.http.metrics import ServerMetrics
from b12x_toolchain.runtime.serving.http.protocol import Limits

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


@dataclass
class ServeOptions:
    package: str
    model_name: str | None = None
    device: str = "cpu"
    slots: int | None = None  # default: the largest verify rows bucket
    pages: int | None = None
    cache_bytes: int | None = None
    speculative: bool = True
    temperature: float = 0.0  # for requests that set none (OpenAI's default is 1; ours decodes greedily)
    top_p: float = 1.0
    seed: int = 0
    prefix_cache_dir: str | None = None
    prefix_cache_bytes: int | None = None  # alone, enables the in-memory tier
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body must arrive within this; a trickled one gets 408
    header_timeout_s: float = 30.0  # a request's headers must arrive within this, or the connection closes
    capture: object = None  # how the session captures each bucket (session/capture.py); default by device


class Service:
    def __init__(self, options: ServeOptions):
        from b12x_toolchain.runtime import load
        from b12x_toolchain.runtime.prefix.cache import PrefixCache
        from b12x_toolchain.runtime.session.device import session_device

        self.options = options
        self.started = time.time()
        # Checked first, and here: a bare "cuda" is the caller's current device, not the loop thread's.
        self.device = session_device(options.device)
        self.package = load(options.package)
        model = self.package.manifest.model
        self.limits = Limits(model.vocab_size, model.max_seq_len)
        self.model_name = options.model_name or Path(options.package).name.removesuffix(".b12x")
        self.codec = load_codec(self.package)
        self.prefix_cache = None
        if options.prefix_cache_dir is not None or options.prefix_cache_bytes is not None:
            budget = options.prefix_cache_bytes or DEFAULT_PREFIX_CACHE_BYTES
            self.prefix_cache = PrefixCache(self.package, l1_bytes=budget, l2_dir=options.prefix_cache_dir,
                                            l2_bytes=budget)
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(self._open_engine, self.metrics, options.max_queue)
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
        from b12x_toolchain.runtime.serving.engine import Engine, passes_used
        from b12x_toolchain.runtime.session.device import make_current

        options = self.options
        make_current(self.device)  # CUDA: this thread's device, where its captures and replays launch
        slots = options.slots or self.package.passes["verify"].rows_buckets[-1]
        session = self.package.session(device=self.device, slots=slots, pages=options.pages,
                                       cache_bytes=options.cache_bytes, capture=options.capture,
                                       passes=passes_used(self.package.passes, options.speculative))
        return Engine(session, speculative=options.speculative, temperature=options.temperature,
                      top_p=options.top_p, seed=options.seed, prefix_cache=self.prefix_cache)

    def close(self, grace_seconds: float = 0.0) -> None:
        """Stop the engine loop (cancelling what still runs) and write the L2 prefix cache out."""
        if self._closed:
            return
        self._closed = True
        self.loop.stop(timeout=max(grace_seconds, 1.0) + 30.0)
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # waits for queued snapshots to reach the directory

"""Running the app on uvicorn, and stopping it gracefully.

SIGTERM (or `shutdown()`) first stops admitting — new requests get 503 while the socket
still answers — then waits up to `grace_seconds` for running requests to finish, cancels
what is left, and only then lets uvicorn close. The service is closed last, which writes
queued prefix snapshots to the L2 directory, so a restart on it hits them. A second
signal stops at once.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from b12x_toolchain.runtime.serving.http.app import create_app
from b12x_toolchain.runtime.serving.http.header_deadline import header_deadline_protocol

CLOSE_CONNECTIONS_S = 5.0  # after the grace period: for finished responses to reach their clients
# A parallel package's server whose engine failed (a rank is gone) answers 503 this long, so a
# health check sees why, then stops (the process exits non-zero and a supervisor restarts the group).
FAILED_LINGER_S = 2.0


BACKLOG = 2048  # uvicorn's default


def bind(host: str, port: int) -> socket.socket:
    """A listening socket: connections made before uvicorn's loop runs wait in its backlog
    instead of being refused, so the URL is usable as soon as it is printed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off only on sockets that name TCP,
    # and with it on, each response after the first on a kept-alive connection waits ~40 ms
    # for the client's delayed ACK (streamed tokens bunch up the same way).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn, with its signal handler replaced by ours. Unlike uvicorn's, it does not raise
    the signal again once serving has stopped, which would end the process before the
    service is closed (and the L2 prefix cache written out)."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()


class Server:
    def __init__(self, service, host: str = "127.0.0.1", port: int = 8000, grace_seconds: float = 30.0,
                 log_level: str = "warning"):
        self.service, self.grace_seconds = service, grace_seconds
        self.socket = bind(host, port)
        self.address: tuple[str, int] = self.socket.getsockname()[:2]  # the port bound, when 0 was asked
        config = uvicorn.Config(create_app(service), log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=CLOSE_CONNECTIONS_S,
                                http=header_deadline_protocol(lambda: service.options.header_timeout_s))
        self.uvicorn = _Uvicorn(config, self._exit)
        self._draining = False
        self._thread: threading.Thread | None = None
        self._failed_at: float | None = None
        if service.rank is not None:
            service.on_failure = self._failed

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def run(self) -> None:
        """Serve until shut down (SIGTERM, SIGINT, or `shutdown()`); then close the service."""
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.service.close(self.grace_seconds)

    def start(self, timeout: float = 60.0) -> "Server":
        """Serve from a thread (tests, benchmarks); returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.run, name="b12x-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self, wait: bool = True) -> None:
        """What SIGTERM does (nothing more once the server has stopped)."""
        if not self._draining:
            self.uvicorn.handle_exit(None, None)
        if wait and self._thread is not None:
            self._thread.join()

    def _exit(self) -> None:
        if self._draining:  # a second signal: stop now (a failed server stops soon anyway)
            if self._failed_at is None:
                self.uvicorn.should_exit = self.uvicorn.force_exit = True
            return
        self._draining = True
        self.service.loop.drain()
        threading.Thread(target=self._drain, name="b12x-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_seconds
        while self.service.loop.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.service.loop.stop()  # cancels what did not finish in time
        if self._failed_at is not None:
            time.sleep(max(0.0, self._failed_at + FAILED_LINGER_S - time.monotonic()))
        self.uvicorn.should_exit = True

    def _failed(self, error: str) -> None:
        """The engine of a parallel package failed: answer 503 for a moment, then stop."""
        self._failed_at = time.monotonic()
        threading.Thread(target=self._exit, name="b12x-failed", daemon=True).start()

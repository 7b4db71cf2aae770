"""The server's socket listens from the moment it is bound: `b12x serve` prints its URL before
uvicorn's loop runs, and a client that connects in between must wait, not be refused."""

from __future__ import annotations

import socket

from b12x_toolchain.runtime.serving.http.server import bind


def test_a_client_connecting_before_the_loop_runs_is_not_refused():
    listening = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(listening.getsockname()[:2], timeout=5) as connection:
            accepted, _ = listening.accept()  # what uvicorn does once it runs
            connection.sendall(b"ping")
            assert accepted.recv(4) == b"ping"
            accepted.close()
    finally:
        listening.close()

"""The server each client module drives: `b12x serve` of the shipped model, its exchanges recorded."""

from __future__ import annotations

import pytest

from clients.serving import start_recorded_server


@pytest.fixture(scope="module")
def served(shipped_path):
    server, recorder = start_recorded_server(shipped_path)
    yield server, recorder
    server.shutdown()

"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's headers.

uvicorn closes a kept-alive connection that stays silent, but any byte resets that timer
and nothing bounds how long a request's headers may take: a client trickling them, a
byte every few seconds, would hold its connection for ever. Here every request's headers
(the first on a connection, and each next one after a response) must be whole within the
deadline, or the connection is closed. Nothing reaches the engine before a request's
headers and body are whole (body.py bounds the body), so a slow client never holds a slot.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_deadline_protocol(timeout_s) -> type:
    """An H11Protocol class whose requests' headers must arrive within timeout_s() seconds
    (read as each wait starts, so a running server's option can change)."""

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # first: a pipelined request found below disarms it
            super().on_response_complete()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers were whole
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s(), self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.conn.send(h11.ConnectionClosed())
                self.transport.close()

    return HeaderDeadline

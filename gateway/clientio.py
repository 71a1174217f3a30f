"""Writing an answer to a client that may never read it.

A write to the client returns once aiohttp's buffer for it has drained below its high-water
mark, so a client that stops reading suspends the handler inside the write: the node is
throttled behind it (`gateway.nodeclient.PAUSE_READING_BYTES`), memory stays bounded, but
the task stays `released`, its KV reservation held and its lease renewed by this live
gateway, for as long as the client keeps its socket open. Each write therefore gets the
patience the gateway gives a silent node (`gateway.upstream_timeout_ms`): a client that takes
nothing for that long is dropped and its request ends as if it had left (the node aborted,
the tenant charged what was generated).
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class ClientStalled(ConnectionResetError):
    """The client took none of the answer for the whole patience: it was dropped."""


class StallGuard:
    """Writes one streamed answer, dropping a client that takes none of it for `patience_s`.

    A timeout around every write would cost more than relaying the chunk (about 5 µs each, on
    every token of every stream); instead one timer per answer looks at the write in progress
    and re-arms itself, so a write costs a clock reading. A client found stalled is dropped
    (its transport aborted): the write in progress fails, or the handler is cancelled where
    aiohttp cancels handlers of lost connections, both taken as the client gone.
    """

    __slots__ = ("_loop", "_patience", "_request", "_since", "_timer", "stalled")

    def __init__(self, request: web.Request, patience_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._request = request
        self._patience = patience_s
        self._since: float | None = None
        self.stalled = False
        self._timer = self._loop.call_later(patience_s, self._check)

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        self._since = self._loop.time()
        try:
            await response.write(data)
        except ConnectionResetError:
            if self.stalled:
                raise ClientStalled(self._message()) from None
            raise
        finally:
            self._since = None
        if self.stalled:
            raise ClientStalled(self._message())

    def close(self) -> None:
        self._timer.cancel()

    def _message(self) -> str:
        return f"the client read nothing for {self._patience:g} s"

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._patience:
            self.stalled = True
            if self._request.transport is not None:
                self._request.transport.abort()
            return
        due = since + self._patience if since is not None else now + self._patience
        self._timer = self._loop.call_at(due, self._check)


async def end_within(request: web.Request, response: web.StreamResponse,
                     patience_s: float) -> None:
    """`response.prepare` (when not sent yet) then `write_eof`, or the client dropped after
    `patience_s` without progress: once per answer, so a timeout is cheap enough here."""
    try:
        async with asyncio.timeout(patience_s):
            if not response.prepared:
                await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        raise _drop(request, patience_s) from None


def _drop(request: web.Request, patience_s: float) -> ClientStalled:
    if request.transport is not None:
        request.transport.abort()
    return ClientStalled(f"the client read nothing for {patience_s:g} s")

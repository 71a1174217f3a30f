"""Raw asyncio servers over loopback that play misbehaving inference nodes (a node that closes
a kept-alive connection, breaks off, goes quiet, or answers what no HTTP client should hold):
an aiohttp server cannot send such answers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request off the connection, head and `Content-Length` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
"""A whole answer of two bytes that keeps the connection."""


async def answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """Read one request and answer it with `OK`; returns the request."""
    request = await read_request(reader)
    writer.write(OK)
    await writer.drain()
    return request

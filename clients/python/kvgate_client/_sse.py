"""Minimal server-sent-events reader for OpenAI-style streams (`data: {...}` ... `data: [DONE]`).

`[DONE]` is what tells a whole answer from one cut short: a body that ends cleanly without it
(a proxy's limit, a gateway stopping mid-stream) raises IncompleteStreamError after the events
it did carry, rather than passing for a finished answer.

Lines are split on the body's bytes, on CR, LF or CRLF only, as the SSE grammar says. A text
splitter such as httpx's `iter_lines` (str.splitlines) also breaks on U+2028, U+2029, U+0085
and a few control characters; JSON may carry the first three unescaped inside a string, and
neither vLLM's serializer nor orjson escapes them, so a token holding one would cut its event
in two.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator

from .errors import IncompleteStreamError

DONE = "[DONE]"
_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = "\ufeff"


class LineSplitter:
    """Bytes in any pieces to lines; a line ends at CR, LF or CRLF (CRLF split across two
    pieces included). A line ended by a CR is returned at once, not when more bytes come."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._skip_lf = False
        self._first = True

    def feed(self, data: bytes) -> list[str]:
        if not data:  # an empty piece between a CR and its LF must not forget the CR
            return []
        if self._skip_lf and data[:1] == b"\n":
            data = data[1:]
        self._skip_lf = data[-1:] == b"\r"
        lines: list[str] = []
        start = 0
        # Only the new bytes are searched: what is pending holds no line end.
        for match in _EOL.finditer(data):
            self._pending += data[start:match.start()]
            lines.append(self._line())
            start = match.end()
        self._pending += data[start:]
        return lines

    def flush(self) -> list[str]:
        return [self._line()] if self._pending else []

    def _line(self) -> str:
        # CR and LF never occur inside a multi-byte UTF-8 sequence, so each line decodes alone.
        line = self._pending.decode("utf-8", "replace")
        self._pending.clear()
        if self._first:
            self._first = False
            line = line.removeprefix(_BOM)
        return line


class SSEDecoder:
    """Feeds on lines, returns the `data` of each complete event (multi-line data joined)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None  # a comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        return self.feed("")


def _events(decoder: SSEDecoder, lines: Iterable[str]) -> Iterator[str | None]:
    """Each event's data; None once the stream said [DONE]."""
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield None if data == DONE else data


def iter_events(chunks: Iterator[bytes], *, request_id: str | None = None) -> Iterator[str]:
    """The data of each event of a body read in byte chunks, up to `[DONE]`; raises
    IncompleteStreamError (naming `request_id`) if the body ends before it."""
    splitter, decoder = LineSplitter(), SSEDecoder()
    for piece in chunks:
        for data in _events(decoder, splitter.feed(piece)):
            if data is None:
                return
            yield data
    for data in _events(decoder, [*splitter.flush(), ""]):
        if data is None:
            return
        yield data
    raise IncompleteStreamError(request_id=request_id)


async def aiter_events(chunks: AsyncIterator[bytes], *,
                       request_id: str | None = None) -> AsyncIterator[str]:
    splitter, decoder = LineSplitter(), SSEDecoder()
    async for piece in chunks:
        for data in _events(decoder, splitter.feed(piece)):
            if data is None:
                return
            yield data
    for data in _events(decoder, [*splitter.flush(), ""]):
        if data is None:
            return
        yield data
    raise IncompleteStreamError(request_id=request_id)

"""Minimal server-sent-events reader for OpenAI-style streams (`data: {...}` ... `data: [DONE]`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

DONE = "[DONE]"


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


def iter_events(lines: Iterator[str]) -> Iterator[str]:
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            if data == DONE:
                return
            yield data
    data = decoder.flush()
    if data is not None and data != DONE:
        yield data


async def aiter_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            if data == DONE:
                return
            yield data
    data = decoder.flush()
    if data is not None and data != DONE:
        yield data

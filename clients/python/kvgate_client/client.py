"""A small standalone client (sync and async) for chat and completions, streaming included.

For code that does not use the `openai` SDK. Responses are the server's JSON as dicts. The
retries happen in the transport, before a response is returned: a stream is retried only while
no byte of its body has reached the caller. A stream is returned only once its response says
it is one (Content-Type text/event-stream), and it ends in an error, not quietly, if its body
stops before `data: [DONE]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import httpx

from ._sse import aiter_events, iter_events
from .budget import RetryBudget
from .errors import (
    REQUEST_ID_HEADER,
    APIConnectionError,
    APIStatusError,
    InvalidResponseError,
    StreamError,
    status_error,
)
from .policy import RetryPolicy
from .proxies import async_transport, sync_transport
from .retrying import RetryStats
from .transport import AsyncRetryTransport, RetryTransport

DEFAULT_BASE_URL = "http://localhost:8080/v1"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
DEFAULT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
EVENT_STREAM = "text/event-stream"
NOT_A_STREAM_PREFIX = 64 << 10
"""How much of a 2xx body that is no event stream is read for InvalidResponseError: enough to
tell a proxy's page; a server that ignored `stream` may be sending a whole answer, or more."""

Message = Mapping[str, Any]
Chunk = dict[str, Any]


def _api_key(api_key: str | None) -> str | None:
    return api_key or os.environ.get("KVGATE_API_KEY") or os.environ.get("OPENAI_API_KEY")


def _base_url(base_url: str | None) -> str:
    return base_url or os.environ.get("KVGATE_BASE_URL") or DEFAULT_BASE_URL


def _headers(api_key: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"accept": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    headers.update(extra or {})
    return headers


def _json_object(response: httpx.Response) -> Chunk:
    try:
        result = response.json()
    except ValueError:
        result = None
    if not isinstance(result, dict):
        raise InvalidResponseError(response.status_code, response.text, response.headers)
    return result


def _media_type(response: httpx.Response) -> str:
    content_type: str = response.headers.get("content-type", "")
    return content_type.partition(";")[0].strip().lower()


def _not_a_stream(response: httpx.Response, prefix: bytes) -> InvalidResponseError:
    content_type = response.headers.get("content-type")
    return InvalidResponseError(
        response.status_code, prefix.decode("utf-8", "replace"), response.headers,
        expected=f"an event stream (Content-Type {content_type!r})")


def _error(response: httpx.Response) -> APIStatusError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return status_error(response.status_code, body, response.headers)


def _chunk(data: str, response: httpx.Response) -> Chunk:
    request_id = response.headers.get(REQUEST_ID_HEADER)
    try:
        chunk = json.loads(data)
    except ValueError:
        # Not the server's JSON (a proxy's page, a cut event): a KvgateError like the rest.
        raise StreamError(data, request_id=request_id) from None
    if not isinstance(chunk, dict):
        raise StreamError(chunk, request_id=request_id)
    # OpenAI-compatible servers may send "error": null in a normal chunk: only a value is one.
    if chunk.get("error") is not None:
        raise StreamError(chunk["error"], request_id=request_id)
    return chunk


def _chat_body(model: str, messages: Sequence[Message], stream: bool, params: Any) -> Chunk:
    return {"model": model, "messages": [dict(m) for m in messages], **params, "stream": stream}


def _completion_body(model: str, prompt: str | list[str], stream: bool, params: Any) -> Chunk:
    return {"model": model, "prompt": prompt, **params, "stream": stream}


class Stream:
    """Parsed chunks of a streaming response; close it (or use `with`) if you stop early."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    def __iter__(self) -> Iterator[Chunk]:
        request_id = self.response.headers.get(REQUEST_ID_HEADER)
        try:
            for data in iter_events(self.response.iter_bytes(), request_id=request_id):
                yield _chunk(data, self.response)
        except httpx.RequestError as exc:
            raise APIConnectionError(f"stream interrupted: {exc!r}") from exc
        finally:
            self.response.close()

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream:
    """Async counterpart of Stream."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        request_id = self.response.headers.get(REQUEST_ID_HEADER)
        try:
            async for data in aiter_events(self.response.aiter_bytes(), request_id=request_id):
                yield _chunk(data, self.response)
        except httpx.RequestError as exc:
            raise APIConnectionError(f"stream interrupted: {exc!r}") from exc
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class KvgateClient:
    """Sync client. `base_url` defaults to $KVGATE_BASE_URL, then `DEFAULT_BASE_URL` (a local
    gateway on its default port); `api_key` to $KVGATE_API_KEY, then $OPENAI_API_KEY."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        retry_transport: RetryTransport | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        limits: httpx.Limits | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if retry_transport is None:
            inner = sync_transport(limits if limits is not None else DEFAULT_LIMITS)
            retry_transport = RetryTransport(inner, policy=policy, budget=budget)
        elif policy is not None or budget is not None:
            raise TypeError("pass either retry_transport or policy/budget, not both")
        self.transport = retry_transport
        self._http = httpx.Client(
            base_url=_base_url(base_url),
            transport=retry_transport,
            timeout=timeout,
            headers=_headers(_api_key(api_key), headers),
        )

    def stats(self) -> RetryStats:
        return self.transport.stats()

    def chat(self, model: str, messages: Sequence[Message], **params: Any) -> Chunk:
        return self._post("chat/completions", _chat_body(model, messages, False, params))

    def completions(self, model: str, prompt: str | list[str], **params: Any) -> Chunk:
        return self._post("completions", _completion_body(model, prompt, False, params))

    def stream_chat(self, model: str, messages: Sequence[Message], **params: Any) -> Stream:
        return self._stream("chat/completions", _chat_body(model, messages, True, params))

    def stream_completions(self, model: str, prompt: str | list[str], **params: Any) -> Stream:
        return self._stream("completions", _completion_body(model, prompt, True, params))

    def _post(self, path: str, body: Chunk) -> Chunk:
        try:
            response = self._http.post(path, json=body)
        except httpx.RequestError as exc:
            raise APIConnectionError(repr(exc)) from exc
        if not response.is_success:
            raise _error(response)
        return _json_object(response)

    def _stream(self, path: str, body: Chunk) -> Stream:
        request = self._http.build_request(
            "POST", path, json=body, headers={"accept": "text/event-stream"}
        )
        try:
            response = self._http.send(request, stream=True)
        except httpx.RequestError as exc:
            raise APIConnectionError(repr(exc)) from exc
        if not response.is_success:
            try:
                response.read()
            finally:
                response.close()
            raise _error(response)
        if _media_type(response) != EVENT_STREAM:
            prefix = bytearray()
            try:
                for piece in response.iter_bytes():
                    prefix += piece
                    if len(prefix) >= NOT_A_STREAM_PREFIX:
                        break
            except httpx.HTTPError:
                pass  # what arrived is enough to show
            finally:
                response.close()
            raise _not_a_stream(response, bytes(prefix[:NOT_A_STREAM_PREFIX]))
        return Stream(response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncKvgateClient:
    """Async client; same arguments and methods as KvgateClient, awaited."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        retry_transport: AsyncRetryTransport | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        limits: httpx.Limits | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if retry_transport is None:
            inner = async_transport(limits if limits is not None else DEFAULT_LIMITS)
            retry_transport = AsyncRetryTransport(inner, policy=policy, budget=budget)
        elif policy is not None or budget is not None:
            raise TypeError("pass either retry_transport or policy/budget, not both")
        self.transport = retry_transport
        self._http = httpx.AsyncClient(
            base_url=_base_url(base_url),
            transport=retry_transport,
            timeout=timeout,
            headers=_headers(_api_key(api_key), headers),
        )

    def stats(self) -> RetryStats:
        return self.transport.stats()

    async def chat(self, model: str, messages: Sequence[Message], **params: Any) -> Chunk:
        return await self._post("chat/completions", _chat_body(model, messages, False, params))

    async def completions(self, model: str, prompt: str | list[str], **params: Any) -> Chunk:
        return await self._post("completions", _completion_body(model, prompt, False, params))

    async def stream_chat(
        self, model: str, messages: Sequence[Message], **params: Any
    ) -> AsyncStream:
        return await self._stream("chat/completions", _chat_body(model, messages, True, params))

    async def stream_completions(
        self, model: str, prompt: str | list[str], **params: Any
    ) -> AsyncStream:
        return await self._stream("completions", _completion_body(model, prompt, True, params))

    async def _post(self, path: str, body: Chunk) -> Chunk:
        try:
            response = await self._http.post(path, json=body)
        except httpx.RequestError as exc:
            raise APIConnectionError(repr(exc)) from exc
        if not response.is_success:
            raise _error(response)
        return _json_object(response)

    async def _stream(self, path: str, body: Chunk) -> AsyncStream:
        request = self._http.build_request(
            "POST", path, json=body, headers={"accept": "text/event-stream"}
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.RequestError as exc:
            raise APIConnectionError(repr(exc)) from exc
        if not response.is_success:
            try:
                await response.aread()
            finally:
                await response.aclose()
            raise _error(response)
        if _media_type(response) != EVENT_STREAM:
            prefix = bytearray()
            try:
                async for piece in response.aiter_bytes():
                    prefix += piece
                    if len(prefix) >= NOT_A_STREAM_PREFIX:
                        break
            except httpx.HTTPError:
                pass
            finally:
                await response.aclose()
            raise _not_a_stream(response, bytes(prefix[:NOT_A_STREAM_PREFIX]))
        return AsyncStream(response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

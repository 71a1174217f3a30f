"""The transports below the retries, routed through the proxy the environment names.

httpx reads `HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and `NO_PROXY` only for a client built
without a transport of its own, and every client here has one (the retry transport). So the
environment is read here instead, with the standard library's rules (the ones `requests` and
`urllib` follow; upper or lower case, `NO_PROXY` hosts and domain suffixes, `*` for none),
once, when the transport is built: a request goes through the proxy of its URL's scheme
unless its host is exempt. One retry transport sits on top whatever the route, so one policy
and one budget count every attempt.
"""

from __future__ import annotations

import urllib.request

import httpx


def environment_proxies() -> dict[str, str]:
    """Scheme ("http", "https", "all", and "no" for the exemptions) to proxy URL, from the
    environment; empty when it names none."""
    return dict(urllib.request.getproxies_environment())


def _proxy_for(url: httpx.URL, proxies: dict[str, str]) -> str | None:
    proxy = proxies.get(url.scheme) or proxies.get("all")
    # proxy_bypass_environment: NO_PROXY's rules; public, but missing from typeshed's stubs.
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if proxy is None or bypass(url.host, proxies):
        return None
    return proxy


class EnvProxyTransport(httpx.BaseTransport):
    """Direct, or through the environment's proxy for the request's URL (one pool each)."""

    def __init__(self, limits: httpx.Limits, proxies: dict[str, str]) -> None:
        self._limits = limits
        self._proxies = proxies
        self._direct = httpx.HTTPTransport(limits=limits)
        self._via: dict[str, httpx.HTTPTransport] = {}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        proxy = _proxy_for(request.url, self._proxies)
        if proxy is None:
            return self._direct.handle_request(request)
        transport = self._via.get(proxy)
        if transport is None:
            transport = self._via[proxy] = httpx.HTTPTransport(limits=self._limits, proxy=proxy)
        return transport.handle_request(request)

    def close(self) -> None:
        for transport in (self._direct, *self._via.values()):
            transport.close()


class AsyncEnvProxyTransport(httpx.AsyncBaseTransport):
    """Async counterpart of EnvProxyTransport."""

    def __init__(self, limits: httpx.Limits, proxies: dict[str, str]) -> None:
        self._limits = limits
        self._proxies = proxies
        self._direct = httpx.AsyncHTTPTransport(limits=limits)
        self._via: dict[str, httpx.AsyncHTTPTransport] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        proxy = _proxy_for(request.url, self._proxies)
        if proxy is None:
            return await self._direct.handle_async_request(request)
        transport = self._via.get(proxy)
        if transport is None:
            transport = self._via[proxy] = httpx.AsyncHTTPTransport(limits=self._limits,
                                                                    proxy=proxy)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in (self._direct, *self._via.values()):
            await transport.aclose()


def sync_transport(limits: httpx.Limits) -> httpx.BaseTransport:
    """httpx's transport, or one that routes through the environment's proxies if it names
    any."""
    proxies = environment_proxies()
    if not any(k in proxies for k in ("http", "https", "all")):
        return httpx.HTTPTransport(limits=limits)
    return EnvProxyTransport(limits, proxies)


def async_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """Async counterpart of sync_transport."""
    proxies = environment_proxies()
    if not any(k in proxies for k in ("http", "https", "all")):
        return httpx.AsyncHTTPTransport(limits=limits)
    return AsyncEnvProxyTransport(limits, proxies)

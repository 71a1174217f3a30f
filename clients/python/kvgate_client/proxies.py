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

PROXY_SCHEMES = ("http", "https", "all")


def environment_proxies() -> dict[str, str]:
    """Scheme ("http", "https", "all", and "no" for the exemptions) to proxy URL, from the
    environment; empty when it names none. A proxy written without a scheme
    (`HTTP_PROXY=proxy.corp:3128`) is an http:// one, as httpx and curl read it."""
    proxies = dict(urllib.request.getproxies_environment())
    for scheme in PROXY_SCHEMES:
        value = proxies.get(scheme)
        if value and "://" not in value:
            proxies[scheme] = "http://" + value
    return proxies


def _proxy_for(url: httpx.URL, proxies: dict[str, str]) -> str | None:
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy is None:
        return None
    # NO_PROXY's rules; public, but missing from typeshed's stubs. Given "host:port", an entry
    # matches as "host" or as "host:port" (an IPv6 address is given alone).
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    host = url.host
    if url.port is not None and ":" not in host:
        host = f"{host}:{url.port}"
    return None if bypass(host, proxies) else proxy


def _routes(proxies: dict[str, str]) -> list[str]:
    return sorted({proxies[s] for s in PROXY_SCHEMES if proxies.get(s)})


class EnvProxyTransport(httpx.BaseTransport):
    """Direct, or through the environment's proxy for the request's URL (one pool each)."""

    def __init__(self, limits: httpx.Limits, proxies: dict[str, str]) -> None:
        self._proxies = proxies
        self._direct = httpx.HTTPTransport(limits=limits)
        # Built now: a proxy URL httpx cannot use fails the client's construction, once.
        self._via = {p: httpx.HTTPTransport(limits=limits, proxy=p) for p in _routes(proxies)}

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        proxy = _proxy_for(request.url, self._proxies)
        transport = self._direct if proxy is None else self._via[proxy]
        return transport.handle_request(request)

    def close(self) -> None:
        for transport in (self._direct, *self._via.values()):
            transport.close()


class AsyncEnvProxyTransport(httpx.AsyncBaseTransport):
    """Async counterpart of EnvProxyTransport."""

    def __init__(self, limits: httpx.Limits, proxies: dict[str, str]) -> None:
        self._proxies = proxies
        self._direct = httpx.AsyncHTTPTransport(limits=limits)
        self._via = {p: httpx.AsyncHTTPTransport(limits=limits, proxy=p)
                     for p in _routes(proxies)}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        proxy = _proxy_for(request.url, self._proxies)
        transport = self._direct if proxy is None else self._via[proxy]
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in (self._direct, *self._via.values()):
            await transport.aclose()


def sync_transport(limits: httpx.Limits) -> httpx.BaseTransport:
    """httpx's transport, or one that routes through the environment's proxies if it names
    any."""
    proxies = environment_proxies()
    if not _routes(proxies):
        return httpx.HTTPTransport(limits=limits)
    return EnvProxyTransport(limits, proxies)


def async_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """Async counterpart of sync_transport."""
    proxies = environment_proxies()
    if not _routes(proxies):
        return httpx.AsyncHTTPTransport(limits=limits)
    return AsyncEnvProxyTransport(limits, proxies)

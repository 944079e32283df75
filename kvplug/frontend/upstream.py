"""HTTP to the engines: the request path's keep-alive pool (``kvplug/frontend/engine_http.py``)
and an aiohttp session for the side calls (token endpoints, prefill stages, health probes).

``open`` returns only once the engine has sent its status line and the first body bytes, so a
failure before the first byte (refused, reset, timeout, empty answer) is an
``UpstreamUnavailable`` the caller may retry elsewhere - nothing has reached the client yet.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from kvplug.frontend.engine_http import EnginePool, EngineResponse
from kvplug.frontend.timeouts import within

# headers that must not be forwarded (hop-by-hop, or set by the client session itself, or
# kvplug's own routing hints)
_DROP = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "expect",
        "x-kvplug-worker",
        "x-kvplug-prefill-worker",
        "x-kvplug-dp-rank",
        "x-kvplug-allowed-workers",
        "x-worker-instance-id",
        "x-prefill-instance-id",
        "x-dynamo-dp-rank",
    }
)


class UpstreamUnavailable(Exception):
    """The engine failed before sending the first byte of its answer."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason


def forward_headers(client_headers, request_id: str) -> dict[str, str]:
    out = {k: v for k, v in client_headers.items() if k.lower() not in _DROP}
    out["Content-Type"] = "application/json"
    out["X-Request-Id"] = request_id
    return out


class Upstream:
    def __init__(
        self, connect_timeout: float = 5.0, read_timeout: float = 600.0, limit: int = 0
    ) -> None:
        # read_timeout: --idle-timeout, the longest silence between two reads
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.limit = limit
        self.session: aiohttp.ClientSession | None = None
        self.pool: EnginePool | None = None

    async def start(self) -> None:
        if self.pool is None:
            # idle connections close before uvicorn's 5 s keep-alive (vLLM, SGLang) does
            self.pool = EnginePool(self.connect_timeout, self.read_timeout, keepalive=4.0)
        if self.session is None:
            connector = aiohttp.TCPConnector(
                limit=self.limit,
                # idle connections close before uvicorn's 5 s keep-alive (vLLM, SGLang) does,
                # so a request never goes out on a socket the engine is closing
                keepalive_timeout=4.0,
                enable_cleanup_closed=False,
            )
            self.session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def open(
        self, worker_id: str, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[EngineResponse, bytes]:
        """POST and wait for the first body bytes; ``UpstreamUnavailable`` before them. A
        cancelled call (client gone, timeout) closes the connection, so the engine aborts."""
        assert self.pool is not None, "Upstream.start() was not awaited"
        try:
            resp = await self.pool.post(url, body, headers)
            first = await resp.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise UpstreamUnavailable(worker_id, f"{type(exc).__name__}: {exc}") from exc
        if not first and resp.status >= 500:
            # an empty 5xx is a dead or restarting engine, not an answer
            resp.close()
            raise UpstreamUnavailable(worker_id, f"empty HTTP {resp.status} answer")
        return resp, first

    async def post_json(
        self,
        worker_id: str,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        timeout: float | None = None,
    ) -> tuple[int, Any, bytes]:
        """POST a JSON body and read a JSON answer: ``(status, parsed or None, raw)``."""
        assert self.session is not None
        hop_timeout = (
            self.session.timeout
            if timeout is None
            else aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)
        )
        try:
            async with self.session.post(
                url, data=json.dumps(body).encode(), headers=headers, timeout=hop_timeout
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise UpstreamUnavailable(worker_id, f"{type(exc).__name__}: {exc}") from exc
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return status, parsed, raw

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of a GET (health probes, model discovery) within ``timeout``: the
        deadline is ``within``'s, so a stall of this loop is not the engine's silence (a
        worker never seen up is marked down on its first failed probe)."""
        return await within(self._get(url), timeout)

    async def _get(self, url: str) -> tuple[int, bytes]:
        assert self.session is not None
        async with self.session.get(
            url, timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout)
        ) as resp:
            return resp.status, await resp.read()

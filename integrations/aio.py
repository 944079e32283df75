"""Plumbing shared by the adapters that poll their engines over HTTP (SGLang, TRT-LLM)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

log = logging.getLogger("kvplug.integrations")


class LazySession:
    """One aiohttp session per adapter, made on first use (inside the running loop, as aiohttp
    wants) and made again if something closed it."""

    def __init__(
        self, timeout: float | None = None, headers: Callable[[], dict[str, str]] | None = None
    ) -> None:
        self.timeout = timeout  # default total timeout of every request; None: per request
        self.headers = headers  # read when the session is made: the adapter's engine_headers
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = self.headers() if self.headers is not None else None
            if self.timeout is None:
                self._session = aiohttp.ClientSession(headers=headers)
            else:
                total = aiohttp.ClientTimeout(total=self.timeout)
                self._session = aiohttp.ClientSession(timeout=total, headers=headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def log_due(count: int) -> bool:
    """Whether the count-th repeat of a recurring failure (a scrape, a bad message) is logged:
    the first three, then every hundredth, so a dead endpoint cannot flood the log."""
    return count <= 3 or count % 100 == 0


class CountsLoadErrors(Protocol):
    load_errors: int


async def poll_loads(
    scrape: Callable[[], Awaitable[bool | None]],
    period: float,
    run: CountsLoadErrors,
    who: str,
    logger: logging.Logger = log,
) -> None:
    """Every ``period`` seconds, one ``scrape()`` of an engine's load (it applies what it read;
    it returns True to be called again at once, e.g. after falling back to another endpoint).
    A failed scrape (HTTP error, timeout, unreadable answer) is counted in
    ``run.load_errors`` and logged rate-limited, never fatal. Runs until cancelled."""
    while True:
        try:
            if await scrape():
                continue
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            run.load_errors += 1
            if log_due(run.load_errors):
                logger.warning("%s: load scrape failed (%d so far): %s", who, run.load_errors, exc)
        await asyncio.sleep(period)

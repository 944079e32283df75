"""Plumbing shared by the adapters that poll their engines over HTTP (SGLang, TRT-LLM)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import aiohttp


class LazySession:
    """One aiohttp session per adapter, made on first use (inside the running loop, as aiohttp
    wants) and made again if something closed it."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout  # default total timeout of every request; None: per request
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if self.timeout is None:
                self._session = aiohttp.ClientSession()
            else:
                total = aiohttp.ClientTimeout(total=self.timeout)
                self._session = aiohttp.ClientSession(timeout=total)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def log_due(count: int) -> bool:
    """Whether the count-th repeat of a recurring failure (a scrape, a bad message) is logged:
    the first three, then every hundredth, so a dead endpoint cannot flood the log."""
    return count <= 3 or count % 100 == 0


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel the tasks, then wait for each to end; what they raise while ending is theirs
    (already logged by them), not the caller's."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

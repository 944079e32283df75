"""The load-scrape loop the SGLang and TRT-LLM adapters share (kvplug.integrations.aio)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import aiohttp
import pytest
from kvplug.integrations.aio import poll_loads


async def test_a_failed_scrape_is_counted_and_the_loop_goes_on(caplog):
    run = SimpleNamespace(load_errors=0)
    calls: list[str] = []
    script = ["fail", "bad", "fallback", "ok", "ok"]

    async def scrape() -> bool:
        step = script[len(calls)] if len(calls) < len(script) else "ok"
        calls.append(step)
        if step == "fail":
            raise aiohttp.ClientConnectionError("connection refused")
        if step == "bad":
            raise ValueError("not a metrics page")
        if len(calls) >= len(script):
            raise asyncio.CancelledError  # ends the loop (as the adapter's stop does)
        return step == "fallback"  # True: scrape again at once (another endpoint)

    with caplog.at_level(logging.WARNING), pytest.raises(asyncio.CancelledError):
        await poll_loads(scrape, 0.0, run, "test worker w0")
    assert calls == script
    assert run.load_errors == 2
    assert [r.getMessage() for r in caplog.records] == [
        "test worker w0: load scrape failed (1 so far): connection refused",
        "test worker w0: load scrape failed (2 so far): not a metrics page",
    ]


async def test_anything_else_is_not_swallowed():
    run = SimpleNamespace(load_errors=0)

    async def scrape() -> bool:
        raise KeyError("a bug, not a scrape failure")

    with pytest.raises(KeyError):
        await poll_loads(scrape, 0.0, run, "w")
    assert run.load_errors == 0

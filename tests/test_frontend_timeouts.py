"""kvplug.frontend.timeouts.within: the request path's deadlines without a task each."""

from __future__ import annotations

import asyncio

import pytest

from kvplug.frontend.timeouts import within


async def test_within_returns_and_runs_in_the_callers_task():
    caller = asyncio.current_task()

    async def work():
        await asyncio.sleep(0)
        return asyncio.current_task()

    assert await within(work(), 5) is caller


async def test_within_times_out_and_cancels_the_work():
    cancelled = asyncio.Event()

    async def hang():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(asyncio.TimeoutError):
        await within(hang(), 0.05)
    assert cancelled.is_set()


async def test_a_deadline_already_past_never_starts_the_work():
    started = []

    async def work():
        started.append(1)
        return 1

    for seconds in (0, -1):
        with pytest.raises(asyncio.TimeoutError):
            await within(work(), seconds)
    assert started == []


async def test_an_outer_cancel_is_not_turned_into_a_timeout():
    async def hang():
        await asyncio.sleep(10)

    task = asyncio.ensure_future(within(hang(), 5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

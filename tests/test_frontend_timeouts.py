"""kvplug.frontend.timeouts.within: the request path's deadlines without a task each."""

from __future__ import annotations

import asyncio
import time

import pytest
from loop_factories import loop_factories

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


async def test_a_timeout_leaves_the_caller_uncancelled():
    async def hang():
        await asyncio.sleep(10)

    with pytest.raises(asyncio.TimeoutError):
        await within(hang(), 0.01)
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)  # the caller goes on: no cancel request is left behind


async def test_work_that_finishes_despite_the_deadline_keeps_its_result():
    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "done anyway"

    assert await within(stubborn(), 0.01) == "done anyway"
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0.01)


async def test_a_cancel_arriving_with_the_deadline_stays_a_cancel():
    async def cancelled_at_the_deadline():
        # the caller's cancel is due just after the deadline's timer; the blocking sleep makes
        # both due at the next loop step, so both cancel requests land before the task wakes
        me = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.051, me.cancel)
        time.sleep(0.1)
        await asyncio.sleep(10)

    task = asyncio.ensure_future(within(cancelled_at_the_deadline(), 0.05))
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_deadlines_expire_where_they_were_set():
    async def hang():
        await asyncio.sleep(10)

    async def inner_expires():
        with pytest.raises(asyncio.TimeoutError):
            await within(hang(), 0.01)
        return "outer goes on"

    assert await within(inner_expires(), 5) == "outer goes on"

    async def outer_expires():
        try:
            await within(hang(), 5)
        except asyncio.TimeoutError:  # pragma: no cover - the inner one must not claim it
            return "inner claimed the outer deadline"
        return "unreachable"

    with pytest.raises(asyncio.TimeoutError):
        await within(outer_expires(), 0.01)


@pytest.mark.parametrize("new_loop", loop_factories())
def test_an_answer_that_came_while_the_loop_was_blocked_is_not_a_timeout(new_loop):
    """The loop blocks past the deadline (a GC pause, a long decode); the awaited answer comes
    in from elsewhere during the block. The deadline's timer runs late: the caller gets the
    answer, not a TimeoutError (before: the timer ran first and cancelled it)."""
    import threading

    async def scenario():
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        threading.Timer(0.1, loop.call_soon_threadsafe, (answer.set_result, 7)).start()
        loop.call_later(0.02, time.sleep, 0.4)  # blocks the loop from 0.02 s to 0.42 s
        return await within(answer, 0.2)

    with asyncio.Runner(loop_factory=new_loop) as runner:
        assert runner.run(scenario()) == 7


@pytest.mark.parametrize("new_loop", loop_factories())
def test_a_blocked_loop_with_nothing_come_still_times_out(new_loop):
    """The same block with no answer: the deadline is judged again and expires."""

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, time.sleep, 0.4)
        t0 = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await within(loop.create_future(), 0.2)
        return loop.time() - t0

    with asyncio.Runner(loop_factory=new_loop) as runner:
        # 0.42 s blocked (0.22 s past the deadline, given back), then the deadline expires
        assert 0.6 < runner.run(scenario()) < 1.5


async def test_a_health_probe_answered_while_the_loop_was_blocked_passes():
    """Upstream.get (health probes, model discovery): the engine answers at once, but this loop
    blocks for longer than the probe's timeout as the probe arrives. The answer waited in the
    socket: 200, not a failed probe (a worker never seen up is marked down on its first). The
    engine runs on a loop of its own, in another thread."""
    import threading

    from aiohttp import web

    from kvplug.frontend.upstream import Upstream

    here = asyncio.get_running_loop()

    async def health(request):
        here.call_soon_threadsafe(time.sleep, 0.8)  # this loop blocks as the probe arrives
        return web.Response(text="ok")

    async def serve():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    engine_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=engine_loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(serve(), engine_loop).result(10)
    upstream = Upstream()
    await upstream.start()
    try:
        assert await upstream.get(f"http://127.0.0.1:{port}/health", 0.3) == (200, b"ok")
    finally:
        await upstream.close()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), engine_loop).result(10)
        engine_loop.call_soon_threadsafe(engine_loop.stop)
        thread.join(10)
        engine_loop.close()


@pytest.mark.parametrize("new_loop", loop_factories())
def test_within_leaves_no_reference_cycle(new_loop):
    """Every request passes through within() a few times: a cycle through its timer (the
    handle holds the closure, the closure the handle or itself) keeps the task and its request
    alive until the cyclic GC runs, which cost the Python data path ~7 % CPU per request."""
    import gc

    async def work():
        return 1

    async def scenario():
        for _ in range(1000):
            await within(work(), 5)

    gc.collect()
    gc.disable()
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(scenario())
        assert gc.collect() == 0
    finally:
        gc.enable()

"""A deadline around one await, without a task of its own.

``asyncio.wait_for`` runs the awaited coroutine in a new task with a timer, so each call costs a
task creation and two extra event-loop steps. ``asyncio.timeout`` (3.11+) arms one timer and
cancels the current task if it fires, but its context manager (state machine, ``call_at`` on the
loop's clock, reschedule) still costs ~6 us a call under uvloop, on every request that has
``--request-timeout``. ``within`` does the same with one ``call_later`` and a closure
(~2 us), with ``asyncio.timeout``'s semantics: an expired deadline raises ``TimeoutError``
(``asyncio.TimeoutError``) in the caller, and a cancellation of the caller that arrives as well
(``Task.cancelling()`` grew) stays a cancellation. On 3.10 (no ``Task.uncancel``) it is
``wait_for``. A deadline that passed while the loop itself was blocked (its timer ran late)
gets the blocked time back (``kvplug.stalls.given_back``), so a stall of this process is not
taken for a silent engine.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

from kvplug.stalls import given_back

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, or ``TimeoutError`` after ``seconds``. A deadline already past does
        not start ``aw`` at all (as ``wait_for``: nothing reaches an engine)."""
        if seconds <= 0:
            return await asyncio.wait_for(aw, 0)
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("within() must run inside a task")
        cancelling = task.cancelling()
        fired = False
        loop = task.get_loop()
        graces = 0
        # armed below; expire() re-arms it after a stall (and names itself to do so), so both
        # are cells, and the finally below empties them: each closes a reference cycle through
        # expire() that kept the task (and its request) alive until the cyclic GC (+7 % CPU
        # per request on the Python data path, measured)
        timer: asyncio.TimerHandle | None

        # a closure: a callable object measured ~1 us slower per call_later under uvloop
        def expire() -> None:
            nonlocal fired, timer, graces
            assert timer is not None  # only the finally empties it, after cancelling it
            again = given_back(loop.time() - timer.when(), graces, seconds)
            if again:
                # this loop was blocked past the deadline: that time is given back, up to the
                # whole deadline. What ``aw`` waits for may have
                # come in meanwhile (a due timer runs before the step that would deliver it),
                # or never left: a request the stall kept from being sent
                graces += 1
                timer = loop.call_later(again, expire)
                return
            fired = True
            task.cancel()

        timer = loop.call_later(seconds, expire)
        try:
            return await aw
        except asyncio.CancelledError as exc:
            if fired:
                fired = False  # our cancel request is taken back here, not below
                if task.uncancel() <= cancelling:  # nobody else cancelled the caller
                    raise TimeoutError from exc
            raise
        finally:
            timer.cancel()
            timer = None
            del expire
            if fired:  # it fired, but ``aw`` ended some other way: take back our cancel
                task.uncancel()

else:  # pragma: no cover - 3.10

    async def within(aw: Awaitable[T], seconds: float) -> T:
        return await asyncio.wait_for(aw, seconds)

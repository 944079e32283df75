"""A deadline around one await, without a task of its own.

``asyncio.wait_for`` runs the awaited coroutine in a new task with a timer, so each call costs a
task creation and two extra event-loop steps; ``asyncio.timeout`` (3.11+) arms one timer and
cancels the current task if it fires. The request path awaits up to three deadlines per request
(the body read, ``--request-timeout`` and the engine's first byte), hence ``within``: the
cheap form where the interpreter has it, ``wait_for`` on 3.10. Either way an expired deadline
raises ``asyncio.TimeoutError`` (``TimeoutError`` on 3.11+) in the caller.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, or ``TimeoutError`` after ``seconds``. A deadline already past does
        not start ``aw`` at all (as ``wait_for``: nothing reaches an engine)."""
        if seconds <= 0:
            return await asyncio.wait_for(aw, 0)
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - 3.10

    async def within(aw: Awaitable[T], seconds: float) -> T:
        return await asyncio.wait_for(aw, seconds)

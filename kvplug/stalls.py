"""When this process's event loop was stalled, so that time is not counted against a peer.

A GC pause, a long decode or a starved CPU stops the loop; the metric pollers stop with it
(SGLang's and TRT-LLM's run on the loop, vLLM's scrapers on threads that need the GIL a GC pause
or a decode holds; a blocking call that releases it lets them refresh, and the credit then
changes nothing: an observation's credit is at most its age). An engine's attributes (queue
depth, KV usage) observed just before a stall of a second or two are then older than
``--router-attribute-max-age`` when the requests queued behind the stall are routed,
before any poller has run again: every engine looked stale, an attribute threshold with
``on_missing: exclude`` excluded them all and those requests got 503 although nothing was wrong
with the engines. ``LoopStalls`` notes the stalls (a beat every 50 ms that finds itself late)
and ``credit`` says how much of an observation's age was this process not running, so
``AttributeTable.read`` judges freshness by the time the pollers had.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np

# A timer running this late means this process's event loop did not run (a GC pause, a long
# decode, a starved process), not that a peer was silent. A deadline judged late gets the
# blocked time back, up to STALL_GRACES times (a loop blocked again and again still times out);
# csrc/lane.c keeps the same two figures for the compiled lane.
STALL_S = 0.1
STALL_GRACES = 3


def given_back(late: float, graces: int, seconds: float) -> float:
    """When a ``seconds`` deadline whose timer ran ``late`` (after ``graces`` earlier give-backs)
    is judged again: the blocked time, at most the deadline's length; 0.0 = it expires now."""
    if late > STALL_S and graces < STALL_GRACES:
        return min(late, seconds)
    return 0.0


class LoopStalls:
    """The loop's stalls of the last ``keep`` seconds (observations older than that are stale
    under any sane max age anyway), on ``time.monotonic``'s clock (the router's). ``start`` on
    the loop to watch; ``credit`` is safe to call from it at any time, also right after a
    stall, before the beat that notes it has run.

    The credit is not capped: after a long stall (a SIGSTOP) the requests queued behind it are
    routed on what was known before it, for the moment until the pollers, due at once, answer.
    That beats refusing them all; an engine whose metrics stop answering still goes stale in
    the time the loop runs."""

    def __init__(self, period: float = 0.05, keep: float = 60.0) -> None:
        self.period = period
        self.keep = keep
        self.spans: deque[tuple[float, float]] = deque()  # (start, end) of each stall
        self.stalls = 0  # how many, and their total seconds (stats)
        self.stalled_s = 0.0
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = time.monotonic() + self.period
        self._timer = self._loop.call_later(self.period, self._beat)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._due > STALL_S:  # the loop did not run from when this beat was due
            self.spans.append((self._due, now))
            self.stalls += 1
            self.stalled_s += now - self._due
        while self.spans and self.spans[0][1] < now - self.keep:
            self.spans.popleft()
        self._due = now + self.period
        assert self._loop is not None
        self._timer = self._loop.call_later(self.period, self._beat)

    def _current(self, now: float) -> tuple[float, float] | None:
        """The stall the loop is coming out of, if the beat that would note it has not run."""
        if self._timer is not None and now - self._due > STALL_S:
            return (self._due, now)
        return None

    def credit(self, since: np.ndarray, now: float) -> np.ndarray | None:
        """Seconds of each ``[since[i], now]`` the loop was stalled (NaN stays NaN), or None
        when there were no stalls in the window: the common case costs one comparison."""
        current = self._current(now)
        if not self.spans and current is None:
            return None
        spans = list(self.spans) if current is None else [*self.spans, current]
        credit = np.zeros(len(since))
        for start, end in spans:
            credit += np.clip(end - np.maximum(since, start), 0.0, None)
        return credit

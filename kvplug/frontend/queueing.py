"""The admission queue (``kvplug.admission``) inside the serving loop.

A request that must wait awaits a future; :meth:`FrontendQueue.pump` resolves the head's future
when its eligible workers drop below threshold. Pumps come from load changes (every first token
and finish the router hears, through ``Lifecycle``), from the released request once it is routed
(the next head is then judged against load that includes it), from a timer at each request's
``max_wait`` deadline, and from a periodic recheck (load that changes without a request event:
workers added or undrained, thresholds changed, the prefill-load model's decay).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kvplug.admission import AdmissionQueue, QueueFull, QueueTimeout, Scope, Ticket
from kvplug.frontend.metrics import FrontendMetrics

log = logging.getLogger(__name__)

RECHECK_INTERVAL = 1.0  # seconds; Dynamo: 60 s
RECHECK_INTERVAL_DECAY = 0.1  # with a prefill-load model load decays between events (Dynamo too)
CLIENT_CHECK_INTERVAL = 0.25  # seconds between looks at a waiting request's connection


class ClientGone(Exception):
    """The client of a waiting request closed its connection; it left the queue."""


class FrontendQueue:
    def __init__(
        self, router: Any, metrics: FrontendMetrics, recheck_interval: float | None = None
    ) -> None:
        self.router = router
        self.core = AdmissionQueue.from_config(router.config)
        self.metrics = metrics
        if recheck_interval is None:
            decays = getattr(router.config, "router_prefill_load_model", "none") != "none"
            recheck_interval = RECHECK_INTERVAL_DECAY if decays else RECHECK_INTERVAL
        self.recheck_interval = recheck_interval
        self._recheck: asyncio.Task | None = None
        self._counts = {o: metrics.queue_requests.labels(o) for o in self.core.counters}
        self._waits = {
            o: metrics.queue_wait_seconds.labels(o) for o in ("released", "timeout", "cancelled")
        }
        metrics.queue_depth.set_function(lambda: self.core.depth)

    async def wait(
        self,
        scope: Scope,
        prompt_tokens: int,
        cached_tokens: Callable[[], int] | None = None,
        priority_jump: float = 0.0,
        gone: Callable[[], bool] | None = None,
    ) -> Ticket | None:
        """Return at once (None) when the request may be routed now; else wait until released
        and return its ticket, which is in transit until :meth:`done`. Raises ``QueueFull``,
        ``QueueTimeout``, ``ClientGone`` (``gone()`` turned true: the client hung up; aiohttp
        does not cancel handlers on disconnect); a cancelled waiter leaves the queue too."""
        core = self.core
        if not core.should_queue(self.router, scope):
            return None
        cached = cached_tokens() if cached_tokens is not None and core.policy == "wspt" else 0
        try:
            ticket = core.enqueue(
                None,
                scope,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                priority_jump=priority_jump,
            )
        except QueueFull:
            self._counts["rejected_full"].inc()
            raise
        self._counts["queued"].inc()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        ticket.payload = fut
        timer = loop.call_later(core.max_wait, self.pump) if core.max_wait else None
        self._ensure_recheck()
        self.pump()  # it may be the head of an idle fleet (queued behind one in transit)
        try:
            while True:
                await asyncio.wait((fut,), timeout=CLIENT_CHECK_INTERVAL if gone else None)
                if fut.done():
                    fut.result()  # raises QueueTimeout
                    break
                if gone is not None and gone():
                    raise ClientGone("the client closed the connection while its request waited")
        except (asyncio.CancelledError, ClientGone):  # the client went away, the server stops
            if core.cancel(ticket):
                self._left(ticket)
            else:
                core.done(ticket)  # released meanwhile: let the next one be examined
            self.pump()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return ticket

    def done(self, ticket: Ticket) -> None:
        """The released request has been routed (or failed to be): examine the next head."""
        self.core.done(ticket)
        self.pump()

    def pump(self) -> None:
        core = self.core
        if not core.depth:
            return
        for t in core.expire():
            self._left(t)
            fut = t.payload
            if not fut.done():
                fut.set_exception(
                    QueueTimeout(
                        f"waited {t.waited:.1f} s in the admission queue while every eligible "
                        f"worker stayed over the queue threshold (--router-queue-max-wait "
                        f"{core.max_wait:g})"
                    )
                )
        while (t := core.pop_ready(self.router)) is not None:
            self._left(t)
            fut = t.payload
            if fut.done():  # cancelled, its handler not run yet: the next one goes instead
                core.done(t)
                continue
            fut.set_result(None)
            return

    def _left(self, t: Ticket) -> None:
        self._counts[t.outcome].inc()
        if t.waited is not None:
            self._waits[t.outcome].observe(t.waited)

    def _ensure_recheck(self) -> None:
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.get_running_loop().create_task(self._recheck_loop())

    async def _recheck_loop(self) -> None:
        while True:
            await asyncio.sleep(self.recheck_interval)
            try:
                self.pump()
            except Exception:  # a bug must not stop the queue from draining
                log.exception("admission queue recheck failed")

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recheck
            self._recheck = None

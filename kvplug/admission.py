"""Admission queue: Dynamo's ``--router-queue-threshold`` (a delay before routing, not a filter).

While **every** eligible endpoint of a request has more active prefill tokens than
``threshold x max_batched_tokens``, the request waits here instead of being routed; when load
drops (a first token or a finish somewhere), waiting requests leave in policy order and are
routed then, so their decision sees fresh load and fresh overlaps.

Semantics follow Dynamo's ``SchedulerQueue`` (``lib/kv-router/src/scheduling/queue.rs``):

* busy = ``active prefill tokens > threshold x max_num_batched_tokens`` (strict), checked per
  endpoint (worker, DP rank); a worker with unknown budget counts as 10,000,000 tokens, which
  in practice never makes it busy;
* eligible = the pinned worker (and rank) if pinned, else the allow-list, else every worker
  (kvplug also leaves out draining workers, workers of the wrong role and excluded ones);
  no eligible endpoint = not busy, so routing raises its own "no compatible worker" error;
* once anything waits, new arrivals wait too (no overtaking the backlog);
* head-of-line: only the queue's head is examined; while it cannot go, nothing leaves;
* orders: ``fcfs`` key ``jump - arrival``, ``lcfs`` key ``jump + arrival``, ``wspt``
  (Smith's rule) key ``(1 + jump) / max(1, prompt tokens - best cached tokens)``; highest key
  first, ties in arrival order. ``jump`` is the request's priority bump in seconds
  (Dynamo: ``nvext.agent_hints.latency_sensitivity``).

kvplug additions: an optional cap on waiting requests (:class:`QueueFull`) and on waiting time
(:class:`QueueTimeout`), both counted. One released request at a time is "in transit" until its
owner has routed it (:meth:`AdmissionQueue.done`): the next head is examined only against load
that includes it (Dynamo routes inside its queue actor, so it has no such window).

No asyncio here and an injectable clock: the frontend wraps it with futures, the simulator
can drive it in virtual time. The clock must be the router's (the prefill-load model decays on
it).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplug.config import QUEUE_POLICIES
from kvplug.errors import RoutingError
from kvplug.workers import Stage, role_serves

# Dynamo's DEFAULT_MAX_BATCHED_TOKENS: a worker that does not report its budget
UNKNOWN_MAX_BATCHED_TOKENS = 10_000_000


class QueueFull(RoutingError):
    """The admission queue holds ``max_length`` requests already."""


class QueueTimeout(RoutingError):
    """The request waited ``max_wait`` seconds without the fleet dropping below threshold."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Which endpoints a request could be routed to (what its busy check looks at)."""

    stage: Stage = Stage.AGGREGATED
    allowed: frozenset[str] | None = None
    pinned_worker: str | None = None
    pinned_rank: int | None = None
    exclude: frozenset[str] = frozenset()


ANY = Scope()


class Ticket:
    """One request's place in the queue."""

    __slots__ = (
        "seq",
        "payload",
        "scope",
        "prompt_tokens",
        "cached_tokens",
        "priority_jump",
        "enqueued_at",
        "left_at",
        "outcome",
        "_key",
    )

    def __init__(
        self,
        seq: int,
        payload: Any,
        scope: Scope,
        prompt_tokens: int,
        cached_tokens: int,
        priority_jump: float,
        enqueued_at: float,
    ) -> None:
        self.seq = seq
        self.payload = payload
        self.scope = scope
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.priority_jump = priority_jump
        self.enqueued_at = enqueued_at
        self.left_at: float | None = None
        self.outcome = "waiting"  # -> released | timeout | cancelled
        self._key = 0.0

    @property
    def waited(self) -> float | None:
        return None if self.left_at is None else self.left_at - self.enqueued_at

    def __repr__(self) -> str:
        return f"Ticket(seq={self.seq}, outcome={self.outcome}, prompt={self.prompt_tokens})"


def order_key(policy: str, arrival: float, prompt_tokens: int, cached: int, jump: float) -> float:
    """Higher leaves first. ``arrival`` in seconds since the queue started."""
    jump = max(jump, 0.0)
    if policy == "fcfs":
        return jump - arrival
    if policy == "lcfs":
        return jump + arrival
    return (1.0 + jump) / max(1, prompt_tokens - cached)  # wspt


def _eligible(router: Any, scope: Scope, ep: int) -> bool:
    """Could the router pick endpoint ``ep`` for ``scope`` (before load-based filters)?"""
    state = router.ep_state[ep]
    if state is None or state.draining:
        return False
    wid = router.ep_worker[ep]
    if scope.pinned_worker is not None and wid != scope.pinned_worker:
        return False
    if scope.pinned_rank is not None and router.ep_rank[ep] != scope.pinned_rank:
        return False  # a DP-rank pin applies with or without a worker pin (as the router's)
    if scope.allowed is not None and wid not in scope.allowed:
        return False
    return wid not in scope.exclude and role_serves(state.worker.role, scope.stage)


def _named_endpoints(router: Any, scope: Scope) -> list[int] | None:
    """Endpoints of the pinned or allow-listed workers; None when the scope names none."""
    if scope.pinned_worker is not None:
        names: Iterable[str] = (scope.pinned_worker,)
    elif scope.allowed is not None:
        names = scope.allowed
    else:
        return None
    out: list[int] = []
    for wid in names:
        try:
            out.extend(int(ep) for ep in router.worker_state(wid).endpoint_ids)
        except KeyError:  # UnknownWorker: not (or no longer) registered
            continue
    return out


def eligible_endpoints(router: Any, scope: Scope) -> list[int]:
    """Endpoint ids the router could pick for ``scope`` (before load-based filters)."""
    n = len(router.ep_state)
    few = _named_endpoints(router, scope)
    candidates: Iterable[int] = range(n) if few is None else few
    return [ep for ep in candidates if ep < n and _eligible(router, scope, ep)]


def best_cached_tokens(
    router: Any, token_ids: Sequence[int] | np.ndarray, scope: Scope, cache_salt: str | None = None
) -> int:
    """Longest device-tier prefix (in tokens) any eligible endpoint holds (wspt's discount)."""
    if not len(token_ids):
        return 0
    eps = eligible_endpoints(router, scope)
    if not eps:
        return 0
    index = router.index
    ov = index.query(index.request_hashes(token_ids, None, cache_salt))
    device = ov.device
    best = max((int(device[ep]) for ep in eps if ep < len(device)), default=0)
    return min(best * int(index.block_size), len(token_ids))


class AdmissionQueue:
    def __init__(
        self,
        threshold: float | None,
        policy: str = "fcfs",
        *,
        max_length: int = 0,
        max_wait: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy {policy!r} not in {QUEUE_POLICIES}")
        if threshold is not None and threshold < 0:
            raise ValueError("queue threshold must be >= 0")
        self.threshold = threshold
        self.policy = policy
        self.max_length = max(0, int(max_length))
        self.max_wait = max(0.0, float(max_wait))
        self.clock = clock
        self._start = clock()
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, Ticket]] = []  # (-key, seq, ticket); lazy removal
        self._arrivals: deque[Ticket] = deque()  # arrival order, for max_wait; lazy removal
        self._waiting = 0
        self.in_transit: Ticket | None = None
        self.counters = {
            "queued": 0,
            "released": 0,
            "timeout": 0,
            "cancelled": 0,
            "rejected_full": 0,
        }

    @classmethod
    def from_config(cls, config: Any, clock: Callable[[], float] = time.monotonic):
        return cls(
            config.router_queue_threshold,
            config.router_queue_policy,
            max_length=config.router_queue_max_length,
            max_wait=config.router_queue_max_wait,
            clock=clock,
        )

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    @property
    def depth(self) -> int:
        """Requests waiting (not counting one released and not yet routed)."""
        return self._waiting

    def __len__(self) -> int:
        return self._waiting

    # ------------------------------------------------------------------ the busy check
    def fleet_busy(self, router: Any, scope: Scope = ANY, now: float | None = None) -> bool:
        """True when every eligible endpoint is over threshold (False when none is eligible).

        Vectorised over endpoints, then only a few are checked for eligibility: the idle ones
        until one is eligible (the usual answer, "not busy"), else the busy ones until one is
        eligible (busy; none eligible = not busy). Cheap with hundreds of workers."""
        if self.threshold is None:
            return False
        states = router.ep_state
        n = len(states)
        if n == 0:
            return False
        tokens = np.zeros(n)
        load = router.load.prefill_tokens_at(self.clock() if now is None else now)
        k = min(n, len(load))
        tokens[:k] = load[:k]
        budget = np.full(n, float(UNKNOWN_MAX_BATCHED_TOKENS))
        known = np.asarray(router.max_batched[: min(n, len(router.max_batched))], dtype=float)
        budget[: len(known)] = np.where(known > 0, known, UNKNOWN_MAX_BATCHED_TOKENS)
        busy = tokens > budget * self.threshold
        few = _named_endpoints(router, scope)
        if few is not None:  # pinned or allow-listed: look at those workers' endpoints only
            eligible = [ep for ep in few if ep < n and _eligible(router, scope, ep)]
            return bool(eligible) and bool(busy[eligible].all())
        for ep in np.flatnonzero(~busy).tolist():
            if _eligible(router, scope, ep):
                return False
        return any(_eligible(router, scope, ep) for ep in np.flatnonzero(busy).tolist())

    def should_queue(self, router: Any, scope: Scope = ANY) -> bool:
        """Must a new request wait? Yes when anything waits already (no overtaking) or is
        released but not routed yet, else when the fleet is busy for its scope."""
        if self.threshold is None:
            return False
        if self._waiting or self.in_transit is not None:
            return True
        return self.fleet_busy(router, scope)

    # ------------------------------------------------------------------ entering, leaving
    def enqueue(
        self,
        payload: Any = None,
        scope: Scope = ANY,
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        priority_jump: float = 0.0,
    ) -> Ticket:
        if self.max_length and self._waiting >= self.max_length:
            self.counters["rejected_full"] += 1
            raise QueueFull(
                f"the admission queue is full ({self._waiting} requests wait; "
                f"--router-queue-max-length {self.max_length})"
            )
        now = self.clock()
        t = Ticket(
            next(self._seq),
            payload,
            scope,
            int(prompt_tokens),
            int(cached_tokens),
            float(priority_jump),
            now,
        )
        t._key = order_key(
            self.policy, now - self._start, t.prompt_tokens, t.cached_tokens, t.priority_jump
        )
        heapq.heappush(self._heap, (-t._key, t.seq, t))
        if self.max_wait:
            self._arrivals.append(t)
        self._waiting += 1
        self.counters["queued"] += 1
        return t

    def head(self) -> Ticket | None:
        heap = self._heap
        while heap and heap[0][2].outcome != "waiting":
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop_ready(self, router: Any) -> Ticket | None:
        """The head, if it may go now: nothing in transit and its scope not busy. It becomes
        the one in transit until :meth:`done`."""
        if self.in_transit is not None:
            return None
        t = self.head()
        if t is None or self.fleet_busy(router, t.scope):
            return None
        heapq.heappop(self._heap)
        self._leave(t, "released")
        self.in_transit = t
        return t

    def done(self, ticket: Ticket) -> None:
        """The released request was routed (or gave up): the next head may be examined."""
        if self.in_transit is ticket:
            self.in_transit = None

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a waiting request (its client went away). False if it was not waiting."""
        if ticket.outcome != "waiting":
            return False
        self._leave(ticket, "cancelled")
        return True

    def expire(self, now: float | None = None) -> list[Ticket]:
        """Remove and return the requests that waited longer than ``max_wait``."""
        if not self.max_wait:
            return []
        now = self.clock() if now is None else now
        out = []
        arrivals = self._arrivals
        while arrivals:
            t = arrivals[0]
            if t.outcome != "waiting":
                arrivals.popleft()
                continue
            if now - t.enqueued_at < self.max_wait:
                break
            arrivals.popleft()
            self._leave(t, "timeout", now)
            out.append(t)
        return out

    def next_deadline(self) -> float | None:
        """When the oldest waiting request times out (None without ``max_wait``)."""
        if not self.max_wait:
            return None
        for t in self._arrivals:
            if t.outcome == "waiting":
                return t.enqueued_at + self.max_wait
        return None

    def waiting(self) -> Iterable[Ticket]:
        """Waiting tickets in release order (for inspection; O(n log n))."""
        live = [e for e in self._heap if e[2].outcome == "waiting"]
        return [e[2] for e in sorted(live)]

    def stats(self) -> dict[str, Any]:
        return {
            "depth": self._waiting,
            "in_transit": self.in_transit is not None,
            "policy": self.policy,
            "threshold": self.threshold,
            **self.counters,
        }

    def _leave(self, t: Ticket, outcome: str, now: float | None = None) -> None:
        t.outcome = outcome
        t.left_at = self.clock() if now is None else now
        self._waiting -= 1
        self.counters[outcome] += 1
        if len(self._heap) > 2 * self._waiting + 64:  # drop entries that left from the middle
            self._heap = [e for e in self._heap if e[2].outcome == "waiting"]
            heapq.heapify(self._heap)
            self._arrivals = deque(t for t in self._arrivals if t.outcome == "waiting")

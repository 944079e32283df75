"""Outlier detection: take an engine that keeps failing requests out of rotation, even while
its health path answers, and let it back after an ejection time that grows with each
ejection (Envoy's consecutive-5xx outlier detection, same vocabulary and defaults).

A failure is an engine 5xx answer, a connection error or reset, a per-try or request timeout,
or a stream that broke mid-answer; a 4xx is the client's and a client hang-up tells nothing,
so neither counts. Any success resets the count. After ``consecutive_failures`` in a row the
worker is ejected for ``base_ejection_time x ejections`` (capped by ``max_ejection_time``)
unless ``max_ejection_percent`` of the fleet is already ejected (at least one worker may always
be ejected, as in Envoy). When the time is up the worker is probed: a passing probe puts it
back; a failing one keeps it down until a probe passes. An ejected worker that went down
meanwhile (its health probe failed, or its adapter said so: a crashed engine) is back with its
first passing probe - a restarted engine starts with a clean record. While a worker stays in
rotation its ejection multiplier decays by one per base ejection time, as Envoy's does per
interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SOURCE = "outlier"  # the fleet's down_by tag of an ejected worker


@dataclass
class OutlierSettings:
    consecutive_failures: int = 5  # 0 = outlier detection off
    base_ejection_time: float = 30.0
    max_ejection_time: float = 300.0
    max_ejection_percent: float = 10.0


@dataclass
class _State:
    consecutive: int = 0
    ejections: int = 0  # the back-off multiplier
    ejected_until: float | None = None
    last_change: float = 0.0  # when the multiplier last grew or decayed
    total_ejections: int = 0
    last_reason: str | None = None
    went_down: bool = False  # failed a probe while ejected: it crashed, and may come back new


class OutlierDetector:
    """Counts outcomes per worker and ejects through the fleet (``down_by`` "outlier")."""

    def __init__(
        self,
        fleet: Any,
        settings: OutlierSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_eject: Callable[[str, str, float], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = settings or OutlierSettings()
        self.clock = clock
        self.on_eject = on_eject  # (worker_id, reason, seconds) - metrics
        self._states: dict[str, _State] = {}

    @property
    def enabled(self) -> bool:
        return self.settings.consecutive_failures > 0

    def _state(self, worker_id: str) -> _State:
        st = self._states.get(worker_id)
        if st is None:
            st = self._states[worker_id] = _State(last_change=self.clock())
        return st

    def success(self, worker_id: str) -> None:
        st = self._states.get(worker_id)
        if st is not None:
            st.consecutive = 0
            self._decay(st, self.clock())

    def failure(self, worker_id: str, reason: str) -> bool:
        """Count one failure; True when it ejected the worker."""
        if not self.enabled or worker_id not in self.fleet.workers:
            return False
        st = self._state(worker_id)
        st.consecutive += 1
        st.last_reason = reason
        now = self.clock()
        self._decay(st, now)
        if st.ejected_until is not None or st.consecutive < self.settings.consecutive_failures:
            return False
        if not self._may_eject():
            log.warning(
                "worker %s: %d failures in a row, but %.0f%% of the fleet is already ejected "
                "(--outlier-max-ejection-percent)",
                worker_id,
                st.consecutive,
                self.settings.max_ejection_percent,
            )
            return False
        st.ejections += 1
        st.total_ejections += 1
        st.last_change = now
        seconds = min(
            self.settings.base_ejection_time * st.ejections,
            max(self.settings.max_ejection_time, self.settings.base_ejection_time),
        )
        st.ejected_until = now + seconds
        st.went_down = False
        why = (
            f"ejected for {seconds:g} s after {st.consecutive} consecutive failures "
            f"(last: {reason})"
        )
        self.fleet.mark_unhealthy(worker_id, why, source=SOURCE)
        if self.on_eject is not None:
            self.on_eject(worker_id, reason, seconds)
        return True

    def _decay(self, st: _State, now: float) -> None:
        base = self.settings.base_ejection_time
        if st.ejected_until is None and st.ejections and base > 0:
            steps = int((now - st.last_change) // base)
            if steps:
                st.ejections = max(0, st.ejections - steps)
                st.last_change = now

    def _may_eject(self) -> bool:
        workers = self.fleet.workers
        n = len(workers)
        ejected = sum(
            1 for w, s in self._states.items() if s.ejected_until is not None and w in workers
        )
        return n > 0 and ejected * 100.0 / n < self.settings.max_ejection_percent

    def ejected(self, worker_id: str) -> bool:
        st = self._states.get(worker_id)
        return st is not None and st.ejected_until is not None

    def due(self) -> list[str]:
        """Ejected workers whose time is up: the prober checks them before they return."""
        now = self.clock()
        return [
            w
            for w, s in self._states.items()
            if s.ejected_until is not None and now >= s.ejected_until
        ]

    def next_due_in(self) -> float | None:
        now = self.clock()
        times = [s.ejected_until - now for s in self._states.values() if s.ejected_until]
        return max(0.0, min(times)) if times else None

    def went_down(self, worker_id: str) -> None:
        """The worker stopped answering its health path (or its adapter says it is down)."""
        st = self._states.get(worker_id)
        if st is not None and st.ejected_until is not None:
            st.went_down = True

    def probe_passed(self, worker_id: str) -> None:
        """A passing probe after the ejection time (or after the worker went down and came
        back): the worker is back in rotation."""
        st = self._states.get(worker_id)
        if st is None or st.ejected_until is None:
            return
        if self.clock() < st.ejected_until and not st.went_down:
            return
        st.ejected_until = None
        st.went_down = False
        st.consecutive = 0
        st.last_change = self.clock()
        log.info("worker %s back from ejection (%d ejections so far)", worker_id, st.ejections)
        self.fleet.mark_healthy(worker_id, source=SOURCE)

    def describe(self, worker_id: str) -> dict[str, Any]:
        st = self._states.get(worker_id)
        if st is None:
            return {"consecutive_failures": 0, "ejected": False, "ejections": 0}
        left = None if st.ejected_until is None else max(0.0, st.ejected_until - self.clock())
        return {
            "consecutive_failures": st.consecutive,
            "ejected": st.ejected_until is not None,
            "ejected_for_s": None if left is None else round(left, 3),
            "ejections": st.total_ejections,
            "last_failure": st.last_reason,
        }

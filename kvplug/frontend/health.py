"""Background health probing: every worker's health path each interval. A worker is marked
down after ``unhealthy_threshold`` failed probes in a row (one slow answer - an engine busy
tokenizing a huge prompt, say - is not a dead engine; Envoy's ``unhealthy_threshold``), or at
its first failed probe if it never passed one; a
passing probe makes it routable again, and brings an ejected worker back once its ejection
time is up (``outliers.py``). Workers whose served models are not configured have them
discovered from ``GET /v1/models`` once healthy."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from kvplug.frontend.fleet import Fleet, WorkerEntry
from kvplug.frontend.outliers import OutlierDetector
from kvplug.frontend.timeouts import within
from kvplug.frontend.upstream import Upstream
from kvplug.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(
        self,
        fleet: Fleet,
        upstream: Upstream,
        interval: float = 5.0,
        timeout: float = 2.0,
        *,
        unhealthy_threshold: int = 2,
        outliers: OutlierDetector | None = None,
    ) -> None:
        self.fleet = fleet
        self.upstream = upstream
        self.interval = interval
        self.timeout = timeout
        self.unhealthy_threshold = max(1, unhealthy_threshold)
        self.outliers = outliers
        self.failures: dict[str, int] = {}  # failed probes in a row, per worker
        self.passed: set[str] = set()  # workers that ever passed a probe
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None and self.interval > 0:
            self._task = asyncio.create_task(self._run(), name="kvplug-health")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def poke(self) -> None:
        """Probe now (a request just failed on some worker)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # never let the prober die
                log.exception("health probe round failed")
            self._wake.clear()
            wait = self.interval
            due = self.outliers.next_due_in() if self.outliers is not None else None
            if due is not None:  # an ejection ends before the next round: probe it then
                wait = min(wait, due + 0.01)
            try:
                # not wait_for: on 3.11 it drops a stop()'s cancel that arrives as a poke()
                # wakes it, and the prober (and the shutdown waiting for it) runs on
                await within(self._wake.wait(), wait)
                await asyncio.sleep(min(0.2, self.interval))  # let a burst of failures settle
            except asyncio.TimeoutError:
                pass

    async def probe_all(self) -> None:
        entries = list(self.fleet.workers.values())
        if entries:
            await asyncio.gather(*(self.probe(e) for e in entries))

    async def probe(self, entry: WorkerEntry) -> bool:
        worker_id = entry.spec.worker_id
        url = entry.url_base + entry.adapter.health_path
        try:
            status, _ = await self.upstream.get(url, self.timeout)
            ok, reason = status == 200, f"health probe answered HTTP {status}"
        except Exception as exc:
            ok, reason = False, f"health probe failed: {type(exc).__name__}: {exc}"
        entry.last_probe = time.monotonic()
        if worker_id not in self.fleet.workers:
            self.failures.pop(worker_id, None)
            self.passed.discard(worker_id)
            return ok  # removed meanwhile
        if self.outliers is not None and (not ok or "adapter" in entry.down_by):
            self.outliers.went_down(worker_id)  # not just sick: down (crashed, restarting)
        if ok:
            self.failures.pop(worker_id, None)
            self.passed.add(worker_id)
            self.fleet.mark_healthy(worker_id)
            if self.outliers is not None:  # once its ejection time is up, or it went down
                self.outliers.probe_passed(worker_id)
            if not entry.models and not entry.spec.models:
                await self._discover_models(entry)
        else:
            n = self.failures[worker_id] = self.failures.get(worker_id, 0) + 1
            # an engine never seen up gets no benefit of the doubt (a new or dead worker)
            if n >= self.unhealthy_threshold or worker_id not in self.passed:
                self.fleet.mark_unhealthy(worker_id, f"{reason} ({n} in a row)", source="probe")
            else:
                log.info(
                    "worker %s: %s (%d of %d before it is down)",
                    worker_id,
                    reason,
                    n,
                    self.unhealthy_threshold,
                )
        return ok

    async def _discover_models(self, entry: WorkerEntry) -> None:
        try:
            status, body = await self.upstream.get(entry.url_base + "/v1/models", self.timeout)
            if status != 200:
                return
            data = json.loads(body).get("data") or []
            names = {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
        except Exception as exc:
            log.debug("worker %s: model discovery failed: %s", entry.spec.worker_id, exc)
            return
        if names:
            entry.models = names
            log.info("worker %s serves %s", entry.spec.worker_id, sorted(names))

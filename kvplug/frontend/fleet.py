"""The workers behind one frontend: specs, the router's view, adapters, event sinks, health.

Adding a worker registers it with the router and starts its adapter's event source; removing
does the reverse. Health is the frontend's: an engine that failed a request or a probe is
``unhealthy`` and excluded from routing (``RouteRequest.exclude_workers``) until a probe passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from kvplug.adapters import EngineAdapter, PDStyle, create_adapter
from kvplug.errors import ConfigError, UnknownWorker
from kvplug.frontend.config import MAX_DP_RANK, MAX_DP_SIZE, WorkerSpec

log = logging.getLogger(__name__)

# the request header vLLM and SGLang read a data-parallel rank from (WorkerEntry.rank_on_url)
RANK_HEADER = "X-Data-Parallel-Rank"


def _size(n: int) -> str:
    return str(n) if n else "unknown"  # 0 is "not known", not "none"


class FleetSink:
    """Where one worker's adapter puts events and attributes (kvplug.adapters.WorkerSink)."""

    __slots__ = (
        "worker_id",
        "block_size",
        "_router",
        "_loop",
        "events",
        "last_event_at",
        "errors",
        "active",
        "on_capacity",
        "on_ranks",
    )

    def __init__(self, worker_id: str, router: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker_id = worker_id
        self.block_size = router.index.block_size
        self._router = router
        self._loop = loop
        self.events = 0
        self.errors = 0
        self.last_event_at: float | None = None
        self.active = True  # false once the worker is removed: late events are dropped
        self.on_capacity: Any = None  # set by the fleet
        self.on_ranks: Any = None  # set by the fleet

    def apply(self, event) -> None:
        if not self.active:
            return
        try:
            self._router.apply_event(event)
        except Exception as exc:  # a bad event must never take the frontend down
            self.errors += 1
            log.warning("worker %s: event dropped: %s", self.worker_id, exc)
            return
        self.events += 1
        self.last_event_at = time.monotonic()

    def apply_many(self, events: Iterable) -> None:
        """A subscriber's batch: one pass through the index (``Router.apply_events``)."""
        if not self.active:
            return
        batch = events if isinstance(events, list) else list(events)
        try:
            applied = self._router.apply_events(batch)
        except Exception as exc:  # a bad event must never take the frontend down
            self.errors += 1
            log.warning("worker %s: event batch dropped: %s", self.worker_id, exc)
            return
        self.events += applied
        self.errors += len(batch) - applied
        if applied:
            self.last_event_at = time.monotonic()

    def apply_threadsafe(self, events: Iterable) -> None:
        self._loop.call_soon_threadsafe(self.apply_many, list(events))

    def set_attributes(self, values: dict[str, float], ts: float | None = None) -> None:
        if self.active:
            self._router.set_attributes(self.worker_id, values, ts)

    def update_capacity(
        self, kv_capacity_blocks: int | None = None, max_batched_tokens: int | None = None
    ) -> None:
        if not self.active or self.on_capacity is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # called from an adapter's thread
            running = None
        args = (self.worker_id, kv_capacity_blocks, max_batched_tokens)
        if running is self._loop:
            self.on_capacity(*args)
        else:
            self._loop.call_soon_threadsafe(self.on_capacity, *args)

    def update_ranks(self, ranks: range) -> Any:
        """The DP ranks the engine turned out to run behind the worker's URL (it was not up
        when the worker was added): the worker as re-registered with them, when it was given
        without dp_start/dp_size, else None (it keeps its ranks). Call on the event loop."""
        if not self.active or self.on_ranks is None:
            return None
        return self.on_ranks(self.worker_id, ranks)


class _ViewEpoch:
    """Bumped by every change that the fleet's per-request views read (membership, served
    models, draining, configured model names): ``Fleet`` keeps those views until it moves,
    instead of rebuilding them from every worker on every request (18 us at 64 workers)."""

    value = 0

    @classmethod
    def bump(cls) -> None:
        cls.value += 1


class _FleetView(NamedTuple):
    """The per-request views, as of ``_ViewEpoch.value == epoch``."""

    epoch: int
    models: frozenset[str]  # every name clients may ask for
    disaggregated: bool  # a prefill-role worker takes requests
    per_model: dict[str, frozenset[str] | None]  # workers_for_model's answers, filled lazily


class WorkerEntry:
    __slots__ = (
        "spec",
        "worker",
        "adapter",
        "sink",
        "down_by",
        "_draining",
        "last_error",
        "last_probe",
        "_models",
        "inflight",
        "url_base",
    )

    def __init__(
        self, spec: WorkerSpec, worker: Any, adapter: EngineAdapter, sink: FleetSink
    ) -> None:
        self.spec = spec
        self.worker = worker
        self.adapter = adapter
        self.sink = sink
        self.down_by: set[str] = set()  # who says it is down: request, probe, adapter
        self._draining = False
        self.last_error: str | None = None
        self.last_probe: float | None = None
        self._models: frozenset[str] = frozenset(spec.models)
        self.inflight = 0
        self.url_base = spec.url

    @property
    def models(self) -> frozenset[str]:
        """The model names the worker serves (configured, or read from its /v1/models)."""
        return self._models

    @models.setter
    def models(self, names: Iterable[str]) -> None:
        self._models = frozenset(names)
        _ViewEpoch.bump()

    def rank_on_url(self, dp_rank: int) -> int | None:
        """What ``X-Data-Parallel-Rank`` names for a request routed to ``dp_rank``: its index
        among the ranks behind the worker's URL, or None for a one-rank worker. vLLM 0.32
        (``_get_data_parallel_rank``: the index into the engines that API server manages) and
        SGLang 0.5.23 (``extract_routed_dp_rank_from_header``) then serve it on the rank
        kvplug chose; without it their own balancer picks, and the rank whose cache kvplug
        counted and whose load it books may not be the one that runs it."""
        return dp_rank - self.spec.dp_start if self.spec.dp_size > 1 else None

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        _ViewEpoch.bump()

    @property
    def healthy(self) -> bool:
        return not self.down_by  # optimistic until a request, a probe or the adapter says no

    def describe(self) -> dict[str, Any]:
        ready = self.adapter.events_ready(self.spec.worker_id)
        return {
            **self.spec.to_dict(),
            "healthy": self.healthy,
            "down_by": sorted(self.down_by),
            "draining": self.draining,
            "inflight": self.inflight,
            "last_error": self.last_error,
            "events": self.sink.events,
            "event_errors": self.sink.errors,
            "events_ready": ready,
            "last_event_age_s": (
                None
                if self.sink.last_event_at is None
                else round(time.monotonic() - self.sink.last_event_at, 3)
            ),
            "served_models": sorted(self.models),
        }


def _ranks_to_register(spec: WorkerSpec, ranks: range) -> range | None:
    """The DP ranks a worker given without dp_start/dp_size takes from its engine's answer;
    None when the worker keeps its ranks (given ones, the same ones, none, or more than
    kvplug registers per worker: logged)."""
    if not spec.dp_from_engine or len(ranks) == 0:
        return None
    if (ranks.start, len(ranks)) == (spec.dp_start, spec.dp_size):
        return None
    if len(ranks) > MAX_DP_SIZE or ranks.start < 0 or ranks.start > MAX_DP_RANK - MAX_DP_SIZE:
        log.warning(
            "worker %s: its engine reports DP ranks %d..%d, beyond what kvplug registers per "
            "worker; it keeps %d rank(s) (set dp_start/dp_size)",
            spec.worker_id,
            ranks.start,
            ranks.stop - 1,
            spec.dp_size,
        )
        return None
    log.info(
        "worker %s: its engine runs DP ranks %d..%d behind %s; registered with all of them",
        spec.worker_id,
        ranks.start,
        ranks.stop - 1,
        spec.url,
    )
    return ranks


class Fleet:
    def __init__(self, router: Any, engine_headers: dict[str, str] | None = None) -> None:
        self.router = router
        self.engine_headers = dict(engine_headers or {})  # each adapter's (engine_headers)
        self.workers: dict[str, WorkerEntry] = {}
        self.adapters: dict[str, EngineAdapter] = {}
        self.unhealthy: frozenset[str] = frozenset()
        self._configured_models: frozenset[str] = frozenset()
        self._lock = asyncio.Lock()
        self._view: _FleetView | None = None

    @property
    def configured_models(self) -> frozenset[str]:
        """--served-model-name: names clients may ask for besides what workers report."""
        return self._configured_models

    @configured_models.setter
    def configured_models(self, names: Iterable[str]) -> None:
        self._configured_models = frozenset(names)
        _ViewEpoch.bump()

    # -- membership -------------------------------------------------------------------------
    def adapter_for(self, kind: str) -> EngineAdapter:
        adapter = self.adapters.get(kind)
        if adapter is None:
            adapter = self.adapters[kind] = create_adapter(kind)
            adapter.engine_headers = self.engine_headers
            loop = asyncio.get_running_loop()

            def on_liveness(worker_id: str, alive: bool) -> None:  # any thread
                loop.call_soon_threadsafe(self._set_liveness, worker_id, alive)

            adapter.add_liveness_listener(on_liveness)
        return adapter

    def _set_capacity(self, worker_id: str, blocks: int | None, batched: int | None) -> None:
        """Re-register the worker with the sizes its engine reported (load is kept)."""
        entry = self.workers.get(worker_id)
        if entry is None:
            return
        changed: dict[str, int] = {}
        for name, reported in (("kv_capacity_blocks", blocks), ("max_batched_tokens", batched)):
            # a size set in the worker's config wins over what the engine says
            configured = getattr(entry.spec, name)
            if reported and not configured and getattr(entry.worker, name) != reported:
                changed[name] = int(reported)
        if changed:
            entry.worker = dataclasses.replace(entry.worker, **changed)
            self.router.add_worker(entry.worker)
            if entry.draining:
                self.router.drain_worker(worker_id)
            log.info(
                "worker %s: %s KV blocks, %s batched tokens (from the engine)",
                worker_id,
                _size(entry.worker.kv_capacity_blocks),
                _size(entry.worker.max_batched_tokens),
            )

    def _set_ranks(self, worker_id: str, ranks: range) -> Any:
        """Re-register a worker given without dp_start/dp_size with the DP ranks its engine
        reported after it was added (load and indexed blocks kept; see _with_engine_ranks);
        the new Worker, or None when the worker keeps its ranks."""
        entry = self.workers.get(worker_id)
        if entry is None or (new := _ranks_to_register(entry.spec, ranks)) is None:
            return None
        start, size = new.start, len(new)
        entry.spec = dataclasses.replace(entry.spec, dp_start=start, dp_size=size)
        entry.worker = dataclasses.replace(entry.worker, dp_start=start, dp_size=size)
        self.router.add_worker(entry.worker)
        if entry.draining:
            self.router.drain_worker(worker_id)
        _ViewEpoch.bump()
        return entry.worker

    def _set_liveness(self, worker_id: str, alive: bool) -> None:
        if alive:
            self.mark_healthy(worker_id, source="adapter")
        else:
            self.mark_unhealthy(worker_id, "its engine adapter reports it down", source="adapter")

    def _register(self, spec: WorkerSpec) -> WorkerEntry:
        """The synchronous part of adding: the router learns the worker (in call order)."""
        if spec.worker_id in self.workers:
            raise ConfigError(f"worker {spec.worker_id!r} already exists")
        adapter = self.adapter_for(spec.engine)
        if spec.role == "prefill" and adapter.pd_style is PDStyle.NONE:
            raise ConfigError(
                f"worker {spec.worker_id}: engine kind {spec.engine!r} has no "
                "disaggregated mode, it cannot be a prefill worker"
            )
        worker = spec.to_worker()
        self.router.add_worker(worker)
        sink = FleetSink(spec.worker_id, self.router, asyncio.get_running_loop())
        sink.on_capacity = self._set_capacity
        sink.on_ranks = self._set_ranks
        entry = WorkerEntry(spec, worker, adapter, sink)
        self.workers[spec.worker_id] = entry
        _ViewEpoch.bump()
        return entry

    def _unregister(self, entry: WorkerEntry) -> None:
        entry.sink.active = False
        if self.workers.get(entry.spec.worker_id) is entry:
            del self.workers[entry.spec.worker_id]
            _ViewEpoch.bump()
            self.router.remove_worker(entry.spec.worker_id)
            self._refresh_unhealthy()

    async def _start(self, entry: WorkerEntry) -> WorkerEntry:
        spec = entry.spec
        try:
            await entry.adapter.start_worker(entry.worker, entry.sink)
        except Exception as exc:
            self._unregister(entry)
            raise ConfigError(
                f"worker {spec.worker_id}: its {spec.engine} adapter failed to start: {exc}"
            ) from exc
        log.info(
            "worker %s added (%s %s, role %s)", spec.worker_id, spec.engine, spec.url, spec.role
        )
        return entry

    async def _with_engine_ranks(self, spec: WorkerSpec) -> WorkerSpec:
        """A worker given without dp_start/dp_size gets the DP ranks its engine runs behind
        its URL (vLLM: /kv_event_sources; SGLang: /server_info), so that each rank is an
        endpoint of its own: indexed from its own events, loaded and routed to (with
        X-Data-Parallel-Rank). An engine that does not answer yet is asked again by its
        adapter, which reports the ranks through the sink (_set_ranks)."""
        if not spec.dp_from_engine or not spec.url or spec.worker_id in self.workers:
            return spec  # (a duplicate id is refused by _register without asking)
        try:
            adapter = self.adapter_for(spec.engine)
        except ConfigError:  # an unknown kind: _register says so
            return spec
        try:
            ranks = await adapter.engine_ranks(spec.url)
        except Exception as exc:  # noqa: BLE001 - an engine's answer must not stop the add
            log.warning("worker %s: could not ask its engine for its DP ranks (%s)", spec.url, exc)
            return spec
        new = _ranks_to_register(spec, ranks) if ranks is not None else None
        if new is None:
            return spec
        return dataclasses.replace(spec, dp_start=new.start, dp_size=len(new))

    async def add(self, spec: WorkerSpec) -> WorkerEntry:
        spec = await self._with_engine_ranks(spec)
        async with self._lock:
            return await self._start(self._register(spec))

    async def add_many(self, specs: list[WorkerSpec]) -> list[WorkerEntry]:
        """Register all (in order, so the router's view is deterministic), then start their
        adapters concurrently (discovery can take seconds per engine)."""
        specs = list(await asyncio.gather(*(self._with_engine_ranks(s) for s in specs)))
        async with self._lock:
            entries: list[WorkerEntry] = []
            try:
                for spec in specs:
                    entries.append(self._register(spec))
            except BaseException:
                for entry in entries:
                    self._unregister(entry)
                raise
            results = await asyncio.gather(
                *(self._start(e) for e in entries), return_exceptions=True
            )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ConfigError("; ".join(str(e) for e in errors))
        return entries

    def drain(self, worker_id: str) -> WorkerEntry:
        entry = self.get(worker_id)
        self.router.drain_worker(worker_id)
        entry.draining = True
        log.info("worker %s draining (%d in flight)", worker_id, entry.inflight)
        return entry

    async def remove(self, worker_id: str) -> WorkerEntry:
        async with self._lock:
            entry = self.get(worker_id)
            entry.sink.active = False
            del self.workers[worker_id]
            _ViewEpoch.bump()
            self.router.remove_worker(worker_id)
            self._refresh_unhealthy()
            try:
                await entry.adapter.stop_worker(worker_id)
            except Exception as exc:
                log.warning("worker %s: adapter stop failed: %s", worker_id, exc)
            log.info("worker %s removed", worker_id)
            return entry

    async def close(self) -> None:
        for worker_id in list(self.workers):
            entry = self.workers[worker_id]
            entry.sink.active = False
            try:
                await entry.adapter.stop_worker(worker_id)
            except Exception as exc:
                log.warning("worker %s: adapter stop failed: %s", worker_id, exc)
        for adapter in self.adapters.values():
            try:
                await adapter.close()
            except Exception as exc:
                log.warning("adapter %s close failed: %s", adapter.kind, exc)

    def get(self, worker_id: str) -> WorkerEntry:
        entry = self.workers.get(worker_id)
        if entry is None:
            raise UnknownWorker(f"unknown worker {worker_id!r}")
        return entry

    # -- health ------------------------------------------------------------------------------
    def _refresh_unhealthy(self) -> None:
        self.unhealthy = frozenset(w for w, e in self.workers.items() if not e.healthy)

    def mark_unhealthy(self, worker_id: str, reason: str, source: str = "request") -> None:
        """``source``: "request" (failed before its first byte), "probe" (health path),
        "adapter" (the engine adapter's own verdict) or "outlier" (ejected after consecutive
        failures, ``outliers.py``). A passing probe clears the first two; the adapter and the
        outlier detector clear their own."""
        entry = self.workers.get(worker_id)
        if entry is None:
            return
        if entry.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, reason)
        entry.down_by.add(source)
        entry.last_error = reason
        self._refresh_unhealthy()

    def mark_healthy(self, worker_id: str, source: str = "probe") -> None:
        entry = self.workers.get(worker_id)
        if entry is None or entry.healthy:
            if entry is not None and source == "adapter":
                entry.down_by.discard("adapter")
            return
        entry.down_by -= {source} if source in ("adapter", "outlier") else {"request", "probe"}
        if entry.healthy:
            log.info("worker %s healthy again", worker_id)
            self._refresh_unhealthy()

    # -- views --------------------------------------------------------------------------------
    def _views(self) -> _FleetView:
        view = self._view
        if view is None or view.epoch != _ViewEpoch.value:
            names = set(self.configured_models)
            for e in self.workers.values():
                names |= e.models
            split = any(e.spec.role == "prefill" and not e.draining for e in self.workers.values())
            view = self._view = _FleetView(_ViewEpoch.value, frozenset(names), split, {})
        return view

    @property
    def epoch(self) -> int:
        """Moves with every change of membership, served models or draining: what a caller
        derived from the workers at one epoch holds until it moves."""
        return _ViewEpoch.value

    @property
    def disaggregated(self) -> bool:
        """Two-stage dispatch when a prefill-role worker takes requests."""
        return self._views().disaggregated

    def models(self) -> frozenset[str]:
        """Every model name clients may ask for (configured, and what workers serve)."""
        return self._views().models

    def workers_for_model(self, model: str) -> frozenset[str] | None:
        """Workers known to serve ``model``; None when every worker may (nothing known)."""
        per_model = self._views().per_model
        if model in per_model:
            return per_model[model]
        serving: frozenset[str] | None = None
        if any(e.models for e in self.workers.values()):
            serving = frozenset(
                w for w, e in self.workers.items() if model in e.models or not e.models
            )
            if len(serving) == len(self.workers):
                serving = None
        if len(per_model) < 1024:  # client-chosen names: a bounded memo
            per_model[model] = serving
        return serving

    def _router_load(self, worker_id: str) -> dict[str, float]:
        """The router's active load of a worker, summed over its DP ranks."""
        try:
            ranks = self.router.active_load(worker_id)
        except Exception:
            return {}
        out: dict[str, float] = {}
        for values in ranks.values():
            for key, value in values.items():
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "id": w,
                "healthy": e.healthy,
                "draining": e.draining,
                "inflight": e.inflight,
                "events": e.sink.events,
                "events_ready": e.adapter.events_ready(w),
                "load": self._router_load(w),
            }
            for w, e in list(self.workers.items())
        ]

    def event_drops(self) -> list[tuple[str, str, str, int]]:
        """(engine kind, worker, reason, count) of what every adapter's event sources
        dropped or rejected (``EngineAdapter.event_drops``), for ``/metrics``."""
        out: list[tuple[str, str, str, int]] = []
        for kind, adapter in list(self.adapters.items()):
            try:
                drops = adapter.event_drops()
            except Exception:  # read from another thread's state: never fail a scrape
                log.exception("%s adapter: event drop counters unreadable", kind)
                continue
            for worker, reasons in drops.items():
                out.extend((kind, worker, reason, n) for reason, n in reasons.items())
        return out

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready = at least one healthy, non-draining worker, and every event source is up."""
        routable = [w for w, e in self.workers.items() if e.healthy and not e.draining]
        waiting = [w for w, e in self.workers.items() if e.adapter.events_ready(w) is False]
        ok = bool(routable) and not waiting
        now = time.monotonic()
        events = {
            w: {
                "events": e.sink.events,
                "last_event_age_s": None
                if e.sink.last_event_at is None
                else round(now - e.sink.last_event_at, 3),
            }
            for w, e in self.workers.items()
        }
        return ok, {
            "ready": ok,
            "routable_workers": routable,
            "event_sources_not_ready": waiting,
            "workers": len(self.workers),
            "events": events,
        }

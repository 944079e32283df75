"""The vLLM engine adapter the frontend uses (``kvplug.adapters`` registry, kind ``vllm``).

Per worker: discover its event sources and cache config, refuse a block-size mismatch, consume
its KV events on the process-wide subscriber thread (feeding ``sink.apply_threadsafe``), scrape
its ``/metrics`` into ``sink.set_attributes`` and keep a liveness verdict (metrics failures and
event silence) that listeners (the frontend) can act on. P/D bodies come from ``pd.py``.

Worker fields used: ``url`` (engine base URL: discovery, metrics), ``event_endpoint`` /
``replay_endpoint`` (when the engine cannot tell), ``dp_start`` / ``dp_size``, ``metrics_url``,
``labels["kv_events_topic"]`` (the engine's ``--kv-events-config`` topic when not discovered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvplug import AllCleared, ConfigError
from kvplug.adapters import PDContext, VllmHttpAdapter, register_adapter, report_capacity

from .discovery import (
    EngineInfo,
    EngineNotUp,
    RankSource,
    check_block_size,
    discover,
    fetch_event_sources,
)
from .metrics import MetricsSample, MetricsScraper
from .pd import decode_body, prefill_body
from .subscriber import EventSource, VllmSubscriber

if TYPE_CHECKING:
    from kvplug import Worker
    from kvplug.adapters import WorkerSink

log = logging.getLogger("kvplug.vllm")
RANKS_TIMEOUT = 2.0  # seconds for /kv_event_sources when a worker is added (it waits)
ANSWER_REUSE_S = 5.0  # engine_ranks' answer serves the worker's start within this many seconds

LivenessListener = Callable[[str, bool], Any]


@dataclass
class _WorkerRun:
    worker_id: str
    info: EngineInfo
    scraper: MetricsScraper | None
    alive: bool = True
    started_at: float | None = None  # the engine's process_start_time_seconds
    restarts_seen: int = 0  # subscriber.restarts() at the last good scrape
    capacity_reported: int = 0  # num_gpu_blocks last handed to the sink
    worker: Worker | None = None  # as subscribed (a restarted engine is discovered again)
    sink: Any = None
    rediscovering: bool = False  # a _rediscover of this run is under way
    given_up: bool = False  # its restarted engine could not be consumed: down, not subscribed


def _rank_run(url: str, sources: list[RankSource] | None) -> range | None:
    """The DP ranks ``/kv_event_sources`` listed, as a run; None when it listed none, or
    ranks with a gap (logged: kvplug registers a worker's ranks as one run)."""
    ranks = sorted({rs.dp_rank for rs in sources or ()})
    if not ranks:
        return None
    if len(ranks) != ranks[-1] - ranks[0] + 1:  # distinct and sorted: a gap
        log.warning(
            "vLLM %s: /kv_event_sources lists DP ranks %s, not a contiguous run; "
            "registered with one rank (set dp_start/dp_size)",
            url,
            ranks,
        )
        return None
    return range(ranks[0], ranks[-1] + 1)


def _sources_of(info: EngineInfo, worker: Worker) -> list[RankSource]:
    """The sources of the ranks the worker is registered with (what it subscribes)."""
    return [rs for rs in info.sources if rs.dp_rank in worker.dp_ranks]


def _log_failure(done: Any) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("vLLM rediscovery failed", exc_info=done.exception())


class VllmAdapter(VllmHttpAdapter):
    """vLLM: KV events over ZMQ (with replay), metrics, NIXL P/D."""

    kind = "vllm"

    def __init__(
        self,
        *,
        metrics_period: float | None = None,
        replay_timeout: float = 2.0,
        unhealthy_after: int = 2,
        discovery_retry: float = 2.0,
    ) -> None:
        self.metrics_period = metrics_period or float(
            os.environ.get("KVPLUG_VLLM_METRICS_PERIOD", "1.0")
        )
        self.unhealthy_after = unhealthy_after
        self.subscriber = VllmSubscriber(replay_timeout=replay_timeout)
        self._runs: dict[str, _WorkerRun] = {}
        self.discovery_retry = discovery_retry
        self._waiting: dict[str, asyncio.Task] = {}  # workers whose engine is not up yet
        self._listeners: list[LivenessListener] = []
        self._lock = threading.Lock()
        self._alive_lock = threading.RLock()  # liveness verdicts (scraper threads, the loop)
        self._loop: asyncio.AbstractEventLoop | None = None  # rediscovery runs on it
        self._rediscoveries: set[Any] = set()  # their futures, cancelled by close()
        # url -> (when, /kv_event_sources answer) of engine_ranks, for the start that follows
        self._answers: dict[str, tuple[float, list[RankSource] | None]] = {}
        self._closed = False

    # -- liveness -----------------------------------------------------------------------------
    def add_liveness_listener(self, fn: LivenessListener) -> None:
        """``fn(worker_id, alive)`` is called from a scraper thread or the event loop when a
        verdict changes, under a lock: it must not block (the fleet's posts to its loop)."""
        self._listeners.append(fn)

    def worker_alive(self, worker_id: str) -> bool | None:
        run = self._runs.get(worker_id)
        return None if run is None else run.alive

    def last_event_age(self, worker_id: str) -> float | None:
        t = self.subscriber.last_message_at(worker_id)
        return None if t is None else time.monotonic() - t

    def _set_alive(self, run: _WorkerRun, alive: bool) -> None:
        with self._alive_lock:  # a verdict and its announcement are one step
            if run.alive == alive or (alive and run.given_up):
                return
            run.alive = alive
            log.warning("vLLM worker %s is %s", run.worker_id, "back up" if alive else "DOWN")
            for fn in list(self._listeners):
                try:
                    fn(run.worker_id, alive)
                except Exception:
                    log.exception("liveness listener failed for %s", run.worker_id)

    def _check_restart(self, run: _WorkerRun, sample: MetricsSample) -> None:
        """A new process start time = a restarted engine with an empty cache. The sequence
        numbers usually show it first; when they cannot (no batch from the new engine yet, or
        its first batches were missed) the subscriber clears and rebuilds the worker."""
        started = sample.attributes.get("process_start_time")
        if started is None:
            return
        if run.started_at is not None and started != run.started_at:
            log.warning("vLLM worker %s restarted (process start time changed)", run.worker_id)
            self.subscriber.resync(run.worker_id, if_restarts_at=run.restarts_seen)
            self._ask_about_restart(run, started)
        run.started_at = started
        run.restarts_seen = self.subscriber.restarts(run.worker_id)

    # -- lifecycle ----------------------------------------------------------------------------
    async def engine_ranks(self, url: str) -> range | None:
        """The ranks ``/kv_event_sources`` lists (vLLM ≥ 0.32: one per DP rank behind this API
        server: all of them with internal load balancing, the node's with hybrid, the one with
        external); None from an older engine (404) or an unreachable one."""
        try:
            return await self._ask_ranks(url)
        except (OSError, ValueError) as exc:
            log.warning("vLLM %s: GET /kv_event_sources failed (%s)", url, exc)
            return None

    async def _ask_ranks(self, url: str) -> range | None:
        """_rank_run of the engine's /kv_event_sources answer, kept for the worker's start
        that follows (it subscribes the sources of the same answer, without asking again);
        raises OSError / ValueError when the engine does not answer (or answers nonsense)."""
        sources = await asyncio.to_thread(fetch_event_sources, url, RANKS_TIMEOUT)
        self._answers[url] = (time.monotonic(), sources)
        return _rank_run(url, sources)

    def _current(self, run: _WorkerRun) -> bool:
        """Whether ``run`` is still its worker's (not removed, restarted or closed meanwhile)."""
        return not self._closed and self._runs.get(run.worker_id) is run

    def _ask_about_restart(self, run: _WorkerRun, started: float | None) -> None:
        """Schedule ``_rediscover`` of the run on the adapter's loop (from a scraper thread or
        the loop itself), unless one is under way."""
        if self._loop is None or run.worker is None or run.rediscovering or started is None:
            return
        run.rediscovering = True
        with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
            done = asyncio.run_coroutine_threadsafe(self._rediscover(run, started), self._loop)
            self._rediscoveries.add(done)
            done.add_done_callback(self._rediscoveries.discard)
            done.add_done_callback(_log_failure)

    async def _rediscover(self, run: _WorkerRun, started: float) -> None:
        try:
            await self._rediscover_run(run, started)
        finally:
            run.rediscovering = False  # the run's next restart is asked about again
            if self._current(run) and run.started_at not in (None, started):
                # it restarted again while this rediscovery ran (which kept _check_restart from
                # asking): ask about the latest start
                self._ask_about_restart(run, run.started_at)

    async def _rediscover_run(self, run: _WorkerRun, started: float) -> None:
        """A restarted engine may run other DP ranks (a new --data-parallel-size) or publish on
        other ports: discover it again (until it answers), re-register a worker given without
        ranks with the ranks it runs now (sink.update_ranks) and subscribe again when the
        sources of its registered ranks changed. Otherwise (the usual restart) the subscriber's
        resync alone rebuilds the worker's blocks."""
        worker, sink = run.worker, run.sink
        assert worker is not None
        registered = worker.dp_ranks
        loop = asyncio.get_running_loop()
        asked_at = time.monotonic()
        reminded = None
        while True:
            if not self._current(run):
                return
            try:
                info = await loop.run_in_executor(None, self._discover, worker)
                if run.info.discovered and not info.discovered:  # a passing /kv_event_sources
                    raise ConfigError("/kv_event_sources did not answer")  # failure: not config
                break
            except Exception as exc:  # noqa: BLE001 - down again, or not yet: ask again
                now = time.monotonic()
                if reminded is None or now - reminded >= 60:  # the first time, then a minute
                    reminded = now
                    log.warning(
                        "vLLM worker %s: restarted engine not rediscovered after %.0f s (%s); "
                        "asking again every %g s",
                        worker.worker_id,
                        now - asked_at,
                        exc,
                        self.discovery_retry,
                    )
                await asyncio.sleep(self.discovery_retry)
        if not self._current(run):
            return
        try:  # a restart may bring another block size, on the same ports
            check_block_size(worker.worker_id, info.block_size, sink.block_size)
        except ConfigError as exc:
            await self._give_up(run, exc)
            return
        update_ranks = getattr(sink, "update_ranks", None)  # the frontend's sink
        ranks = _rank_run(worker.url or "", info.sources) if info.discovered else None
        if ranks is not None and update_ranks is not None:
            worker = update_ranks(ranks) or worker  # the fleet's word: given ranks stand
        same = _sources_of(info, worker) == _sources_of(run.info, worker)
        if same and worker is run.worker and not run.given_up:
            return
        log.warning(
            "vLLM worker %s: the restarted engine publishes DP ranks %s; subscribing again",
            worker.worker_id,
            sorted(rs.dp_rank for rs in info.sources),
        )
        kept = [r for r in registered if r in worker.dp_ranks]
        try:
            await loop.run_in_executor(
                None, self._subscribe_again, run, worker, sink, info, kept, started
            )
        except Exception as exc:  # noqa: BLE001 - as at start, loudly, and down
            await self._give_up(run, exc)

    async def _give_up(self, run: _WorkerRun, exc: BaseException) -> None:
        """The restarted engine cannot be consumed (another block size, a failed subscribe):
        its worker stops being consumed and is reported down. Its scraper goes on, so the
        engine's next restart (with a setting kvplug can use) is discovered again."""
        if not self._current(run):  # removed (or added again) meanwhile: not this run's call
            return
        log.error(
            "vLLM worker %s: not subscribed again: %s; reported down until the engine restarts",
            run.worker_id,
            exc,
        )
        with self._alive_lock:  # no sample in flight revives it (_set_alive checks given_up)
            run.given_up = True
            self._set_alive(run, False)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.subscriber.remove, run.worker_id)

    def _subscribe_again(
        self,
        run: _WorkerRun,
        worker: Worker,
        sink: WorkerSink,
        info: EngineInfo,
        kept: list[int],
        started: float,
    ) -> None:
        if not self._current(run):
            return
        self.subscriber.remove(worker.worker_id)  # ranks the engine no longer runs included
        # what the old streams indexed from the new engine before they stopped could miss
        # removals in the gap; the new streams rebuild from its replay buffer (seq 0 on)
        sink.apply_threadsafe([AllCleared(worker_id=worker.worker_id, dp_rank=r) for r in kept])
        self.start_worker_sync(worker, sink, info, started_at=started, replaces=run)

    async def start_worker(self, worker: Worker, sink: WorkerSink) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            await loop.run_in_executor(None, self.start_worker_sync, worker, sink)
        except EngineNotUp as exc:
            # a router started before its engines (a compose file, a Kubernetes rollout):
            # the worker is added, unready, and subscribed once the engine answers
            log.warning(
                "vLLM worker %s: %s; asking again every %g s in the background",
                worker.worker_id,
                exc,
                self.discovery_retry,
            )
            self._waiting[worker.worker_id] = asyncio.create_task(self._start_later(worker, sink))

    async def _start_later(self, worker: Worker, sink: WorkerSink) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        reminded = started
        while True:
            await asyncio.sleep(self.discovery_retry)
            try:  # quietly: the engine is expected to be down for a while
                ranks = await self._ask_ranks(worker.url or "")
            except (OSError, ValueError) as exc:
                if time.monotonic() - reminded >= 60:  # a reminder a minute (a wrong URL?)
                    reminded = time.monotonic()
                    log.warning(
                        "vLLM worker %s: engine %s still not answering after %.0f s (%s)",
                        worker.worker_id,
                        worker.url,
                        reminded - started,
                        exc,
                    )
                continue
            update_ranks = getattr(sink, "update_ranks", None)  # the frontend's sink
            if ranks is not None and update_ranks is not None:
                worker = update_ranks(ranks) or worker  # a worker given without ranks
            try:
                await loop.run_in_executor(None, self.start_worker_sync, worker, sink)
            except EngineNotUp:
                continue
            except Exception as exc:  # e.g. a block size mismatch: as at start, loudly
                log.error("vLLM worker %s: not subscribed: %s", worker.worker_id, exc)
                return
            self._waiting.pop(worker.worker_id, None)
            return

    def _discover(self, worker: Worker) -> EngineInfo:
        topic = worker.labels.get("kv_events_topic", "") if worker.labels else ""
        asked = self._answers.pop(worker.url, None) if worker.url else None
        fresh = asked is not None and time.monotonic() - asked[0] < ANSWER_REUSE_S
        return discover(
            worker.url,
            endpoint=worker.event_endpoint,
            replay_endpoint=worker.replay_endpoint,
            topic=topic,
            dp_start=worker.dp_start,
            dp_size=worker.dp_size,
            metrics_url=worker.metrics_url,
            answered=(asked[1],) if fresh and asked is not None else None,
        )

    def start_worker_sync(
        self,
        worker: Worker,
        sink: WorkerSink,
        info: EngineInfo | None = None,
        started_at: float | None = None,
        replaces: _WorkerRun | None = None,
    ) -> EngineInfo:
        """Blocking form of ``start_worker`` (tests, threads); ``info``: the engine as just
        discovered (else asked here); ``started_at``: its process start time when known, so
        that a restart before the first scrape is seen; ``replaces``: the run this start takes
        over (a restarted engine's), installed only while that run is still the worker's.
        Raises ConfigError on a block size mismatch or when no event endpoint can be found."""
        if self._closed:
            raise ConfigError("the vLLM adapter is closed")
        if info is None:
            info = self._discover(worker)
        bs = check_block_size(worker.worker_id, info.block_size, sink.block_size)
        host = urlsplit(worker.url).hostname if worker.url else None
        ranks = range(worker.dp_start, worker.dp_start + worker.dp_size)
        self.subscriber.start()
        published = sorted(rs.dp_rank for rs in info.sources)
        if not any(r in ranks for r in published):
            log.warning(
                "vLLM worker %s: the engine publishes ranks %s, none in %d..%d: "
                "no events will be consumed",
                worker.worker_id,
                published,
                ranks.start,
                ranks.stop - 1,
            )
        elif any(r not in ranks for r in published):
            # a worker given dp_size 1 for an engine with --data-parallel-size N behind one API
            # server: only the registered ranks are indexed, routed and told to the engine
            log.warning(
                "vLLM worker %s: the engine runs DP ranks %s but the worker is registered with "
                "ranks %d..%d: the others' events are not consumed and no request is routed to "
                "them; set dp_start/dp_size in its worker config to match, or leave both out "
                "and kvplug registers the ranks /kv_event_sources lists",
                worker.worker_id,
                published,
                ranks.start,
                ranks.stop - 1,
            )
        try:
            for rs in info.sources:
                if rs.dp_rank not in ranks:
                    continue
                self.subscriber.add(
                    EventSource(
                        worker_id=worker.worker_id,
                        endpoint=rs.endpoint,
                        sink=sink.apply_threadsafe,
                        replay_endpoint=rs.replay_endpoint,
                        topic=rs.topic,
                        dp_rank=rs.dp_rank,
                        engine_host=host,
                        block_size=bs,
                    )
                )
        except Exception:
            self.subscriber.remove(worker.worker_id)  # a failed start leaves nothing behind
            raise
        scraper = None
        murl = worker.metrics_url or (worker.url.rstrip("/") + "/metrics" if worker.url else None)
        run = _WorkerRun(
            worker.worker_id, info, None, started_at=started_at, worker=worker, sink=sink
        )
        if replaces is not None:  # the verdict so far stands until this run's first sample
            run.alive = replaces.alive and not replaces.given_up
        if murl:

            def on_sample(s: MetricsSample, _run: _WorkerRun = run) -> None:
                if not self._current(_run):  # replaced or stopped: its verdicts are over
                    return
                self._check_restart(_run, s)
                if _run.given_up:  # its engine is not consumed: not the worker's figures
                    return
                sink.set_attributes(s.attributes)  # stamped on the router's clock
                report_capacity(_run, sink, s.num_gpu_blocks)  # per DP rank
                self._set_alive(_run, True)  # not once given up

            def on_failure(n: int, e: Exception, _run: _WorkerRun = run) -> None:
                if n >= self.unhealthy_after and self._current(_run):
                    self._set_alive(_run, False)

            scraper = MetricsScraper(
                murl,
                on_sample,
                period=self.metrics_period,
                on_failure=on_failure,
                unhealthy_after=self.unhealthy_after,
            )
            run.scraper = scraper
            scraper.start()
        report_capacity(run, sink, info.num_gpu_blocks)
        with self._lock:
            closed = self._closed
            current = self._runs.get(worker.worker_id)
            stale = replaces is not None and current is not replaces  # removed meanwhile
            if not (closed or stale):
                self._runs[worker.worker_id] = run
        if closed or stale:  # leave nothing running
            if scraper is not None:
                scraper.stop()
            if current is None:  # (a newer start of the worker keeps its streams)
                self.subscriber.remove(worker.worker_id)
            raise ConfigError(
                "the vLLM adapter is closed" if closed else f"worker {worker.worker_id} removed"
            )
        if current is not None and current.scraper is not None:
            current.scraper.stop()
        log.info(
            "vLLM worker %s: %d event source(s) (%s), block size %s, %s GPU blocks",
            worker.worker_id,
            len(info.sources),
            "discovered" if info.discovered else "configured",
            bs,
            info.num_gpu_blocks,
        )
        return info

    async def stop_worker(self, worker_id: str) -> None:
        waiting = self._waiting.pop(worker_id, None)
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        self.stop_worker_sync(worker_id)

    def stop_worker_sync(self, worker_id: str) -> None:
        with self._lock:
            run = self._runs.pop(worker_id, None)
        if run is not None and run.scraper is not None:
            run.scraper.stop()
        self.subscriber.remove(worker_id)

    def events_ready(self, worker_id: str) -> bool | None:
        run = self._runs.get(worker_id)
        if run is not None and run.given_up:
            return None  # reported down instead: one unusable engine does not unready the router
        return self.subscriber.running and self.subscriber.has_worker(worker_id)

    def event_drops(self) -> dict[str, dict[str, int]]:
        return self.subscriber.drop_counts()

    async def close(self) -> None:
        with self._lock:
            self._closed = True
        for done in list(self._rediscoveries):
            done.cancel()
        for wid in list(self._waiting):
            await self.stop_worker(wid)
        for wid in list(self._runs):
            self.stop_worker_sync(wid)
        self.subscriber.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "subscriber": self.subscriber.stats(),
            "alive": {w: r.alive for w, r in self._runs.items()},
        }

    # -- P/D ------------------------------------------------------------------------------------
    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        return prefill_body(body)

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        return decode_body(body, prefill_response)


class RouterSink:
    """A ``WorkerSink`` straight onto a ``Router`` (or anything with ``apply_event`` and
    ``set_attributes``), for use without the frontend: benchmarks, simulators, tests.

    ``lock`` serialises index updates with the caller's routing (pass the same lock to
    whatever calls ``route``) — the subscriber thread applies events concurrently.
    """

    def __init__(
        self, router: Any, worker_id: str, block_size: int, lock: threading.Lock | None = None
    ) -> None:
        self.router = router
        self.worker_id = worker_id
        self.block_size = block_size
        self.lock = lock or threading.Lock()
        self.events = 0

    def apply(self, event: Any) -> None:
        self.apply_many([event])

    def apply_many(self, events: Any) -> None:
        batch = events if isinstance(events, list) else list(events)
        with self.lock:
            if hasattr(self.router, "apply_events"):
                self.router.apply_events(batch)
            else:
                for e in batch:
                    self.router.apply_event(e)
            self.events += len(batch)

    def apply_threadsafe(self, events: Any) -> None:
        self.apply_many(events)

    def set_attributes(self, values: dict[str, float], ts: float | None = None) -> None:
        with self.lock:
            self.router.set_attributes(self.worker_id, values, ts)


register_adapter("vllm", VllmAdapter, replace=True)

"""The ``sglang`` engine adapter: KV events, load attributes and the PD bootstrap transform.

Per worker, ``start_worker``:

1. reads ``GET /server_info`` (``/get_server_info`` on old builds). Its ``kv_events``
   descriptor (sglang ≥ 0.5.20) gives the publisher ports (``endpoint_port_base`` + rank), the
   topic, the replay ports and the page size events are emitted at; older builds are reached
   through the worker's configured ``event_endpoint`` (as in ``--kv-events-config``) and their
   ``page_size``. A page size different from the router's block size is refused loudly
   (``ConfigError``): kvplug must hash prompts at the size the engine publishes.
2. subscribes every DP rank through the shared ZMQ subscriber (``subscriber.py``);
3. takes load pushed on SGLang's ZMQ load channel when the worker advertises one
   (``load_endpoint_port_base``, ``--load-publish-endpoint``, ≥ 0.5.23), and otherwise —
   or while that channel is silent — polls every ``load_period`` seconds
   ``GET /v1/loads?include=core``, else the Prometheus ``metrics_url`` (``sglang:*``), into
   ``running_requests``, ``queue_depth``, ``kv_usage``... (``metrics.py``); a rank's
   ``max_total_num_tokens`` from either source, in blocks, is the worker's KV capacity
   (``update_capacity``, as vLLM's ``num_gpu_blocks``).

If the worker is not reachable yet, discovery retries in the background and subscribes once
it answers. PD: ``bootstrap_host`` (the prefill worker's host), ``bootstrap_port`` (option
``bootstrap_port``, default 8998, ``None`` to omit) and one random 63-bit ``bootstrap_room``
on both hops, which run **concurrently** (``PDStyle.CONCURRENT``). When the prefill worker
has several DP ranks the room is chosen ≡ the routed rank (mod ``dp_size``), because SGLang's
prefill picks rank ``bootstrap_room % dp_size``; option ``dp_aware: true`` also sends
``routed_dp_rank`` on each hop (the rank within that worker) and, on the decode hop,
``disagg_prefill_dp_rank`` (the prefill's rank). A worker registered with another rank count
than its engine reports is warned about (kvplug routes only the registered ranks); whenever a
routed rank is sent (``dp_aware``, or the frontend's ``X-Data-Parallel-Rank`` to a worker with
several registered ranks) its rooms are then drawn modulo the lcm of both counts, so that the
rank sent is still ``room % <engine ranks>``, which SGLang checks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio
from kvplug.integrations.aio import LazySession, log_due, poll_loads
from kvplug.integrations.vllm.subscriber import sources_for_engine

from kvplug import ConfigError, Worker
from kvplug.adapters import (
    PDContext,
    PDStyle,
    SglangHttpAdapter,
    WorkerSink,
    register_adapter,
    report_capacity,
)
from kvplug.tasks import cancel_and_wait

from .metrics import (
    KvEventsInfo,
    attributes_from_load_stats,
    attributes_from_loads,
    attributes_from_prometheus,
    decode_load_stat,
    dp_ranks_from_server_info,
    kv_events_from_server_info,
    page_size_from_server_info,
    rank_capacity_tokens,
)
from .subscriber import SglangSubscriber, filtered_sink, sources_from_info

log = logging.getLogger("kvplug.integrations.sglang")

DEFAULT_BOOTSTRAP_PORT = 8998
ROOM_MASK = (1 << 63) - 1


def bootstrap_room(rng: random.Random, prefill_rank: int = 0, prefill_dp_size: int = 1) -> int:
    """A random room in [0, 2**63) with ``room % prefill_dp_size == prefill_rank``."""
    room = rng.getrandbits(63)
    if prefill_dp_size > 1:
        room -= room % prefill_dp_size
        room += prefill_rank % prefill_dp_size
        if room > ROOM_MASK:
            room -= prefill_dp_size
    return room


def bootstrap_fields(
    ctx: PDContext, rng: random.Random, room_modulus: int | None = None
) -> dict[str, Any]:
    """The three fields both hops carry, made once per request (kept in ``ctx.scratch``).
    The room is ≡ the routed prefill rank modulo ``room_modulus`` (default: the prefill
    worker's ``dp_size``)."""
    if "sglang_bootstrap" not in ctx.scratch:
        host = urlsplit(ctx.prefill_worker.url or "").hostname
        if host is None:
            raise ConfigError(f"prefill worker {ctx.prefill_worker.worker_id} has no URL host")
        port = ctx.prefill_options.get("bootstrap_port", DEFAULT_BOOTSTRAP_PORT)
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise ConfigError(f"bootstrap_port option must be an int or null, got {port!r}")
        worker = ctx.prefill_worker
        rank = ctx.prefill_dp_rank - worker.dp_start
        ctx.scratch["sglang_bootstrap"] = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": bootstrap_room(rng, rank, room_modulus or worker.dp_size),
        }
    return ctx.scratch["sglang_bootstrap"]


@dataclass
class _Run:
    worker: Worker
    sink: WorkerSink
    info: KvEventsInfo | None = None
    subscribed: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)
    load_errors: int = 0
    last_load_at: float | None = None
    last_push_at: float | None = None  # newest LoadStat from the ZMQ load channel
    pushed: dict[int, dict[str, int]] = field(default_factory=dict)
    bad_pushes: int = 0
    capacity_reported: int = 0  # KV blocks per rank last handed to the sink
    engine_dp_ranks: int | None = None  # DP ranks the engine's /server_info reports


class SglangAdapter(SglangHttpAdapter):
    """SGLang workers: events over ZMQ (discovered), load from ``/v1/loads``, PD bootstrap."""

    kind = "sglang"
    pd_style = PDStyle.CONCURRENT
    tokenize_path = "/tokenize"  # >= 0.5.15: {"prompt"} or {"messages"} -> {"tokens": [...]}

    def __init__(
        self,
        *,
        load_period: float = 0.5,
        push_silence: float = 3.0,
        discovery_retry: float = 2.0,
        http_timeout: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        self.load_period = load_period
        self.push_silence = push_silence  # HTTP polling resumes after this long without pushes
        self.discovery_retry = discovery_retry
        self.http_timeout = http_timeout
        self.rng = rng or random.Random()
        self._subscriber: SglangSubscriber | None = None
        self._runs: dict[str, _Run] = {}
        # an engine started with --api-key guards /server_info, /v1/loads and /metrics too
        self._session = LazySession(timeout=http_timeout, headers=lambda: self.engine_headers)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start_worker(self, worker: Worker, sink: WorkerSink) -> None:
        if worker.url is None and worker.event_endpoint is None:
            raise ConfigError(f"sglang worker {worker.worker_id}: needs a url or event_endpoint")
        run = _Run(worker, sink)
        self._runs[worker.worker_id] = run
        try:
            info = await self._server_info(worker)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning(
                "sglang worker %s: /server_info not reachable yet (%s); retrying in the background",
                worker.worker_id,
                exc,
            )
            info = None
        if info is not None:
            try:
                await self._subscribe(run, info)  # raises ConfigError on a page-size mismatch
            except Exception:
                self._runs.pop(worker.worker_id, None)
                if self._subscriber is not None:  # ranks added before the failure
                    await asyncio.to_thread(self._subscriber.remove, worker.worker_id)
                raise
        else:
            run.tasks.append(asyncio.create_task(self._discover_later(run)))
        if worker.url is not None or worker.metrics_url is not None:
            run.tasks.append(asyncio.create_task(self._poll_load(run)))

    async def engine_ranks(self, url: str) -> range | None:
        """0 .. n-1 for the n DP ranks ``/server_info`` reports (what the launcher gives its
        command-line workers, and smg's ``--dp-aware`` reads); None when it does not say."""
        try:  # the worker's add waits for this answer
            info = await self._server_info_at(url, aiohttp.ClientTimeout(total=2.0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("sglang %s: /server_info not readable (%s)", url, exc)
            return None
        n = dp_ranks_from_server_info(info)
        return range(n) if n else None

    async def stop_worker(self, worker_id: str) -> None:
        run = self._runs.pop(worker_id, None)
        if run is None:
            return
        await cancel_and_wait(run.tasks)
        if self._subscriber is not None and run.subscribed:
            await asyncio.to_thread(self._subscriber.remove, worker_id)

    def events_ready(self, worker_id: str) -> bool | None:
        run = self._runs.get(worker_id)
        if run is None:
            return False
        return (
            run.subscribed
            and self._subscriber is not None
            and self._subscriber.running
            and self._subscriber.has_worker(worker_id)
        )

    def event_drops(self) -> dict[str, dict[str, int]]:
        return self._subscriber.drop_counts() if self._subscriber is not None else {}

    async def close(self) -> None:
        for worker_id in list(self._runs):
            await self.stop_worker(worker_id)
        if self._subscriber is not None:
            await asyncio.to_thread(self._subscriber.stop)
            self._subscriber = None
        await self._session.close()

    def stats(self) -> dict[str, Any]:
        return {
            "subscriber": self._subscriber.stats() if self._subscriber else None,
            "workers": {
                w: {"subscribed": r.subscribed, "load_errors": r.load_errors}
                for w, r in self._runs.items()
            },
        }

    # -- PD ------------------------------------------------------------------------------------
    def _room_modulus(self, ctx: PDContext) -> int:
        """What the room is drawn ≡ the routed prefill rank modulo: the worker's ``dp_size``;
        with ``dp_aware`` and an engine reporting another rank count (a worker registered
        before its engine answered, or configured otherwise), their lcm, so that
        ``room % engine ranks`` is the ``routed_dp_rank`` sent too: SGLang fails a prefill
        whose routed rank contradicts the room (``follow_bootstrap_room`` conflict)."""
        worker = ctx.prefill_worker
        if not ctx.prefill_options.get("dp_aware") and worker.dp_size == 1:
            # no routed rank sent (the frontend's X-Data-Parallel-Rank goes only to a worker
            # registered with several ranks): SGLang follows the room alone
            return worker.dp_size
        run = self._runs.get(worker.worker_id)
        engine_ranks = run.engine_dp_ranks if run is not None else None
        if engine_ranks is None or engine_ranks == worker.dp_size:
            return worker.dp_size
        return math.lcm(worker.dp_size, engine_ranks)

    def prefill_request(self, body: dict[str, Any], ctx: PDContext) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k != "nvext"}
        out.update(bootstrap_fields(ctx, self.rng, self._room_modulus(ctx)))
        if ctx.prefill_options.get("dp_aware"):
            # equal to bootstrap_room % dp_size by construction: SGLang >= 0.5.23 fails a
            # prefill whose routed rank contradicts the room (follow_bootstrap_room)
            out["routed_dp_rank"] = ctx.prefill_dp_rank - ctx.prefill_worker.dp_start
        return out

    def decode_request(
        self, body: dict[str, Any], prefill_response: dict[str, Any] | None, ctx: PDContext
    ) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k != "nvext"}
        out.update(bootstrap_fields(ctx, self.rng, self._room_modulus(ctx)))
        if ctx.decode_options.get("dp_aware"):
            start = ctx.decode_worker.dp_start if ctx.decode_worker is not None else 0
            out["routed_dp_rank"] = ctx.decode_dp_rank - start
            # which prefill rank holds the KV: spares the decode the query to the bootstrap
            out["disagg_prefill_dp_rank"] = ctx.prefill_dp_rank - ctx.prefill_worker.dp_start
        return out

    # -- internals -------------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        return self._session.get()

    async def _server_info(self, worker: Worker) -> dict[str, Any] | None:
        """``/server_info`` JSON, ``{}`` when the worker has no URL (config-only)."""
        if worker.url is None:
            return {}
        return await self._server_info_at(worker.url)

    async def _server_info_at(
        self, url: str, timeout: aiohttp.ClientTimeout | None = None
    ) -> dict[str, Any]:
        base = url.rstrip("/")
        session = self._http()
        extra = {} if timeout is None else {"timeout": timeout}
        for path in ("/server_info", "/get_server_info"):
            async with session.get(base + path, **extra) as resp:
                if resp.status == 404:
                    continue
                resp.raise_for_status()
                data = await resp.json(content_type=None)
                if not isinstance(data, dict):
                    raise ValueError(f"{path} answered {type(data).__name__}, not an object")
                return data
        raise ValueError("neither /server_info nor /get_server_info exists")

    async def _discover_later(self, run: _Run) -> None:
        while not run.subscribed:
            await asyncio.sleep(self.discovery_retry)
            try:
                info = await self._server_info(run.worker)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            try:
                await self._subscribe(run, info or {})
            except ConfigError as exc:
                log.error("sglang worker %s: not subscribed: %s", run.worker.worker_id, exc)
                return

    async def _subscribe(self, run: _Run, info: dict[str, Any]) -> None:
        worker, sink = run.worker, run.sink
        wid = worker.worker_id
        kv = kv_events_from_server_info(info, worker.url or "") if worker.url else None
        page_size = kv.block_size if kv is not None else page_size_from_server_info(info)
        if page_size is None:
            page_size = sink.block_size  # config-only worker: trust the router's block size
        if page_size != sink.block_size:
            raise ConfigError(
                f"sglang worker {wid} emits KV events at page size {page_size} but the router "
                f"hashes blocks of {sink.block_size}: start the router with --kv-block-size "
                f"{page_size} or the engine with --page-size {sink.block_size}"
            )
        run.engine_dp_ranks = ranks = dp_ranks_from_server_info(info)
        if ranks is not None and ranks != worker.dp_size:
            # an engine that was not up when its worker was added: the frontend's sink
            # re-registers a worker given without dp_size with the engine's ranks
            update_ranks = getattr(sink, "update_ranks", None)
            resized = update_ranks(range(ranks)) if update_ranks is not None else None
            if resized is not None:
                run.worker = worker = resized
            else:  # the router's endpoints are the registered ranks: the others' events are
                # dropped and no request is routed to them
                log.warning(
                    "sglang worker %s: the engine runs %d DP rank(s) but the worker is registered "
                    "with dp_size %d: the router routes and indexes only those; set dp_size: %d "
                    "in its worker config, or leave dp_start/dp_size out and kvplug takes the "
                    "engine's",
                    wid,
                    ranks,
                    worker.dp_size,
                    ranks,
                )
        deliver = filtered_sink(sink.apply_threadsafe)
        if worker.event_endpoint is not None:  # configured explicitly: it wins
            endpoint = worker.event_endpoint.replace("0.0.0.0", "*")  # SGLang binds it too
            replay = worker.replay_endpoint
            if replay is not None:
                replay = replay.replace("0.0.0.0", "*")
            sources = sources_for_engine(
                wid,
                endpoint,
                deliver,
                replay_endpoint=replay,
                topic=kv.topic if kv else "",
                dp_start=worker.dp_start,
                dp_size=worker.dp_size,
                engine_url=worker.url,
                block_size=page_size,
            )
        elif kv is not None:
            sources = sources_from_info(wid, kv, deliver, dp_start=worker.dp_start)
        else:
            log.warning(
                "sglang worker %s: no kv_events in /server_info and no event_endpoint "
                "configured: no KV events (start the engine with --kv-events-config "
                '\'{"publisher": "zmq", ...}\')',
                wid,
            )
            return
        subscriber = self._subscriber
        if subscriber is None:
            subscriber = self._subscriber = SglangSubscriber()
            subscriber.start()
        for src in sources:
            # add() waits for the subscriber thread to register the socket: not on the loop
            await asyncio.to_thread(subscriber.add, src)
        run.info = kv
        run.subscribed = True
        if kv is not None and kv.load_port_base is not None:
            run.tasks.append(asyncio.create_task(self._pushed_load(run, kv)))
        log.info(
            "sglang worker %s: subscribed %d rank(s), page size %d", wid, len(sources), page_size
        )

    async def _poll_load(self, run: _Run) -> None:
        worker = run.worker
        base = None if worker.url is None else worker.url.rstrip("/")
        loads_url = None if base is None else base + "/v1/loads?include=core"
        prom_url = worker.metrics_url or (None if base is None else base + "/metrics")
        if prom_url is None:  # no URL at all: nothing to scrape (loads_url is None too)
            return

        async def scrape() -> bool:
            nonlocal loads_url
            if run.last_push_at is not None and (
                time.monotonic() - run.last_push_at < self.push_silence
            ):
                return False  # the pushed channel is live
            session = self._http()
            asked_at = time.monotonic()
            capacity = None
            if loads_url is not None:
                async with session.get(loads_url) as resp:
                    if resp.status in (404, 405) and prom_url:
                        loads_url = None  # older than 0.5.15: Prometheus instead
                        return True
                    resp.raise_for_status()
                    payload = await resp.json(content_type=None)
                    attrs = attributes_from_loads(payload)
                    capacity = rank_capacity_tokens(payload["loads"])
            else:
                async with session.get(prom_url) as resp:
                    resp.raise_for_status()
                    attrs = attributes_from_prometheus(await resp.text())
            if run.last_push_at is not None and run.last_push_at >= asked_at:
                return False  # a pushed gauge arrived meanwhile: it is newer than this answer
            if capacity is not None:
                self._report_capacity(run, capacity)
            run.sink.set_attributes(attrs)
            run.last_load_at = time.monotonic()
            return False

        await poll_loads(scrape, self.load_period, run, f"sglang worker {worker.worker_id}", log)

    @staticmethod
    def _report_capacity(run: _Run, tokens: int | None) -> None:
        """A rank's ``max_total_num_tokens`` in the router's blocks (the page size, checked
        at subscription) as the worker's capacity (``report_capacity``)."""
        report_capacity(run, run.sink, None if tokens is None else tokens // run.sink.block_size)

    async def _pushed_load(self, run: _Run, kv: KvEventsInfo) -> None:
        """Subscribe to every rank's load PUB (SGLang's KV-event framing, topic ``load``)."""
        ctx = zmq.asyncio.Context.instance()
        sockets = []
        try:
            for i in range(kv.dp_size):
                rank = run.worker.dp_start + i
                endpoint = kv.load_endpoint(rank)
                if endpoint is None:  # no load channel advertised (the caller checks first)
                    return
                sock = ctx.socket(zmq.SUB)
                sockets.append((rank, sock))
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # a gauge: anything big is junk
                sock.setsockopt(zmq.SUBSCRIBE, kv.load_topic.encode())
                sock.connect(endpoint)
            poller = zmq.asyncio.Poller()
            for _, sock in sockets:
                poller.register(sock, zmq.POLLIN)
            by_sock = {sock: rank for rank, sock in sockets}
            while True:
                for sock, _ in await poller.poll():
                    frames = await sock.recv_multipart()
                    try:
                        if len(frames) != 3 or len(frames[1]) != 8:
                            raise ValueError(f"{len(frames)} frames")
                        run.pushed[by_sock[sock]] = decode_load_stat(frames[2])
                    except ValueError as exc:
                        run.bad_pushes += 1
                        if log_due(run.bad_pushes):
                            log.warning(
                                "sglang worker %s: bad load message (%d so far): %s",
                                run.worker.worker_id,
                                run.bad_pushes,
                                exc,
                            )
                        continue
                    run.last_push_at = time.monotonic()
                    run.sink.set_attributes(attributes_from_load_stats(run.pushed))
                    self._report_capacity(run, rank_capacity_tokens(run.pushed.values()))
        finally:
            for _, sock in sockets:
                sock.close(0)


register_adapter("sglang", SglangAdapter)

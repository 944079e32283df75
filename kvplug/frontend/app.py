"""The public API of ``kvplug serve``.

``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health`` (the process is up), ``GET /ready`` (workers routable, event sources up),
``GET /metrics`` (Prometheus), ``GET /kvplug/decisions/{id}`` (a recent decision's JSON trace).
Every routed answer carries ``x-kvplug-decision-id``, ``x-kvplug-worker`` and
``x-kvplug-dp-rank`` (plus ``x-kvplug-prefill-worker`` / ``x-kvplug-prefill-decision-id`` for
two-stage requests). A batched completion (``prompt`` as a list of 2+ prompts) is split into
one routed sub-request per prompt (``kvplug/frontend/batch.py``); those headers are then
comma-separated lists in prompt order.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from kvplug.admission import QueueFull, QueueTimeout, Scope, best_cached_tokens
from kvplug.disagg import (
    ConditionalDisagg,
    DecodePlan,
    PrefillRejected,
    StageUnavailable,
    final_answer_sse,
    plan_two_stage,
    settle_prefill,
)
from kvplug.errors import (
    AllWorkersOverloaded,
    InvalidRequest,
    InvalidTokens,
    NoCompatibleWorker,
    PinnedWorkerOverloaded,
    RoutingError,
)
from kvplug.frontend.batch import serve_batch
from kvplug.frontend.bodies import read_body
from kvplug.frontend.context import RequestContext, Routed
from kvplug.frontend.decisions import DecisionRecord, DecisionStore
from kvplug.frontend.errors import ApiError, bad_request
from kvplug.frontend.fleet import RANK_HEADER, Fleet, WorkerEntry
from kvplug.frontend.health import HealthProber
from kvplug.frontend.hints import NO_HINTS as NO_CLIENT_HINTS
from kvplug.frontend.hints import ClientHints, RequestHints, check_hint_targets
from kvplug.frontend.lifecycle import Lifecycle
from kvplug.frontend.metrics import FrontendMetrics
from kvplug.frontend.outliers import OutlierDetector, OutlierSettings
from kvplug.frontend.parsing import CHAT, COMPLETIONS, ParsedRequest, parse_request
from kvplug.frontend.queueing import ClientGone, FrontendQueue
from kvplug.frontend.streaming import completion_tokens, relay
from kvplug.frontend.timeouts import within
from kvplug.frontend.tokens import LocalTokenizer, TokenResolver
from kvplug.frontend.upstream import Upstream, UpstreamUnavailable, forward_headers
from kvplug.request import NO_HINTS, RouteRequest, RoutingHints
from kvplug.stalls import LoopStalls
from kvplug.workers import Stage

log = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


@dataclass
class ServeSettings:
    max_prompt_tokens: int = 0  # 0 = no limit
    max_batch_prompts: int = 256  # prompts in one batched completion; 0 = no limit
    max_body_bytes: int = 16 * 1024 * 1024
    retries: int = 1
    decision_store_size: int = 10_000
    health_interval: float = 5.0
    health_timeout: float = 2.0
    # timeouts, in Envoy's vocabulary (docs/frontend.md "Timeouts"); 0 = none
    connect_timeout: float = 5.0  # TCP connect to an engine
    per_try_timeout: float = 0.0  # one attempt's wait for the engine's first byte (retried)
    idle_timeout: float = 600.0  # no byte from the engine for this long
    request_timeout: float = 600.0  # total: the whole answer, or a stream's first byte
    max_stream_duration: float = 0.0  # total of a streamed answer
    prefill_timeout: float = 120.0
    served_model_names: list[str] = field(default_factory=list)
    engine_tokenize: bool = True
    max_tokenize_chars: int = 1_000_000  # prompt text sent to an engine's /tokenize; 0 = no cap
    tokenize_concurrency: int = 4  # engine /tokenize calls at once; 0 = no limit
    tokenize_timeout: float = 5.0
    health_unhealthy_threshold: int = 2  # failed probes in a row before a worker is down
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    api_key: str | None = None  # clients must send "Authorization: Bearer <key>" to /v1/*
    # pins, allow-lists, label selectors from clients: "ignore" (counted), "trust", "reject"
    client_routing_hints: str = "ignore"
    client_header_timeout: float = 30.0  # a request head must arrive within (0 = no limit)
    client_body_timeout: float = 60.0  # a request body must arrive within (0 = no limit)
    engine_api_key: str | None = None  # sent to the engines instead of the client's header
    trtllm_booking_seconds: float = 1.0  # load held per TRT-LLM remote_http placement
    # the routed endpoints through kvplug's own HTTP lane (kvplug/frontend/lane.py), not aiohttp's
    http_lane: bool = True
    # who serves the plain routed requests: "native", the compiled data path
    # (kvplug/frontend/native_lane.py), "python", or "auto": native where kvplug._lane is built
    data_path: str = "auto"


_ROUTING_ERRORS = {
    NoCompatibleWorker: (503, "no_compatible_worker"),
    AllWorkersOverloaded: (503, "all_workers_overloaded"),
    PinnedWorkerOverloaded: (503, "pinned_worker_overloaded"),
}


# Stage.value is a Python-level property; these are dict lookups
_STAGE_NAME = {stage: stage.value for stage in Stage}
_STAGE_LETTER = {stage: stage.value[0] for stage in Stage}  # route ids: r<key>.<letter><attempt>
_NO_REASONS: Any = MappingProxyType({})  # RouteRequest.exclusion_reasons with nobody unhealthy

_DROP_ALWAYS = frozenset({"content-encoding"})
_DROP_WITH_KEY = _DROP_ALWAYS | {"authorization"}


class Frontend:
    """State of one serving process: router, fleet, upstream client, token resolver, traces."""

    def __init__(
        self,
        router: Any,
        settings: ServeSettings | None = None,
        tokenizer: LocalTokenizer | None = None,
    ) -> None:
        self.router = router
        self.settings = s = settings or ServeSettings()
        # the adapters' own calls (discovery, loads, metrics) carry the engines' key too
        auth = {"Authorization": f"Bearer {s.engine_api_key}"} if s.engine_api_key else {}
        self.fleet = Fleet(router, engine_headers=auth)
        self.http_lane: Any = None  # kvplug.frontend.lane.Lane, once the API listens
        self.native_lane: Any = None  # kvplug.frontend.native_lane.NativeDataPath, if on
        self.fleet.configured_models = set(s.served_model_names)
        self.upstream = Upstream(s.connect_timeout, s.idle_timeout)
        self.outliers = OutlierDetector(self.fleet, s.outliers, on_eject=self._ejected)
        self.prober = HealthProber(
            self.fleet,
            self.upstream,
            s.health_interval,
            s.health_timeout,
            unhealthy_threshold=s.health_unhealthy_threshold,
            outliers=self.outliers,
        )
        self._tokenize_slots = (
            asyncio.Semaphore(s.tokenize_concurrency) if s.tokenize_concurrency > 0 else None
        )
        self.decisions = DecisionStore(s.decision_store_size)
        self.stalls = LoopStalls()
        self.metrics = FrontendMetrics()
        self.client_hints = ClientHints(s.client_routing_hints, self.metrics.hints_ignored)
        self.metrics.attach_state(self._fleet_snapshot, self._router_stats, self.fleet.event_drops)
        self.tokens = TokenResolver(tokenizer, self._engine_tokenize if s.engine_tokenize else None)
        self.block_size = router.index.block_size
        self._keys = itertools.count(1)
        # the per-request series, looked up once: in flight; token sources; route seconds per
        # stage; (requests, seconds) per (path, status, stream)
        self._inflight = self.metrics.inflight.labels()
        self._source_counters: dict[str, Any] = {}
        self._route_hists: dict[Stage, Any] = {}
        self._request_series: dict[tuple[str, int, bool], tuple[Any, Any]] = {}
        self._served: dict[str, frozenset[str] | None] = {}  # _check_model's answers
        self._served_epoch = -1  # the fleet epoch they hold at
        self._id_prefix = secrets.token_hex(6)  # request ids: unique per process and request
        self._tokenize_rr = itertools.count()
        self._no_tokenize: set[tuple[str, str]] = set()  # (worker, URL) answering 404 there
        self._tokenizing: dict[str, int] = {}  # engine /tokenize calls outstanding, per worker
        # Dynamo's --router-queue-threshold: requests wait while every eligible worker is busy
        config = getattr(router, "config", None)
        self.queue: FrontendQueue | None = None
        if getattr(config, "router_queue_threshold", None) is not None:
            self.queue = FrontendQueue(router, self.metrics)
        self._on_release = self.queue.pump if self.queue is not None else None

    # -- process lifecycle ----------------------------------------------------------------
    async def start(self, specs=()) -> None:
        attrs = getattr(self.router, "attrs", None)
        if attrs is not None:  # ages of engines' attributes leave out this loop's stalls
            attrs.stalls = self.stalls
            self.stalls.start()
        await self.upstream.start()
        if specs:
            await self.fleet.add_many(list(specs))
        if self.fleet.workers:
            await self.prober.probe_all()
        self.prober.start()

    async def close(self) -> None:
        self.stalls.stop()
        if self.queue is not None:
            await self.queue.close()
        await self.prober.stop()
        await self.fleet.close()
        await self.upstream.close()

    def count_token_source(self, source: str) -> None:
        """One request's token ids in ``kvplug_token_source``."""
        counter = self._source_counters.get(source)
        if counter is None:
            counter = self._source_counters[source] = self.metrics.token_source.labels(source)
        counter.inc()

    def request_started(self) -> None:
        """One more request in flight (``count_request`` counts it out)."""
        self._inflight.inc()

    def _ejected(self, worker_id: str, reason: str, seconds: float) -> None:
        self.metrics.ejections.labels(worker_id).inc()

    def _fleet_snapshot(self) -> list[dict[str, Any]]:
        snap = self.fleet.snapshot()
        blocks = self.router.index.worker_blocks()
        for w in snap:
            w["ejected"] = self.outliers.ejected(w["id"])
            w["blocks"] = blocks.get(w["id"], 0)
        return snap

    def _router_stats(self) -> dict[str, Any]:
        try:
            stats = self.router.stats()
        except Exception:
            stats = {}
        lane = self.http_lane
        if lane is not None:  # kvplug_router_stat{stat="http_lane.*"}: who served the requests
            stats["http_lane"] = {"served": lane.served, "handed_off": lane.handed_off}
        if self.native_lane is not None:  # kvplug_router_stat{stat="native_lane.*"}
            stats["native_lane"] = self.native_lane.stats()
        # kvplug_router_stat{stat="loop_stalls.*"}: stalls of this event loop over 0.1 s
        stats["loop_stalls"] = {"count": self.stalls.stalls, "seconds": self.stalls.stalled_s}
        tok = self.tokens.tokenizer
        if tok is not None and tok.prefix_cache is not None:
            # kvplug_router_stat{stat="tokenizer_cache.*"}: hits, misses, whether it is on
            stats["tokenizer_cache"] = tok.prefix_cache.snapshot()
        return stats

    # -- HTTP handlers ---------------------------------------------------------------------
    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, COMPLETIONS)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT)

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        started = time.perf_counter()
        self.request_started()
        m = self.metrics
        status = 500
        stream = False
        try:
            response, stream = await self._serve(request, path)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            if exc.status < 500:
                m.rejected.labels(exc.code).inc()
            return exc.response()
        except Exception as exc:  # a bug: answer cleanly, keep serving
            log.exception("request to %s failed", path)
            err = ApiError(
                500,
                f"internal error: {type(exc).__name__}: {exc}",
                "server_error",
                "internal_error",
            )
            return err.response()
        except asyncio.CancelledError:
            # the client hung up (aiohttp cancels the handler): counted as nginx's 499
            status = 499
            raise
        finally:
            self.count_request(path, status, stream, started)

    def count_request(self, path: str, status: int, stream: bool, started: float) -> None:
        """One answered request in ``/metrics``: in flight no more, its status, its seconds
        (``started``: ``time.perf_counter()`` when it arrived, ``inflight`` raised then)."""
        self._inflight.dec()
        key = (path, status, stream)
        series = self._request_series.get(key)
        if series is None:
            m = self.metrics
            series = self._request_series[key] = (
                m.requests.labels(path, str(status)),
                m.request_seconds.labels(path, "true" if stream else "false"),
            )
        series[0].inc()
        series[1].observe(time.perf_counter() - started)

    async def _read_body(self, request: web.Request) -> bytes:
        s = self.settings
        return await read_body(request, s.max_body_bytes, s.client_body_timeout)

    def _check_model(self, req: ParsedRequest) -> frozenset[str] | None:
        """``fleet.workers_for_model`` of a model the fleet serves (remembered per model until
        the fleet changes); a 404 for another when the fleet knows its models."""
        epoch = self.fleet.epoch
        if epoch != self._served_epoch:
            self._served_epoch = epoch
            self._served.clear()
        try:
            return self._served[req.model]
        except KeyError:
            pass
        known = self.fleet.models()
        if known and req.model not in known:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist; served models: "
                f"{', '.join(sorted(known))}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        workers = self.fleet.workers_for_model(req.model)
        # bounded: with no model list known, any name a client sends passes
        if known or len(self._served) < 1024:
            self._served[req.model] = workers
        return workers

    def _check_hint_workers(self, hints: RequestHints) -> None:
        check_hint_targets(hints, self.fleet.workers)

    async def _serve(self, request: web.Request, path: str) -> tuple[web.StreamResponse, bool]:
        raw = await self._read_body(request)
        req = parse_request(raw, path)
        model_workers = self._check_model(req)
        hints = self.client_hints.read(req.nvext, request.headers)
        self._check_hint_workers(hints)
        if req.batch_size > 1:
            self._check_batch_size(req.batch_size)
            if req.prompts is not None and not self.fleet.disaggregated:
                # one sub-request per prompt, each routed on its own tokens
                batch = serve_batch(self, request, req, hints, model_workers)
                if req.stream or self.settings.request_timeout <= 0:
                    return await batch, req.stream
                try:
                    return await within(batch, self.settings.request_timeout), False
                except asyncio.TimeoutError:
                    raise self._timed_out(None) from None
        tokens, source, note = await self.tokens.resolve(req)
        self.count_token_source(source)
        self.check_prompt_tokens(tokens, "prompt")
        ctx = self.request_context(
            req, request.headers.get("X-Request-Id"), tokens, source, note, hints, model_workers
        )
        if self.queue is not None:
            await self.admit(request, ctx)  # has its own limit (--router-queue-max-wait)
        if self.settings.request_timeout > 0:
            ctx.deadline = time.monotonic() + self.settings.request_timeout
        try:
            return await self._dispatch_in_time(request, ctx), req.stream
        except asyncio.CancelledError:  # the client hung up: the engine's request was closed
            self.client_gone(ctx)
            raise
        finally:
            self.admitted(ctx)

    def request_context(
        self,
        req: ParsedRequest,
        client_request_id: str | None,
        tokens: list[int] | np.ndarray | None,
        source: str,
        note: str | None,
        hints: RequestHints,
        model_workers: frozenset[str] | None,
    ) -> RequestContext:
        """A request's context, its id the client's ``X-Request-Id`` or one made here."""
        key = next(self._keys)
        request_id = client_request_id or f"kvplug-{self._id_prefix}-{key}"
        return RequestContext(key, request_id, req, tokens, source, note, hints, model_workers)

    @staticmethod
    def client_gone(ctx: RequestContext) -> None:
        """The client hung up: its attempts still in flight are traced as 499s."""
        for rec in ctx.records:
            if rec.outcome == "in_flight":
                rec.outcome, rec.status = "client_disconnected", 499
                rec.error = "the client closed the connection"

    async def _dispatch_in_time(self, request: web.Request, ctx: RequestContext):
        """``_dispatch`` within ``--request-timeout``: the whole answer when not streamed; a
        stream's deadline ends at its first byte (``open_upstream``), then
        ``--max-stream-duration`` applies."""
        try:
            if ctx.deadline is None or ctx.req.stream:
                return await self._dispatch(request, ctx)
            left = ctx.deadline - time.monotonic()
            return await within(self._dispatch(request, ctx), left)
        except asyncio.TimeoutError:
            if ctx.deadline is None or time.monotonic() < ctx.deadline - 0.01:
                raise  # not ours
            raise self._timed_out(ctx) from None

    def _timed_out(self, ctx: RequestContext | None) -> ApiError:
        """The 504 of a request past ``--request-timeout``; its engine counts one failure."""
        limit = self.settings.request_timeout
        err = ApiError(
            504,
            f"the engine did not answer within the request timeout of {limit:g} s "
            "(--request-timeout)",
            "upstream_error",
            "request_timeout",
        )
        last = ctx.records[-1] if ctx is not None and ctx.records else None
        if last is not None:
            if last.outcome in ("in_flight", "cancelled"):
                last.outcome, last.status = "timeout", 504
                last.error = f"no whole answer within --request-timeout ({limit:g} s)"
            self.metrics.upstream_errors.labels(last.worker_id, "timeout").inc()
            self.outliers.failure(last.worker_id, "request timeout")
            err.headers = {
                "x-kvplug-decision-id": last.decision_id,
                "x-kvplug-worker": last.worker_id,
            }
        return err

    def check_prompt_tokens(self, tokens: list[int] | np.ndarray | None, where: str) -> None:
        limit = self.settings.max_prompt_tokens
        if limit and tokens is not None and len(tokens) > limit:
            raise ApiError(
                400,
                f"the {where} has {len(tokens)} tokens, over the limit of "
                f"{limit} (--max-prompt-tokens)",
                "invalid_request_error",
                "context_length_exceeded",
                "prompt",
            )

    def _check_batch_size(self, size: int) -> None:
        limit = self.settings.max_batch_prompts
        if limit and size > limit:
            raise ApiError(
                400,
                f"the batch has {size} prompts, over the limit of {limit} (--max-batch-prompts)",
                "invalid_request_error",
                "batch_too_large",
                "prompt",
            )

    def hop_headers(self, client_headers: Any, request_id: str) -> dict[str, str]:
        """The headers sent to the engines: the client's (a case-insensitive multidict, as
        ``request.headers``), minus kvplug's own and hop-by-hop."""
        # the body kvplug forwards is the decoded one (kvplug/frontend/bodies.py), and
        # kvplug's key is not the engines'
        drop = _DROP_WITH_KEY if self.settings.api_key is not None else _DROP_ALWAYS
        hop_headers = {
            k: v
            for k, v in forward_headers(client_headers, request_id).items()
            if k.lower() not in drop
        }
        if self.settings.engine_api_key:
            hop_headers["Authorization"] = f"Bearer {self.settings.engine_api_key}"
        return hop_headers

    # -- admission queue ------------------------------------------------------------------
    def _queue_scope(self, ctx: RequestContext) -> Scope:
        """The workers the request's first routing stage could use (its busy check)."""
        stage = Stage.PREFILL if self.fleet.disaggregated else Stage.AGGREGATED
        hints = self._hints_for(ctx, stage, None)
        unhealthy = self.fleet.unhealthy
        if unhealthy and hints.pinned_worker_id in unhealthy:
            unhealthy = unhealthy - {hints.pinned_worker_id}
        return Scope(
            stage,
            hints.allowed_worker_ids,
            hints.pinned_worker_id,
            hints.pinned_dp_rank,
            frozenset(unhealthy),
        )

    async def admit(self, request: web.Request, ctx: RequestContext) -> None:
        """Wait in the admission queue while every eligible worker is over the threshold."""
        queue = self.queue
        assert queue is not None
        scope = self._queue_scope(ctx)
        tokens = ctx.tokens if ctx.tokens is not None else ()
        salt = ctx.req.cache_salt

        def cached() -> int:
            return best_cached_tokens(self.router, tokens, scope, salt)

        def gone() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing()

        try:
            ticket = await queue.wait(scope, len(tokens), cached, ctx.hints.priority_jump, gone)
        except ClientGone as exc:  # nobody reads this answer; 499 as nginx counts it
            raise ApiError(499, str(exc), "client_closed_request", "client_closed") from None
        except QueueFull as exc:
            raise ApiError(529, str(exc), "service_unavailable", "queue_full") from None
        except QueueTimeout as exc:
            raise ApiError(503, str(exc), "service_unavailable", "queue_timeout") from None
        if ticket is not None:
            ctx.ticket = ticket
            ctx.queue_wait_s = ticket.waited
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s waited %.3f s in the queue", ctx.request_id, ticket.waited)

    def admitted(self, ctx: RequestContext) -> None:
        """The released request was routed (or failed): the queue examines its next head."""
        ticket = ctx.ticket
        if ticket is not None and self.queue is not None:
            ctx.ticket = None
            self.queue.done(ticket)

    # -- routing ---------------------------------------------------------------------------
    def _hints_for(
        self, ctx: RequestContext, stage: Stage, allowed: frozenset[str] | None
    ) -> RoutingHints:
        h = ctx.hints
        if h is NO_CLIENT_HINTS and ctx.model_workers is None and allowed is None:
            return NO_HINTS  # the usual request: nothing below would change that
        allow = h.allowed_worker_ids
        for extra in (ctx.model_workers, allowed):
            if extra is not None:
                allow = extra if allow is None else allow & extra
        pin = h.prefill_worker_id if stage is Stage.PREFILL else h.worker_id
        rank = None if stage is Stage.PREFILL else h.dp_rank
        if (
            allow is None
            and pin is None
            and rank is None
            and h.expected_osl is None
            and not h.labels
        ):
            return NO_HINTS
        return RoutingHints(
            allowed_worker_ids=allow,
            pinned_worker_id=pin,
            pinned_dp_rank=rank,
            expected_osl=h.expected_osl,
            labels=dict(h.labels or {}),
        )

    def route_stage(
        self,
        ctx: RequestContext,
        stage: Stage,
        attempt: int,
        exclude: frozenset[str],
        allowed: frozenset[str] | None = None,
    ) -> Routed:
        rreq = self._route_request(ctx, stage, attempt, exclude, allowed)
        route_id = rreq.request_id
        t0 = time.perf_counter()
        try:
            decision = self.router.route(rreq)
        except RoutingError as exc:
            self.admitted(ctx)
            status, code = _ROUTING_ERRORS.get(type(exc), (503, "routing_error"))
            self.metrics.routing_errors.labels(code).inc()
            raise ApiError(
                status, f"no worker can take the request: {exc}", "service_unavailable", code
            ) from None
        except (InvalidRequest, InvalidTokens) as exc:
            self.admitted(ctx)
            raise bad_request(str(exc), code="invalid_request") from None
        try:
            return self._routed(ctx, stage, attempt, route_id, decision, time.perf_counter() - t0)
        except BaseException:
            self.router.on_finish(route_id)  # the router must not keep a request nobody serves
            if self._on_release is not None:
                self._on_release()
            raise
        finally:
            if ctx.ticket is not None:
                self.admitted(ctx)  # its load is in the router now (or gone)

    def _route_request(
        self,
        ctx: RequestContext,
        stage: Stage,
        attempt: int,
        exclude: frozenset[str],
        allowed: frozenset[str] | None,
    ) -> RouteRequest:
        hints = self._hints_for(ctx, stage, allowed)
        unhealthy = self.fleet.unhealthy
        excluded, reasons = exclude, _NO_REASONS
        if unhealthy:
            if hints.pinned_worker_id in unhealthy:
                unhealthy = unhealthy - {hints.pinned_worker_id}  # an explicit pin is tried anyway
            excluded = exclude | unhealthy
            reasons = self._unhealthy_reasons(unhealthy - exclude)
        # positional, in RouteRequest's field order: request_id, token_ids, block_hashes,
        # lora_name, cache_salt, stage, hints, exclude_workers, exclusion_reasons
        return RouteRequest(
            f"r{ctx.key}.{_STAGE_LETTER[stage]}{attempt}",
            ctx.tokens if ctx.tokens is not None else (),
            None,
            None,
            ctx.req.cache_salt,
            stage,
            hints,
            excluded,
            reasons,
        )

    def _unhealthy_reasons(self, unhealthy: frozenset[str]) -> dict[str, str]:
        """Why each unhealthy worker is left out, for the decision trace."""
        reasons = {}
        for wid in unhealthy:
            entry = self.fleet.workers.get(wid)
            why = entry.last_error if entry is not None else None
            reasons[wid] = f"unhealthy: {why}" if why else "unhealthy"
        return reasons

    def preview_stage(
        self, ctx: RequestContext, stage: Stage, allowed: frozenset[str] | None = None
    ) -> Any:
        """Where ``route_stage`` would send this stage now, booking nothing (conditional
        disaggregation); raises RoutingError."""
        return self.router.preview(self._route_request(ctx, stage, 0, frozenset(), allowed))

    def _routed(
        self,
        ctx: RequestContext,
        stage: Stage,
        attempt: int,
        route_id: str,
        decision: Any,
        route_s: float,
    ) -> Routed:
        hist = self._route_hists.get(stage)
        if hist is None:
            hist = self._route_hists[stage] = self.metrics.route_seconds.labels(_STAGE_NAME[stage])
        hist.observe(route_s)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s (%s, attempt %d): %s",
                ctx.request_id,
                stage.value,
                attempt,
                decision.explain(),
            )
        entry = self.fleet.workers[decision.worker_id]
        prompt_tokens = None if ctx.tokens is None else len(ctx.tokens)
        record = DecisionRecord(
            decision,
            ctx.request_id,
            _STAGE_NAME[stage],
            attempt,
            ctx.req.path,
            ctx.req.model,
            ctx.token_source,
            ctx.token_note,
            prompt_tokens,
            entry.url_base,
            route_s * 1e6,
        )
        record.queue_wait_s = ctx.queue_wait_s
        if self.fleet.unhealthy:
            record.unhealthy = self._unhealthy_detail()
        for other in ctx.records:
            other.related.append(record.decision_id)
            record.related.append(other.decision_id)
        ctx.records.append(record)
        self.decisions.add(record)
        lifecycle = Lifecycle(
            self.router, route_id, self.block_size, prompt_tokens or 0, self._on_release
        )
        return Routed(decision, entry, lifecycle, record)

    def _unhealthy_detail(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for w in self.fleet.unhealthy:
            entry = self.fleet.workers.get(w)
            if entry is not None:
                out[w] = {"down_by": sorted(entry.down_by), "reason": entry.last_error}
        return out

    def stage_failed(self, routed: Routed, reason: str) -> None:
        routed.lifecycle.finish()
        routed.record.outcome = "unavailable"
        routed.record.error = reason
        worker_id = routed.decision.worker_id
        self.fleet.mark_unhealthy(worker_id, reason)
        self.metrics.upstream_errors.labels(worker_id, "before_first_byte").inc()
        self.outliers.failure(worker_id, reason)
        self.prober.poke()

    def decode_capable(self) -> frozenset[str]:
        return frozenset(w for w, e in self.fleet.workers.items() if e.spec.role != "prefill")

    async def send_prefill(
        self, ctx: RequestContext, routed: Routed, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        entry = routed.entry
        url = entry.url_base + ctx.req.path
        hop_headers = {**ctx.forward, **headers}
        rank = entry.rank_on_url(routed.decision.dp_rank)  # as open_upstream sends it
        if rank is not None:
            hop_headers[RANK_HEADER] = str(rank)
        entry.inflight += 1
        started = time.perf_counter()
        answered = False  # a prefill's answer is its first token: timed only when it came
        try:
            status, answer, raw = await self.upstream.post_json(
                entry.spec.worker_id, url, body, hop_headers, self.settings.prefill_timeout
            )
            answered = status == 200
        except UpstreamUnavailable as exc:
            raise StageUnavailable(exc.reason) from exc
        finally:
            entry.inflight -= 1
            routed.lifecycle.first_token(measured=answered)
            routed.lifecycle.finish()
        rec = routed.record
        rec.status = status
        rec.total_s = time.perf_counter() - started
        if status == 200 and answer is None and raw.lstrip().startswith(b"data:"):
            answer = {}  # a streamed prefill answer (SGLang sends the client's body as is)
        worker_id = routed.decision.worker_id
        if status != 200 or not isinstance(answer, dict):
            rec.outcome = "engine_error"
            rec.error = raw[:500].decode(errors="replace")
            if status >= 500:  # a sick prefill engine; a 4xx is the client's
                self.outliers.failure(worker_id, f"prefill HTTP {status}")
            raise PrefillRejected(status, raw)
        rec.outcome = "ok"
        self.outliers.success(worker_id)
        return answer

    # -- dispatch -------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        stage = Stage.AGGREGATED
        body = ctx.req.raw
        allowed: frozenset[str] | None = None
        plan: DecodePlan | None = None
        hop_headers = self.hop_headers(request.headers, ctx.request_id)
        ctx.forward = hop_headers
        if self.fleet.disaggregated:
            plan = await self._plan(ctx)
            if plan.final_answer is not None:
                return await self._answer_from_prefill(request, ctx, plan, plan.final_answer)
            stage, allowed = plan.stage, plan.allowed
            body = _json.encode(plan.body) if plan.body is not ctx.req.body else ctx.req.raw
            hop_headers = {**hop_headers, **plan.headers}
        try:
            return await self._send(request, ctx, stage, body, hop_headers, allowed, plan)
        finally:
            if plan is not None:
                await settle_prefill(plan)

    async def _plan(self, ctx: RequestContext) -> DecodePlan:
        try:
            tokens = ctx.tokens
            plan = await plan_two_stage(
                self,
                ctx,
                ctx.req.body,
                ctx.request_id,
                ctx.req.path,
                # the adapters put token ids into JSON bodies: a list, never a uint32 array
                tokens.tolist() if isinstance(tokens, np.ndarray) else tokens,
                self.settings.retries,
                ConditionalDisagg.from_config(self.router.config),
            )
        except PrefillRejected as exc:
            self.metrics.disagg.labels("prefill_rejected").inc()
            raise ApiError(
                exc.status,
                f"the prefill worker refused the request: "
                f"{exc.body[:300].decode(errors='replace')}",
                "invalid_request_error",
                "prefill_rejected",
            ) from None
        if plan.conditional is not None and plan.conditional.bypass:
            self.metrics.disagg.labels("prefill_skipped").inc()
        elif plan.fallback_reason is not None:
            self.metrics.disagg.labels("fallback").inc()
            log.warning(
                "request %s: decode-only fallback: %s", ctx.request_id, plan.fallback_reason
            )
        elif plan.final_answer is not None:
            self.metrics.disagg.labels("answered_by_prefill").inc()
        else:
            self.metrics.disagg.labels("two_stage").inc()
        return plan

    async def _answer_from_prefill(
        self, request: web.Request, ctx: RequestContext, plan: DecodePlan, answer: dict[str, Any]
    ) -> web.StreamResponse:
        """The prefill answer already is the whole answer: it goes to the client (as an SSE
        stream for a streaming client) and no decode stage is routed. The prefill stage's
        load was released when its answer arrived."""
        pre: Routed = plan.prefill
        rec, lc, d = pre.record, pre.lifecycle, pre.decision
        rec.outcome = "answered_by_prefill"
        body = _json.encode(answer)
        rec.output_tokens = completion_tokens(body)
        if lc.first_at is not None:
            rec.ttft_s = lc.first_at - lc.started
        headers = {
            "x-kvplug-decision-id": rec.decision_id,
            "x-kvplug-worker": d.worker_id,
            "x-kvplug-dp-rank": str(d.dp_rank),
            "x-kvplug-prefill-worker": d.worker_id,
            "x-kvplug-prefill-decision-id": rec.decision_id,
            "X-Request-Id": ctx.request_id,
        }
        if not ctx.req.stream:
            headers["Content-Type"] = "application/json"
            return web.Response(body=body, headers=headers)
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        out = web.StreamResponse(headers=headers)
        await out.prepare(request)
        if rec.ttft_s is not None:
            self.metrics.ttft_seconds.observe(rec.ttft_s)
        try:
            await out.write(final_answer_sse(answer, ctx.req.body, ctx.req.path == CHAT))
            await out.write_eof()
        except ConnectionResetError:
            rec.error = "client closed the connection"
        return out

    async def _send(
        self,
        request: web.Request,
        ctx: RequestContext,
        stage: Stage,
        body: bytes,
        hop_headers: dict[str, str],
        allowed: frozenset[str] | None,
        plan: DecodePlan | None,
    ) -> web.StreamResponse:
        routed, upstream, first = await self.open_upstream(
            ctx, stage, body, hop_headers, allowed, plan
        )
        try:
            return await self._relay(request, ctx, routed, upstream, first, plan)
        finally:
            routed.entry.inflight -= 1
            routed.lifecycle.finish()
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()

    async def open_upstream(
        self,
        ctx: RequestContext,
        stage: Stage,
        body: bytes,
        hop_headers: dict[str, str],
        allowed: frozenset[str] | None,
        plan: DecodePlan | None,
    ) -> tuple[Routed, Any, bytes]:
        """Route and send one request, retrying on another worker before the first byte.

        Returns ``(routed, upstream response, first body bytes)``; the caller then owns one
        ``entry.inflight``, ``routed.lifecycle.finish()`` and releasing the response."""
        # the prefill worker is kept off its own decode stage unless nothing else can decode
        soft = plan.exclude if plan is not None else frozenset()
        exclude: set[str] = set(soft)
        failures: list[str] = []
        preset: Routed | None = plan.decode if plan is not None else None
        attempts = 1 if preset is not None else self.settings.retries + 1
        for attempt in range(attempts):
            if preset is not None:
                routed = preset
            else:
                try:
                    routed = self.route_stage(ctx, stage, attempt, frozenset(exclude), allowed)
                except ApiError as exc:
                    if exc.status != 503 or not soft or not soft <= exclude:
                        raise
                    exclude -= soft
                    soft = frozenset()
                    routed = self.route_stage(ctx, stage, attempt, frozenset(exclude), allowed)
            if plan is not None and plan.fallback_reason is not None:
                routed.record.fallback_reason = plan.fallback_reason
            if plan is not None and plan.conditional is not None and plan.conditional.bypass:
                routed.decision.conditional_disagg = plan.conditional.to_dict()
            entry = routed.entry
            entry.inflight += 1
            rank = entry.rank_on_url(routed.decision.dp_rank)
            headers = hop_headers if rank is None else {**hop_headers, RANK_HEADER: str(rank)}
            try:
                upstream, first = await self._open_attempt(ctx, entry, body, headers)
            except UpstreamUnavailable as exc:
                self.attempt_failed(routed, stage, exc, exclude, failures, attempt + 1 < attempts)
                continue
            except BaseException:  # cancelled, or a bug: the router must still hear the end
                entry.inflight -= 1
                routed.lifecycle.finish()
                raise
            return routed, upstream, first
        raise self.unavailable_error(ctx, attempts, failures)

    def attempt_failed(
        self,
        routed: Routed,
        stage: Stage,
        exc: UpstreamUnavailable,
        exclude: set[str],
        failures: list[str],
        retrying: bool,
    ) -> None:
        """One attempt's engine failed before its answer: load released, worker marked and
        left out of the next attempt (``exclude``), the failure kept for the 502's message."""
        routed.entry.inflight -= 1
        self.stage_failed(routed, exc.reason)
        exclude.add(routed.decision.worker_id)
        failures.append(str(exc))
        if retrying:
            self.metrics.retries.labels(stage.value).inc()

    @staticmethod
    def unavailable_error(ctx: RequestContext, attempts: int, failures: list[str]) -> ApiError:
        """The 502 of a request whose every attempt failed before the engine answered."""
        err = ApiError(
            502,
            "the engine failed before answering"
            f"{' (retried once on another worker)' if attempts > 1 else ''}: "
            f"{'; '.join(failures)}",
            "upstream_error",
            "engine_unavailable",
        )
        if ctx.records:
            last = ctx.records[-1]
            err.headers = {
                "x-kvplug-decision-id": last.decision_id,
                "x-kvplug-worker": last.worker_id,
            }
        return err

    async def _open_attempt(
        self, ctx: RequestContext, entry: WorkerEntry, body: bytes, hop_headers: dict[str, str]
    ) -> tuple[Any, bytes]:
        """One attempt, until the engine's first byte, within ``--per-try-timeout`` (an
        ``UpstreamUnavailable``: retried elsewhere) and the request's deadline (a
        ``TimeoutError``: the caller answers 504)."""
        worker_id = entry.spec.worker_id
        coro = self.upstream.open(worker_id, entry.url_base + ctx.req.path, body, hop_headers)
        per_try = self.settings.per_try_timeout if self.settings.per_try_timeout > 0 else None
        # a non-streamed request's deadline already bounds its whole dispatch
        # (_dispatch_in_time): a second timer here would only cost
        covered = not ctx.req.stream
        left = None if ctx.deadline is None or covered else ctx.deadline - time.monotonic()
        if per_try is None and left is None:
            return await coro
        limit = min(t for t in (per_try, left) if t is not None)
        try:
            return await within(coro, limit)
        except asyncio.TimeoutError:
            if per_try is not None and limit == per_try and (left is None or left > per_try):
                raise UpstreamUnavailable(
                    worker_id, f"no answer within the per-try timeout ({per_try:g} s)"
                ) from None
            raise

    async def _relay(
        self, request, ctx, routed: Routed, upstream, first: bytes, plan: DecodePlan | None
    ) -> web.StreamResponse:
        headers = self.answer_headers(ctx, routed, plan)
        stream_limit = self.settings.max_stream_duration
        response, outcome, error = await relay(
            request, upstream, first, routed.lifecycle, headers, stream_limit or None
        )
        self.record_answer(ctx, routed, upstream.status, outcome, error, routed.lifecycle.tokens)
        return response

    @staticmethod
    def answer_headers(
        ctx: RequestContext, routed: Routed, plan: DecodePlan | None = None
    ) -> dict[str, str]:
        """kvplug's headers on a relayed answer: where the request went and why."""
        d = routed.decision
        headers = {
            "x-kvplug-decision-id": routed.record.decision_id,
            "x-kvplug-worker": d.worker_id,
            "x-kvplug-dp-rank": str(d.dp_rank),
            "X-Request-Id": ctx.request_id,
        }
        if plan is not None and plan.prefill is not None and plan.fallback_reason is None:
            headers["x-kvplug-prefill-worker"] = plan.prefill.decision.worker_id
            headers["x-kvplug-prefill-decision-id"] = plan.prefill.record.decision_id
        return headers

    def record_answer(
        self,
        ctx: RequestContext,
        routed: Routed,
        status: int,
        outcome: str,
        error: str | None,
        output_tokens: int | None,
    ) -> None:
        """A relayed answer's end in its trace, ``/metrics`` and the outlier detector
        (``outcome`` as ``streaming.relay`` says it; the caller finishes the lifecycle)."""
        d = routed.decision
        rec = routed.record
        lc = routed.lifecycle
        rec.status = status
        rec.outcome = "engine_error" if status >= 400 and outcome == "ok" else outcome
        rec.error = error
        rec.output_tokens = output_tokens
        now = time.perf_counter()
        rec.total_s = now - lc.started
        if lc.first_at is not None:
            rec.ttft_s = lc.first_at - lc.started
            if ctx.req.stream:
                self.metrics.ttft_seconds.observe(rec.ttft_s)
        if outcome == "upstream_failed_mid_stream":
            self.metrics.upstream_errors.labels(d.worker_id, "mid_stream").inc()
        if status >= 500 or outcome in ("upstream_failed_mid_stream", "stream_timeout"):
            self.outliers.failure(d.worker_id, error or f"HTTP {status}")
        elif outcome == "ok":
            self.outliers.success(d.worker_id)

    # -- engine tokenization --------------------------------------------------------------
    async def _engine_tokenize(self, req: ParsedRequest) -> list[int]:
        """Token ids from an engine's token endpoint, bounded: a prompt over
        ``--max-tokenize-chars`` is refused (413, the engine would stall on it), and at most
        ``--tokenize-concurrency`` calls run at once (a caller that waits longer than
        ``--tokenize-timeout`` for a slot routes on load only). A failure here never marks an
        engine down."""
        s = self.settings
        size = len(req.prompt_text or "") + sum(
            len(str(m.get("content", ""))) for m in req.messages or () if isinstance(m, dict)
        )
        if s.max_tokenize_chars and size > s.max_tokenize_chars:
            raise ApiError(
                413,
                f"the prompt has {size} characters, over the {s.max_tokenize_chars}-character "
                "limit of engine tokenization (--max-tokenize-chars); send token ids, or run "
                "kvplug with a local --tokenizer",
                "invalid_request_error",
                "prompt_too_large",
                "prompt" if req.messages is None else "messages",
            )
        slots = self._tokenize_slots
        if slots is None:
            return await self._engine_tokenize_call(req)
        try:
            await asyncio.wait_for(slots.acquire(), s.tokenize_timeout)
        except asyncio.TimeoutError:
            self.metrics.tokenize_refused.labels("busy").inc()
            raise RuntimeError(
                f"all {s.tokenize_concurrency} engine tokenization slots stayed busy for "
                f"{s.tokenize_timeout:g} s (--tokenize-concurrency)"
            ) from None
        try:
            return await self._engine_tokenize_call(req)
        finally:
            slots.release()

    async def _engine_tokenize_call(self, req: ParsedRequest) -> list[int]:
        candidates = [
            e
            for e in self.fleet.workers.values()
            if e.healthy
            and e.adapter.tokenize_path is not None
            and (not e.models or req.model in e.models)
            and (e.spec.worker_id, e.url_base) not in self._no_tokenize
        ]
        if not candidates:
            raise RuntimeError("no healthy worker offers a token endpoint")
        # least outstanding calls first (round robin among equals): a hung or slow engine keeps
        # its calls, so the next ones go elsewhere
        start = next(self._tokenize_rr)
        n = len(candidates)
        busy = self._tokenizing
        entry = min(
            (candidates[(start + i) % n] for i in range(n)),
            key=lambda e: busy.get(e.spec.worker_id, 0),
        )
        worker_id = entry.spec.worker_id
        body = entry.adapter.tokenize_body(req.model, prompt=req.prompt_text, messages=req.messages)
        busy[worker_id] = busy.get(worker_id, 0) + 1
        try:
            status, answer, raw = await self.upstream.post_json(
                worker_id,
                entry.url_base + (entry.adapter.tokenize_path or "/tokenize"),
                body,
                {"Content-Type": "application/json", **self.fleet.engine_headers},
                timeout=self.settings.tokenize_timeout,
            )
        finally:
            busy[worker_id] -= 1
        if status in (404, 405):  # an engine without the endpoint: never asked again
            self._no_tokenize.add((worker_id, entry.url_base))
            log.info(
                "%s has no %s (HTTP %d): not asked for token ids again",
                worker_id,
                entry.adapter.tokenize_path or "/tokenize",
                status,
            )
        if status != 200:
            raise RuntimeError(f"{entry.spec.worker_id} answered HTTP {status}")
        return entry.adapter.tokens_from_response(answer)

    # -- small endpoints ------------------------------------------------------------------
    async def handle_models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "kvplug"}
            for m in sorted(self.fleet.models())
        ]
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        ok, detail = self.fleet.ready()
        return web.json_response(detail, status=200 if ok else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        # on the loop thread: the collectors read the router, which only this thread touches
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def handle_decision(self, request: web.Request) -> web.Response:
        decision_id = request.match_info["decision_id"]
        record = self.decisions.get(decision_id)
        if record is None:
            return ApiError(
                404,
                f"no recent decision {decision_id!r} (the store keeps the last "
                f"{self.decisions.capacity})",
                "invalid_request_error",
                "decision_not_found",
            ).response()
        return web.Response(
            body=json.dumps(record.to_json()).encode(), content_type="application/json"
        )


def bearer_matches(request: web.Request, expected: bytes) -> bool:
    """Constant-time check of ``Authorization`` (any bytes: aiohttp keeps non-UTF-8 ones as
    surrogate escapes, which encode back to what the client sent)."""
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected)


# what --api-key guards: the API, and the decision traces (they show other clients' request
# ids, models, token counts and the engines' URLs)
_GUARDED = ("/v1", "/kvplug/")


def api_key_check(key: str):
    """vLLM's ``--api-key`` semantics: every ``/v1`` call needs the bearer token; so does
    ``/kvplug/decisions/{id}``. ``/health``, ``/ready`` and ``/metrics`` stay open for probes."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(_GUARDED) and not bearer_matches(request, expected):
            return ApiError(
                401, "missing or wrong API key", "authentication_error", "invalid_api_key"
            ).response(headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Unknown paths and methods answer with an OpenAI-style error body too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, str(exc.status))
        return ApiError(
            exc.status,
            f"{request.method} {request.path}: {exc.reason}",
            "invalid_request_error",
            code,
        ).response()


# the Frontend behind an app (for handlers and middlewares outside the class)
FRONTEND_KEY = web.AppKey("frontend", Frontend)


def _middlewares(frontend: Frontend) -> list[Any]:
    middlewares: list[Any] = [openai_errors]
    if frontend.settings.api_key:
        middlewares.insert(0, api_key_check(frontend.settings.api_key))
    return middlewares


def lane_handlers(frontend: Frontend) -> dict[bytes, Any]:
    """The routed endpoints as kvplug's HTTP lane calls them (kvplug/frontend/lane.py):
    each handler inside the same middlewares ``build_app`` gives aiohttp, outermost first."""
    out: dict[bytes, Any] = {}
    middlewares = _middlewares(frontend)
    for path, handler in ((COMPLETIONS, frontend.handle_completions), (CHAT, frontend.handle_chat)):
        for middleware in reversed(middlewares):
            handler = functools.partial(middleware, handler=handler)
        out[path.encode()] = handler
    return out


def build_app(frontend: Frontend) -> web.Application:
    middlewares = _middlewares(frontend)
    app = web.Application(client_max_size=frontend.settings.max_body_bytes, middlewares=middlewares)
    app.router.add_post("/v1/completions", frontend.handle_completions)
    app.router.add_post("/v1/chat/completions", frontend.handle_chat)
    app.router.add_get("/v1/models", frontend.handle_models)
    app.router.add_get("/health", frontend.handle_health)
    app.router.add_get("/ready", frontend.handle_ready)
    app.router.add_get("/metrics", frontend.handle_metrics)
    app.router.add_get("/kvplug/decisions/{decision_id}", frontend.handle_decision)
    # TRT-LLM's `router: {type: remote_http}` protocol (trtllm-serve disaggregated)
    from kvplug.integrations.trtllm.remote_router import TrtllmRemoteRouter

    TrtllmRemoteRouter(frontend).add_routes(app)
    app[FRONTEND_KEY] = frontend
    return app

"""TRT-LLM's ``remote_http`` router protocol, served by ``kvplug serve``.

``trtllm-serve disaggregated`` picks each server role's router from its YAML
(``router: {type: remote_http, args: {remote_url: URL}}``). Its ``RemoteHttpRouter``
(``tensorrt_llm/serve/router.py`` upstream, in the one form read that posts the request
rather than block hashes; ``docs/trtllm.md`` §5 has which forms have it) POSTs every request
it must place to
``{remote_url}/get_next_server``: the body is ``request.model_dump(exclude_none=True)`` of
TRT-LLM's ``CompletionRequest`` / ``ChatCompletionRequest`` (JSON by aiohttp's ``json=``) plus
``"exclude_server"`` when the orchestrator retries elsewhere. It reads the answer as
``body["server"]`` (a server exactly as TRT-LLM names it, ``host:port``: it sends to
``http://{server}/v1/...``), ``body.get("matched_blocks", 0)`` and ``body.get("route_hint")``
(``{"dp_rank": r}`` is put into the request's ``disaggregated_params``). Any status but 200
fails the request in the orchestrator.

kvplug serves it at

* ``POST /trtllm/context/get_next_server``: context servers (kvplug workers whose role is
  not ``decode``);
* ``POST /trtllm/generation/get_next_server``: generation servers (role not ``prefill``);
* ``POST /get_next_server``: any worker; the stage comes from the request alone.

The stage kvplug scores is the request's ``disaggregated_params.request_type``
(``context_only`` → prefill, ``generation_only`` → decode, none → aggregated); the path
only narrows the candidates, so a generation router never gets a context server even for a
request whose context phase was skipped (TRT-LLM's conditional disaggregation). On the
generation path a ``context_only`` request is scored as aggregated: a generation server never
runs a context-only hop, and the orchestrator's conditional-disaggregation check asks its
generation router about the client's request, which can carry the ``context_only`` params
upstream synthesizes for a conversation id (it clears them before a generation server serves
the whole request).

Besides upstream's fields every answer carries ``num_tokens`` (the prompt tokens kvplug
resolved, 0 when it had none) and ``matched_tokens`` (of those, the ones the picked worker
holds): the prefix-match answer TRT-LLM's conditional disaggregation needs from its generation
router (kvplug's import hook, ``hook.py``, hands them to it). ``?token_ids=1`` on the request
adds ``token_ids``, the resolved prompt tokens themselves (older orchestrators count them).

The orchestrator's ``RemoteHttpRouter.finish_request`` tells nobody when a request ends, so
kvplug books each placement's load for ``ServeSettings.trtllm_booking_seconds`` (default 1 s,
two of the TRT-LLM adapter's load scrapes) and then releases it: the booking only keeps a
burst of requests from piling onto one worker until the engines' own load figures catch up.
Every answer names its placement (``request_id``, ignored by upstream); ``POST
/trtllm/finish_request {"request_id": ID}`` releases it at once (kvplug's import hook for
TRT-LLM, ``hook.py``, sends it from ``Router.finish_request``).

The ``/select`` variant of upstream's router server (block hashes computed by the
orchestrator) is not served: kvplug hashes token ids with its own hash, TRT-LLM's block keys
depend on salts, LoRA ids and its hash-algorithm version, so kvplug needs the tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from kvplug import (
    AllWorkersOverloaded,
    InvalidRequest,
    InvalidTokens,
    NoCompatibleWorker,
    PinnedWorkerOverloaded,
    Role,
    RouteRequest,
    RoutingError,
    RoutingHints,
    Stage,
)
from kvplug.frontend.errors import ApiError, bad_request
from kvplug.frontend.parsing import CHAT, COMPLETIONS, _check_token_ids, parse_request
from kvplug.request import NO_HINTS

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

# TRT-LLM's DisaggregatedParams.request_type → the stage kvplug scores
REQUEST_TYPE_STAGES = {"context_only": Stage.PREFILL, "generation_only": Stage.DECODE}
# the role path → the worker roles it may answer with
ROLE_PATHS = {"context": Role.DECODE, "generation": Role.PREFILL}  # the role it excludes

_ROUTING_STATUS = {
    NoCompatibleWorker: "no_compatible_worker",
    AllWorkersOverloaded: "all_workers_overloaded",
    PinnedWorkerOverloaded: "pinned_worker_overloaded",
}


def server_name(url: str) -> str:
    """A worker URL as TRT-LLM names servers: ``host:port`` (plus any path), no scheme."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return (parts.netloc + parts.path).rstrip("/")


class TrtllmRemoteRouter:
    """The ``remote_http`` endpoints of one ``Frontend``."""

    def __init__(self, frontend: Any) -> None:
        self.frontend = frontend
        self.booking_seconds = frontend.settings.trtllm_booking_seconds
        self._keys = itertools.count(1)
        self._bookings: dict[str, asyncio.TimerHandle] = {}  # placement -> its release

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/get_next_server", self.handle)
        app.router.add_post("/trtllm/{role}/get_next_server", self.handle)
        app.router.add_post("/trtllm/finish_request", self.handle_finish)

    async def handle_finish(self, request: web.Request) -> web.Response:
        """``{"request_id": ID}``: the placement ``ID`` ended; its load is released now
        instead of at the end of the booking (kvplug's TRT-LLM import hook sends this from
        ``Router.finish_request``; upstream's RemoteHttpRouter does not)."""
        try:
            body = self._decode(await self.frontend._read_body(request))
            route_id = body.get("request_id")
            if not isinstance(route_id, str):
                raise bad_request("'request_id' must be a string", param="request_id")
        except ApiError as exc:
            return exc.response()
        timer = self._bookings.pop(route_id, None)
        if timer is not None:
            timer.cancel()
            self.frontend.router.on_finish(route_id)
        return web.json_response({"released": timer is not None})

    def _release(self, route_id: str) -> None:
        if self._bookings.pop(route_id, None) is not None:
            self.frontend.router.on_finish(route_id)

    # -- the request --------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.Response:
        try:
            return await self._place(request)
        except ApiError as exc:
            return exc.response()

    async def _place(self, request: web.Request) -> web.Response:
        role = request.match_info.get("role")
        if role is not None and role not in ROLE_PATHS:
            raise ApiError(
                404,
                f"unknown TRT-LLM server role {role!r} (context or generation)",
                "invalid_request_error",
                "not_found",
            )
        fe = self.frontend
        body = self._decode(await fe._read_body(request))
        exclude_server = body.pop("exclude_server", None)
        if exclude_server is not None and not isinstance(exclude_server, str):
            raise bad_request("'exclude_server' must be a string or null", param="exclude_server")
        stage = self._stage(body, role)
        path = CHAT if "messages" in body else COMPLETIONS
        req = parse_request(_encoder.encode(body), path)
        if path == CHAT and body.get("prompt_token_ids") is not None:
            # the generation hop of a chat request, or a router-tokenized one
            req.prompt_ids = _check_token_ids(body["prompt_token_ids"], "prompt_token_ids")
        model_workers = fe._check_model(req)
        tokens, source, note = await fe.tokens.resolve(req)
        fe.count_token_source(source)
        allowed = self._allowed(role, model_workers)
        excluded = self._excluded(exclude_server)
        unhealthy = fe.fleet.unhealthy
        salt = body.get("cache_salt")
        route_id = f"trtllm-{next(self._keys)}"
        rreq = RouteRequest(
            request_id=route_id,
            token_ids=tokens if tokens is not None else (),
            cache_salt=salt if isinstance(salt, str) else None,
            stage=stage,
            hints=NO_HINTS if allowed is None else RoutingHints(allowed_worker_ids=allowed),
            exclude_workers=excluded | unhealthy if unhealthy else excluded,
        )
        try:
            decision = fe.router.route(rreq)
        except RoutingError as exc:
            code = _ROUTING_STATUS.get(type(exc), "routing_error")
            fe.metrics.routing_errors.labels(code).inc()
            raise ApiError(
                503, f"no worker can take the request: {exc}", "service_unavailable", code
            ) from None
        except (InvalidRequest, InvalidTokens) as exc:
            raise bad_request(str(exc), code="invalid_request") from None
        self._bookings[route_id] = asyncio.get_running_loop().call_later(
            self.booking_seconds, self._release, route_id
        )
        entry = fe.fleet.workers[decision.worker_id]
        answer: dict[str, Any] = {
            "server": server_name(entry.url_base),
            "matched_blocks": int(decision.overlap_blocks),
            "route_hint": None,
            "worker_id": decision.worker_id,
            "request_id": route_id,  # for POST /trtllm/finish_request
            # the prefix-match answer for conditional disaggregation (hook.py)
            "num_tokens": len(tokens) if tokens is not None else 0,
            "matched_tokens": int(decision.cached_tokens) if tokens is not None else 0,
        }
        if request.query.get("token_ids") == "1":
            ids = tokens if tokens is not None else []
            answer["token_ids"] = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        # upstream turns a route_hint on a request without disaggregated_params into a
        # context_only request: only a disaggregated hop gets one
        if stage is not Stage.AGGREGATED and entry.spec.dp_size > 1:
            answer["route_hint"] = {"dp_rank": int(decision.dp_rank)}
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "trtllm %s (%s, %s tokens from %s%s): %s",
                route_id,
                stage.value,
                len(tokens) if tokens is not None else "no",
                source,
                f"; {note}" if note else "",
                decision.explain(),
            )
        return web.Response(body=_encoder.encode(answer), content_type="application/json")

    # -- pieces -------------------------------------------------------------------------
    @staticmethod
    def _decode(raw: bytes) -> dict[str, Any]:
        try:
            body = _decoder.decode(raw) if raw else None
        except msgspec.DecodeError as exc:
            raise bad_request(f"body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request(
                "body must be a TRT-LLM request object (model_dump of a CompletionRequest or "
                "ChatCompletionRequest)",
                code="invalid_json",
            )
        return body

    @staticmethod
    def _stage(body: dict[str, Any], role: str | None = None) -> Stage:
        params = body.get("disaggregated_params")
        if params is None:
            return Stage.AGGREGATED
        if not isinstance(params, dict):
            raise bad_request(
                "'disaggregated_params' must be an object", param="disaggregated_params"
            )
        request_type = params.get("request_type")
        stage = REQUEST_TYPE_STAGES.get(request_type)  # type: ignore[arg-type]
        if stage is None:
            raise bad_request(
                f"disaggregated_params.request_type {request_type!r} is not context_only "
                "or generation_only",
                param="disaggregated_params.request_type",
            )
        if stage is Stage.PREFILL and role == "generation":
            # the conditional-disaggregation check: where the whole request would run
            return Stage.AGGREGATED
        return stage

    def _allowed(
        self, role: str | None, model_workers: frozenset[str] | None
    ) -> frozenset[str] | None:
        if role is None:
            return model_workers
        barred = ROLE_PATHS[role]
        allowed = frozenset(
            w for w, e in self.frontend.fleet.workers.items() if e.spec.role != barred.value
        )
        return allowed if model_workers is None else allowed & model_workers

    def _excluded(self, exclude_server: str | None) -> frozenset[str]:
        if not exclude_server:
            return frozenset()
        name = server_name(exclude_server)
        return frozenset(
            w for w, e in self.frontend.fleet.workers.items() if server_name(e.url_base) == name
        )

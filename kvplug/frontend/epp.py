"""The Gateway API Inference Extension's endpoint picker (EPP), served from ``kvplug serve``.

Any GIE-compatible gateway (Envoy, kgateway, Istio, llm-d) calls its picker over Envoy's
``ext_proc`` gRPC stream; with ``--epp-port`` kvplug is that picker and the gateway carries the
bytes. The protocol (GIE ``docs/proposals/004-endpoint-picker-protocol``, v1.0.0):

* request headers, then the body in chunks (FULL_DUPLEX_STREAMED). kvplug answers nothing until
  the body is complete, then routes it exactly as ``/v1/completions`` or
  ``/v1/chat/completions`` would (same parsing, tokenisation, hints, router, decision trace).
* the answer: a headers response setting ``x-gateway-destination-endpoint: <ip:port>`` (and
  ``Content-Length``), with the same endpoint in ``dynamic_metadata["envoy.lb"]``, then the body
  echoed back as one streamed body response.
* ``filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`` limits
  the pick to those endpoints; an empty or unknown subset is a 503.
* errors are ``ImmediateResponse``: the client's mistakes 4xx (OpenAI error body), no ready
  endpoint 503, every eligible endpoint over its busy threshold 429 (shed, as GIE defines it).
* the response passes through: the first body chunk is the first token, end of stream (or the
  gateway closing the stream) finishes the request, so the router's in-flight load returns to
  zero on every path.

gRPC health (``grpc.health.v1``) answers for ``liveness``, ``readiness`` and the ext_proc service
name, readiness following ``/ready``.

Envoy's message types come from ``envoy-data-plane`` (betterproto2 over grpclib, asyncio), the
``gateway`` extra; nothing here is generated or copied.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from multidict import CIMultiDict

from kvplug.frontend.context import RequestContext
from kvplug.frontend.errors import ApiError
from kvplug.frontend.parsing import CHAT, COMPLETIONS, parse_request
from kvplug.request import Stage

try:
    import grpclib.server
    from envoy_data_plane.envoy.config.core.v3 import HeaderValue, HeaderValueOption
    from envoy_data_plane.envoy.service.ext_proc.v3 import (
        BodyMutation,
        BodyResponse,
        CommonResponse,
        ExternalProcessorBase,
        HeaderMutation,
        HeadersResponse,
        ImmediateResponse,
        ProcessingRequest,
        ProcessingResponse,
        StreamedBodyResponse,
    )
    from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
    from envoy_data_plane.google.protobuf import Struct
    from grpclib.health.check import ServiceCheck, ServiceStatus
    from grpclib.health.service import Health
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the endpoint picker needs the gateway extra: pip install 'kvplug[gateway]' "
        f"({exc.name} is missing)"
    ) from exc

if TYPE_CHECKING:
    from kvplug.frontend.app import Frontend
    from kvplug.frontend.context import Routed

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_PATHS = {COMPLETIONS: COMPLETIONS, CHAT: CHAT}
# Routing errors the gateway should shed (429) rather than fail over (503): every worker that
# could take the request is over its busy threshold.
_SHED_CODES = frozenset({"all_workers_overloaded", "pinned_worker_overloaded"})


def endpoint_of(url_base: str) -> str:
    """``http://10.0.0.7:8000`` -> ``10.0.0.7:8000`` (the form GIE endpoints take)."""
    parts = urlsplit(url_base)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def _headers(msg: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    header_map = msg.headers
    for h in header_map.headers if header_map is not None else ():
        # Envoy sends raw_value (bytes) by default, value on older configurations
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out.add(h.key, value)
    return out


def _filter_metadata(req: ProcessingRequest, namespace: str) -> dict[str, Any] | None:
    meta = req.metadata_context
    if meta is None or namespace not in meta.filter_metadata:
        return None
    return meta.filter_metadata[namespace].to_dict()


def _immediate(err: ApiError) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=StatusCode(err.status)),
            headers=HeaderMutation(set_headers=[_set_header("content-type", "application/json")]),
            body=json.dumps(err.body()).encode(),
            details=err.code,
        )
    )


def _set_header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()))


@dataclass
class _Stream:
    """What one ext_proc stream (one HTTP request through the gateway) has seen so far."""

    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    body: bytearray = field(default_factory=bytearray)
    routed: Routed | None = None
    streaming_response: bool = False


class EndpointPicker(ExternalProcessorBase):
    """Envoy's ExternalProcessor service, picking with kvplug's router."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.picks = 0
        self.rejects = 0

    async def process(
        self, messages: AsyncIterator[ProcessingRequest]
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream()
        try:
            async for msg in messages:
                if msg.request_headers is not None:
                    stream.headers = _headers(msg.request_headers)
                    if msg.request_headers.end_of_stream:  # no body: nothing to route on
                        yield self._reject(stream, _no_body())
                        return
                elif msg.request_body is not None:
                    stream.body += msg.request_body.body
                    if msg.request_body.end_of_stream:
                        for answer in await self._pick(stream, msg):
                            yield answer
                        if stream.routed is None:
                            return
                elif msg.response_headers is not None:
                    yield self._response_headers(stream, msg)
                elif msg.response_body is not None:
                    yield self._response_body(stream, msg)
                # trailers need no answer in FULL_DUPLEX_STREAMED mode
        finally:
            if stream.routed is not None:  # the gateway closed the stream: load goes back
                stream.routed.lifecycle.finish()

    # -- request ---------------------------------------------------------------------------
    async def _pick(self, stream: _Stream, msg: ProcessingRequest) -> list[ProcessingResponse]:
        try:
            routed = await self._route(stream, msg)
        except ApiError as err:
            return [self._reject(stream, err)]
        stream.routed = routed
        endpoint = endpoint_of(routed.entry.url_base)
        routed.record.outcome = "picked"
        self.picks += 1
        headers = HeadersResponse(
            response=CommonResponse(
                header_mutation=HeaderMutation(
                    set_headers=[
                        _set_header(DESTINATION, endpoint),
                        _set_header("content-length", str(len(stream.body))),
                        _set_header("x-kvplug-worker", routed.decision.worker_id),
                        _set_header("x-kvplug-decision-id", routed.record.decision_id),
                    ]
                ),
                clear_route_cache=True,
            )
        )
        metadata = Struct.from_dict({LB_NAMESPACE: {DESTINATION: endpoint}})
        body = BodyResponse(
            response=CommonResponse(
                body_mutation=BodyMutation(
                    streamed_response=StreamedBodyResponse(
                        body=bytes(stream.body), end_of_stream=True
                    )
                )
            )
        )
        return [
            ProcessingResponse(request_headers=headers, dynamic_metadata=metadata),
            ProcessingResponse(request_body=body),
        ]

    async def _route(self, stream: _Stream, msg: ProcessingRequest) -> Routed:
        fe = self.frontend
        headers = stream.headers
        self._check_key(headers.get("authorization"))
        path = _PATHS.get(headers.get(":path", "").split("?", 1)[0])
        if path is None:
            raise ApiError(
                404,
                f"the endpoint picker routes {COMPLETIONS} and {CHAT}, "
                f"not {headers.get(':path', '')!r}",
                "invalid_request_error",
                "unknown_path",
            )
        if len(stream.body) > fe.settings.max_body_bytes:
            raise ApiError(
                413,
                f"request body is over the {fe.settings.max_body_bytes}-byte limit "
                "(--max-body-bytes)",
                "invalid_request_error",
                "body_too_large",
            )
        req = parse_request(bytes(stream.body), path)
        model_workers = fe._check_model(req)
        hints = fe.client_hints.read(req.nvext, headers)  # --client-routing-hints applies
        fe._check_hint_workers(hints)
        if req.batch_size > 1:
            raise ApiError(
                400,
                "the endpoint picker routes one prompt per request; send batched "
                "completions to kvplug serve's own API",
                "invalid_request_error",
                "batch_not_supported",
                "prompt",
            )
        allowed = self._subset(msg)
        tokens, source, note = await fe.tokens.resolve(req)
        fe.check_prompt_tokens(tokens, "prompt")
        key = next(fe._keys)
        request_id = headers.get("x-request-id") or f"kvplug-epp-{key}"
        ctx = RequestContext(key, request_id, req, tokens, source, note, hints, model_workers)
        try:
            return fe.route_stage(ctx, Stage.AGGREGATED, 0, frozenset(), allowed)
        except ApiError as err:
            if err.code in _SHED_CODES:
                raise ApiError(429, err.message, "rate_limit_exceeded", err.code) from None
            raise

    def _check_key(self, authorization: str | None) -> None:
        """``--api-key`` holds for requests through the gateway too."""
        key = self.frontend.settings.api_key
        if key is None:
            return
        if authorization is None or not hmac.compare_digest(
            authorization.encode("utf-8", "replace"), f"Bearer {key}".encode()
        ):
            raise ApiError(
                401, "missing or wrong API key", "authentication_error", "invalid_api_key"
            )

    def _subset(self, msg: ProcessingRequest) -> frozenset[str] | None:
        hint = _filter_metadata(msg, SUBSET_NAMESPACE)
        if hint is None or SUBSET not in hint:
            return None
        listed = hint[SUBSET]
        if isinstance(listed, str):  # tolerate one comma-separated string
            listed = listed.split(",")
        if not isinstance(listed, list):
            listed = []
        wanted = {str(e).strip() for e in listed}
        allowed = frozenset(
            w for w, e in self.frontend.fleet.workers.items() if endpoint_of(e.url_base) in wanted
        )
        if not allowed:
            raise ApiError(
                503,
                f"none of the subset's endpoints {sorted(wanted)} is a known worker",
                "service_unavailable",
                "empty_subset",
            )
        return allowed

    def _reject(self, stream: _Stream, err: ApiError) -> ProcessingResponse:
        self.rejects += 1
        self.frontend.metrics.rejected.labels(err.code).inc()
        log.debug("endpoint picker: %d %s", err.status, err.message)
        return _immediate(err)

    # -- response ------------------------------------------------------------------------------
    def _response_headers(self, stream: _Stream, msg: ProcessingRequest) -> ProcessingResponse:
        headers = _headers(msg.response_headers)
        routed = stream.routed
        if routed is not None:
            status = headers.get(":status", "200")
            routed.record.status = int(status) if status.isdigit() else None
            stream.streaming_response = "text/event-stream" in headers.get("content-type", "")
            served = (_filter_metadata(msg, LB_NAMESPACE) or {}).get(SERVED)
            if served and served != endpoint_of(routed.entry.url_base):
                routed.record.error = f"the gateway served it from {served}"
        return ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))

    def _response_body(self, stream: _Stream, msg: ProcessingRequest) -> ProcessingResponse:
        chunk = msg.response_body
        assert chunk is not None  # the caller dispatched on it
        routed = stream.routed
        if routed is not None:
            # a whole answer's first bytes come after its decode: only a stream's times its prefill
            routed.lifecycle.first_token(measured=stream.streaming_response)
            if chunk.end_of_stream:
                routed.lifecycle.finish()
                record = routed.record
                record.outcome = "ok" if record.status in (None, 200) else "engine_error"
                record.total_s = time.perf_counter() - routed.lifecycle.started
        return ProcessingResponse(
            response_body=BodyResponse(
                response=CommonResponse(
                    body_mutation=BodyMutation(
                        streamed_response=StreamedBodyResponse(
                            body=chunk.body, end_of_stream=chunk.end_of_stream
                        )
                    )
                )
            )
        )


def _no_body() -> ApiError:
    return ApiError(
        400,
        "the endpoint picker needs the request body (configure the gateway's ext_proc "
        "filter with request_body_mode FULL_DUPLEX_STREAMED)",
        "invalid_request_error",
        "missing_body",
    )


class _HealthName:
    """A bare service name for grpclib's health service, which names services by their gRPC
    method paths (GIE's EPP answers for ``liveness`` and ``readiness`` too)."""

    def __init__(self, name: str):
        self.name = name

    def __mapping__(self) -> dict[str, None]:
        return {f"/{self.name}/Check": None}


@dataclass
class RunningPicker:
    server: grpclib.server.Server
    picker: EndpointPicker
    health: Health
    port: int

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def start_endpoint_picker(
    frontend: Frontend, host: str = "127.0.0.1", port: int = 0
) -> RunningPicker:
    """Serve the ext_proc endpoint picker and gRPC health on ``host:port`` (0 = any free)."""
    picker = EndpointPicker(frontend)
    alive = ServiceStatus()
    alive.set(True)

    async def ready() -> bool:  # the same verdict as GET /ready
        return bool(frontend.fleet.ready()[0])

    readiness = ServiceCheck(ready, check_ttl=1.0)
    health = Health(
        {
            picker: [readiness],
            _HealthName("readiness"): [readiness],
            _HealthName("liveness"): [alive],
        }
    )
    server = grpclib.server.Server([picker, health])
    await server.start(host, port)
    bound = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.info("endpoint picker (ext_proc gRPC) on %s:%d", host, bound)
    return RunningPicker(server, picker, health, bound)

"""The admin API: add, drain, undrain, remove and list workers at run time.

Served on its own listener (``--admin-host``, loopback by default; ``--admin-port``) and only
when ``--admin-token`` (or ``KVPLUG_ADMIN_TOKEN``) is set; every call needs
``Authorization: Bearer <token>``.

| method | path | body | answer |
| --- | --- | --- | --- |
| GET | /admin/workers | - | ``{"workers": [...]}`` |
| POST | /admin/workers | one worker entry (the YAML keys) | 201, the worker |
| POST | /admin/workers/{id}/drain | - | the worker (no new requests) |
| POST | /admin/workers/{id}/undrain | - | the worker |
| DELETE | /admin/workers/{id} | - | the removed worker |
| GET | /admin/busy_threshold | - | the router's busy thresholds (Dynamo's names) |
| POST | /admin/busy_threshold | thresholds (absent = unset) | the new thresholds |
"""

from __future__ import annotations

import logging
import math
from typing import Any

from aiohttp import web

from kvplug.errors import ConfigError, UnknownWorker
from kvplug.frontend.app import bearer_matches
from kvplug.frontend.bodies import read_body
from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.errors import ApiError
from kvplug.frontend.fleet import Fleet
from kvplug.frontend.parsing import decode_json

log = logging.getLogger(__name__)

ADMIN_MAX_BODY_BYTES = 1024 * 1024
BODY_TIMEOUT_KEY = web.AppKey("body_timeout", float)


async def _json_body(request: web.Request) -> Any:
    """The decoded JSON body (strict: no NaN/Infinity, bounded depth); ``ApiError`` if not."""
    raw = await read_body(request, ADMIN_MAX_BODY_BYTES, request.app[BODY_TIMEOUT_KEY])
    return decode_json(raw)


def _auth_middleware(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if not bearer_matches(request, expected):
            return ApiError(
                401,
                "admin API: missing or wrong bearer token",
                "authentication_error",
                "unauthorized",
            ).response(headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


class AdminApi:
    def __init__(self, fleet: Fleet, default_engine: str = "vllm", prober=None) -> None:
        self.fleet = fleet
        self.default_engine = default_engine
        self.prober = prober

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": [e.describe() for e in self.fleet.workers.values()]})

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            data = await _json_body(request)
        except ApiError as exc:
            return exc.response()
        try:
            spec = spec_from_mapping(data, "admin add", self.default_engine)
            entry = await self.fleet.add(spec)
        except ConfigError as exc:
            status = 409 if "already exists" in str(exc) else 400
            return ApiError(status, str(exc), code="invalid_worker").response()
        if self.prober is not None:
            await self.prober.probe(entry)
        log.info("admin: added worker %s", spec.worker_id)
        return web.json_response(entry.describe(), status=201)

    async def drain_worker(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        try:
            entry = self.fleet.drain(worker_id)
        except UnknownWorker as exc:
            return ApiError(404, str(exc), code="unknown_worker").response()
        return web.json_response(entry.describe())

    async def undrain_worker(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        try:
            entry = self.fleet.get(worker_id)
            self.fleet.router.undrain_worker(worker_id)
        except UnknownWorker as exc:
            return ApiError(404, str(exc), code="unknown_worker").response()
        entry.draining = False
        return web.json_response(entry.describe())

    async def remove_worker(self, request: web.Request) -> web.Response:
        worker_id = request.match_info["worker_id"]
        try:
            entry = await self.fleet.remove(worker_id)
        except UnknownWorker as exc:
            return ApiError(404, str(exc), code="unknown_worker").response()
        return web.json_response(entry.describe())


_BUSY_KEYS = (
    ("active_decode_blocks_threshold", "decode_frac"),
    ("active_prefill_tokens_threshold", "prefill_tokens"),
    ("active_prefill_tokens_threshold_frac", "prefill_frac"),
)


def _busy_json(thresholds) -> dict:
    out = {name: getattr(thresholds, attr) for name, attr in _BUSY_KEYS}
    out["busy_threshold_fallback"] = thresholds.fallback
    return out


class BusyThresholdApi:
    """Dynamo's runtime ``GET/POST /busy_threshold``, on the admin listener."""

    def __init__(self, router) -> None:
        self.router = router

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(_busy_json(self.router.busy_thresholds))

    async def post(self, request: web.Request) -> web.Response:
        try:
            data = await _json_body(request)
        except ApiError as exc:
            return exc.response()
        if not isinstance(data, dict):
            return ApiError(400, "body must be a JSON object", code="invalid_json").response()
        known = {name for name, _ in _BUSY_KEYS} | {"busy_threshold_fallback", "model"}
        unknown = set(data) - known
        if unknown:
            return ApiError(
                400,
                f"unknown keys {sorted(unknown)}; known: {sorted(known)}",
                code="invalid_threshold",
            ).response()
        values = {}
        for name, attr in _BUSY_KEYS:
            v = data.get(name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            ):
                return ApiError(
                    400, f"{name} must be a finite number or null", code="invalid_threshold"
                ).response()
            values[attr] = v
        fallback = data.get("busy_threshold_fallback")
        if fallback is not None and not isinstance(fallback, bool):
            return ApiError(
                400, "busy_threshold_fallback must be a boolean", code="invalid_threshold"
            ).response()
        try:
            self.router.set_busy_thresholds(**values, fallback=fallback)
        except ConfigError as exc:
            return ApiError(400, str(exc), code="invalid_threshold").response()
        log.info("admin: busy thresholds now %s", _busy_json(self.router.busy_thresholds))
        return web.json_response(_busy_json(self.router.busy_thresholds))


def build_admin_app(
    fleet: Fleet,
    token: str,
    default_engine: str = "vllm",
    prober=None,
    body_timeout: float = 60.0,
) -> web.Application:
    if not token:
        raise ConfigError("the admin API needs a non-empty bearer token")
    api = AdminApi(fleet, default_engine, prober)
    app = web.Application(
        middlewares=[_auth_middleware(token)], client_max_size=ADMIN_MAX_BODY_BYTES
    )
    app[BODY_TIMEOUT_KEY] = body_timeout
    app.router.add_get("/admin/workers", api.list_workers)
    app.router.add_post("/admin/workers", api.add_worker)
    app.router.add_post("/admin/workers/{worker_id}/drain", api.drain_worker)
    app.router.add_post("/admin/workers/{worker_id}/undrain", api.undrain_worker)
    app.router.add_delete("/admin/workers/{worker_id}", api.remove_worker)
    busy = BusyThresholdApi(fleet.router)
    app.router.add_get("/admin/busy_threshold", busy.get)
    app.router.add_post("/admin/busy_threshold", busy.post)
    return app

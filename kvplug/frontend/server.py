"""Start and stop a frontend (public API plus optional admin API) inside a running loop.

Used by ``kvplug serve``, the tests and the benchmark alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvplug.errors import ConfigError
from kvplug.frontend.admin import build_admin_app
from kvplug.frontend.app import Frontend, ServeSettings, build_app, lane_handlers
from kvplug.frontend.config import WorkerSpec
from kvplug.frontend.listener import Listeners, is_loopback, quiet_client_faults, url_of
from kvplug.frontend.tokens import LocalTokenizer

log = logging.getLogger(__name__)

_LOOPBACK_OF = {"0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass
class RunningFrontend:
    frontend: Frontend
    url: str  # where a client on this machine reaches the API
    admin_url: str | None
    _runners: list[web.AppRunner]
    _listeners: list[Listeners] = field(default_factory=list)
    bound: list[str] = field(default_factory=list)  # every address the API listens on
    admin_bound: list[str] = field(default_factory=list)
    native: Any = None  # kvplug.frontend.native_lane.NativeDataPath (--data-path native)

    @property
    def head_timeouts(self) -> int:
        """Connections closed because a request head came too slowly (slow loris)."""
        return sum(lst.head_timeouts for lst in self._listeners)

    async def close(self) -> None:
        if self.native is not None:
            self.native.stop_accepting()  # before its listening sockets close
        for listeners in self._listeners:
            listeners.close()
        if self.native is not None:
            await self.native.close(getattr(self._runners[0], "_shutdown_timeout", 60.0))
        for listeners in self._listeners:
            await listeners.shutdown_lane()
        for runner in self._runners:
            await runner.cleanup()
        await self.frontend.close()


def _local_url(addresses: list[tuple[str, int]]) -> str:
    """A URL this machine can connect to: a wildcard bind is reached over loopback."""
    host, port = addresses[0]
    return url_of(_LOOPBACK_OF.get(host, host), port)


async def _serve_app(
    app: web.Application,
    host: str,
    port: int,
    settings: ServeSettings,
    backlog: int = 1024,
    reuse_port: bool = False,
    lane: dict[bytes, Any] | None = None,
    start_serving: bool = True,
) -> tuple[web.AppRunner, Listeners]:
    kwargs: dict[str, Any] = {}
    header_timeout = settings.client_header_timeout
    if header_timeout > 0:  # later heads on a kept-alive connection (kvplug/frontend/listener.py)
        kwargs["keepalive_timeout"] = header_timeout
    if settings.client_body_timeout > 0:
        # after an early answer (408, 413) aiohttp reads and drops what the client still
        # sends for this long (default 10 s) before closing: no longer than a body may take
        kwargs["lingering_time"] = min(10.0, settings.client_body_timeout)
    # handler_cancellation: a client that hangs up cancels its handler, which closes the
    # engine's request and releases the router's load (nobody reads that answer)
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, handler_cancellation=True, **kwargs
    )
    await runner.setup()
    listeners = Listeners(runner, header_timeout)
    try:
        await listeners.listen(
            host, port, backlog, reuse_port, lane, settings.max_body_bytes, start_serving
        )
    except BaseException:
        await runner.cleanup()
        raise
    return runner, listeners


async def start_frontend(
    router: Any,
    specs: list[WorkerSpec] = (),  # type: ignore[assignment]
    settings: ServeSettings | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tokenizer: LocalTokenizer | None = None,
    admin_token: str | None = None,
    admin_host: str = "127.0.0.1",
    admin_port: int | None = 0,
    default_engine: str = "vllm",
    peers: Any = None,
) -> RunningFrontend:
    """Serve on ``host:port`` (0 = any free port); the admin API only with a token. With
    ``peers`` (:class:`kvplug.frontend.peers.ProcessPeers`) this is one process of several
    on one port: the socket is opened with SO_REUSEPORT and ``/metrics`` and decision lookups
    answer for all of them."""
    quiet_client_faults()
    frontend = Frontend(router, settings, tokenizer)
    if peers is not None:
        peers.install(frontend)
    s = frontend.settings
    runners: list[web.AppRunner] = []
    listeners: list[Listeners] = []
    native = None
    native_path = uses_native_path(s.data_path)
    try:
        await frontend.start(list(specs))  # a refusal closes what it opened (below)
        runner, api = await _serve_app(
            build_app(frontend),
            host,
            port,
            s,
            reuse_port=peers is not None,
            lane=lane_handlers(frontend) if s.http_lane else None,
            start_serving=not native_path,  # else the native lane accepts
        )
        runners.append(runner)
        listeners.append(api)
        frontend.http_lane = api.lane
        if native_path:
            native = frontend.native_lane = await _start_native(frontend, api)
        url = _local_url(api.addresses())
        bound = [url_of(h, p) for h, p in api.addresses()]
        admin_url = None
        admin_bound: list[str] = []
        if admin_token and admin_port is not None and admin_port >= 0:
            admin_app = build_admin_app(
                frontend.fleet, admin_token, default_engine, frontend.prober, s.client_body_timeout
            )
            runner, adm = await _serve_app(admin_app, admin_host, admin_port, s)
            runners.append(runner)
            listeners.append(adm)
            admin_url = _local_url(adm.addresses())
            admin_bound = [url_of(h, p) for h, p in adm.addresses()]
            if not all(is_loopback(h) for h, _ in adm.addresses()):
                log.warning(
                    "the admin API listens beyond this machine (%s): anyone who can reach it "
                    "and holds the admin token can add, drain and remove workers; keep "
                    "--admin-host on loopback unless a network policy guards it",
                    ", ".join(admin_bound),
                )
    except BaseException:
        if native is not None:
            await native.close(0)
        for lst in listeners:
            lst.close()
        for r in runners:
            await r.cleanup()
        await frontend.close()
        raise
    return RunningFrontend(frontend, url, admin_url, runners, listeners, bound, admin_bound, native)


def uses_native_path(data_path: str) -> bool:
    """Whether ``--data-path`` means the compiled data path: ``native`` (a ConfigError later
    where it is not built: never a silent fall back), or ``auto`` where it is built."""
    if data_path == "auto":
        from kvplug.frontend.native_lane import available

        if not available():
            log.warning("--data-path auto: kvplug._lane is not built here: the Python path serves")
            return False
        return True
    if data_path not in ("native", "python"):
        raise ConfigError(f"--data-path: {data_path!r} is not auto, native or python")
    return data_path == "native"


async def _start_native(frontend: Frontend, api: Listeners) -> Any:
    """The compiled data path on the API's sockets, its decisions by kvplug's control plane."""
    from kvplug.frontend.native_glue import NativeGlue
    from kvplug.frontend.native_lane import NativeDataPath, available

    if not available():  # said loudly: never a silent fall back to the Python path
        raise ConfigError("--data-path native: kvplug._lane is not built (it needs Linux)")
    native = NativeDataPath(frontend, api, NativeGlue(frontend))
    await native.start()
    return native

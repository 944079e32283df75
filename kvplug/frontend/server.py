"""Start and stop a frontend (public API plus optional admin API) inside a running loop.

Used by ``kvplug serve``, the tests and the benchmark alike.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvplug.frontend.admin import build_admin_app
from kvplug.frontend.app import Frontend, ServeSettings, build_app
from kvplug.frontend.config import WorkerSpec
from kvplug.frontend.tokens import LocalTokenizer

log = logging.getLogger(__name__)


@dataclass
class RunningFrontend:
    frontend: Frontend
    url: str
    admin_url: str | None
    _runners: list[web.AppRunner]

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        await self.frontend.close()


def _bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return server.sockets[0].getsockname()[1]
    raise RuntimeError("site is not bound")


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
) -> RunningFrontend:
    """Serve on ``host:port`` (0 = any free port); the admin API only with a token."""
    frontend = Frontend(router, settings, tokenizer)
    await frontend.start(list(specs))
    runners: list[web.AppRunner] = []
    try:
        # handler_cancellation: a client that hangs up cancels its handler, which closes the
        # engine's request and releases the router's load (nobody reads that answer)
        runner = web.AppRunner(
            build_app(frontend), access_log=None, handle_signals=False, handler_cancellation=True
        )
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, host, port, reuse_address=True, backlog=1024).start()
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        url = f"http://{_fmt_host(shown)}:{_bound_port(runner)}"
        admin_url = None
        if admin_token and admin_port is not None and admin_port >= 0:
            admin = web.AppRunner(
                build_admin_app(frontend.fleet, admin_token, default_engine, frontend.prober),
                access_log=None,
                handle_signals=False,
            )
            await admin.setup()
            runners.append(admin)
            await web.TCPSite(admin, admin_host, admin_port, reuse_address=True).start()
            admin_url = f"http://{_fmt_host(admin_host)}:{_bound_port(admin)}"
    except BaseException:
        for r in runners:
            await r.cleanup()
        await frontend.close()
        raise
    return RunningFrontend(frontend, url, admin_url, runners)


def _fmt_host(host: str) -> str:
    try:
        socket.inet_pton(socket.AF_INET6, host)
        return f"[{host}]"
    except OSError:
        return host

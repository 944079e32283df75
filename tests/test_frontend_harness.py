"""Shared harness of the frontend tests (no tests here): stub engines on loopback, a real
Router, and ``kvplug serve``'s app started in-process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvplug.config import RouterConfig
from kvplug.frontend.app import ServeSettings
from kvplug.frontend.config import spec_from_mapping
from kvplug.frontend.server import RunningFrontend, start_frontend
from kvplug.frontend.stub_engine import StubEngine, TransferBoard, publish
from kvplug.router import Router

BS = 16
MODEL = "stub-model"


class Harness:
    def __init__(
        self,
        router: Router,
        running: RunningFrontend,
        engines: dict[str, StubEngine],
        session: aiohttp.ClientSession,
        board: TransferBoard,
    ) -> None:
        self.router = router
        self.running = running
        self.frontend = running.frontend
        self.url = running.url
        self.admin_url = running.admin_url
        self.engines = engines
        self.session = session
        self.board = board

    async def post(
        self, path: str, body: Any, headers: dict | None = None, raw: bytes | None = None
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        kwargs: dict[str, Any] = {"headers": headers or {}}
        if raw is not None:
            kwargs["data"] = raw
        else:
            kwargs["json"] = body
        async with self.session.post(self.url + path, **kwargs) as resp:
            return resp, await resp.read()

    async def complete(self, prompt, *, stream=False, max_tokens=4, headers=None, **extra):
        body = {
            "model": MODEL,
            "prompt": prompt,
            "stream": stream,
            "max_tokens": max_tokens,
            **extra,
        }
        return await self.post("/v1/completions", body, headers)

    async def trace(self, decision_id: str) -> dict:
        async with self.session.get(f"{self.url}/kvplug/decisions/{decision_id}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    def active(self) -> dict[str, Any]:
        """The router's whole active load: must be exactly zero between requests."""
        load = {w: self.router.active_load(w) for w in self.router.workers}
        return {"active_requests": self.router.stats()["active_requests"], "load": load}

    def assert_idle(self) -> None:
        snap = self.active()
        assert snap["active_requests"] == 0, snap
        for ranks in snap["load"].values():
            for values in ranks.values():
                assert values == {"prefill_tokens": 0.0, "decode_blocks": 0.0, "inflight": 0}, snap
        for entry in self.frontend.fleet.workers.values():
            assert entry.inflight == 0, entry.describe()


@contextlib.asynccontextmanager
async def serving(
    workers: list[dict] | int = 3,
    *,
    settings: ServeSettings | None = None,
    router_config: dict | None = None,
    admin_token: str | None = None,
    tokenizer=None,
    engine_kind: str = "stub",
    stub_options: dict | None = None,
    routing_hints: str = "trust",
):
    """Start stub engines (``workers``: a count, or dicts of StubEngine/worker-spec options),
    a Router and the frontend; yield a Harness; stop everything. The tests steer requests
    with pins, so client routing hints are trusted unless ``routing_hints`` says otherwise."""
    if isinstance(workers, int):
        workers = [{"id": f"w{i}"} for i in range(workers)]
    board = TransferBoard()
    engines: dict[str, StubEngine] = {}
    specs = []
    for w in workers:
        w = dict(w)
        wid = w.pop("id")
        role = w.get("role", "both")
        engine_opts = {**(stub_options or {}), **w.pop("stub", {})}
        engine = StubEngine(wid, block_size=BS, role=role, board=board, model=MODEL, **engine_opts)
        await engine.start()
        publish(engine)
        engines[wid] = engine
        specs.append(
            spec_from_mapping(
                {"id": wid, "url": engine.url, "engine": engine_kind, **w}, f"worker {wid}"
            )
        )
    cfg = {"kv_block_size": BS, **(router_config or {})}
    router = Router(RouterConfig(**cfg), rng=random.Random(0))
    # health_timeout: a probe answered late on a loaded machine must not take a worker out
    settings = settings or ServeSettings(health_interval=0.2, health_timeout=5.0)
    settings = dataclasses.replace(settings, client_routing_hints=routing_hints)
    try:
        running = await start_frontend(
            router,
            specs,
            settings,
            tokenizer=tokenizer,
            admin_token=admin_token,
            default_engine=engine_kind,
        )
    except BaseException:
        for engine in engines.values():
            await engine.stop()
        raise
    session = aiohttp.ClientSession()
    try:
        yield Harness(router, running, engines, session, board)
    finally:
        await session.close()
        await running.close()
        for engine in engines.values():
            await engine.stop()


async def eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    """Poll ``check`` until it holds; fail after ``timeout``. Generous on purpose: what takes
    milliseconds on a quiet machine can take seconds on a loaded CI runner."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what or check}"
        await asyncio.sleep(0.02)


def prompt(n_blocks: int, seed: int) -> list[int]:
    """Token ids of ``n_blocks`` full blocks, distinct per seed."""
    return [seed * 100_000 + i for i in range(n_blocks * BS)]

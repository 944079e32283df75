"""What one process of ``kvplug serve --processes N`` answers for all of them.

A client's connection lands on any of the processes (the kernel spreads connections over the
``SO_REUSEPORT`` sockets), but each process has its own router, index, metrics and decision
store. So that ``/metrics`` and ``GET /kvplug/decisions/{id}`` mean the same whichever process
answers, every process also serves its own metrics and decisions on a Unix socket in the
serve's private directory (``http-<i>.sock``), and the public handlers gather from all:

* ``/metrics``: every process's series, each with a ``process`` label (its index), plus
  ``kvplug_process_up{process}`` (0 for a process that did not answer within 2 s, e.g. while
  it restarts). Sum over ``process`` for serve-wide totals.
* ``/kvplug/decisions/{id}``: this process's trace, else the one process that made the
  decision; the trace names it (``"process": {"index", "pid"}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0


def http_socket(directory: str, index: int) -> str:
    return os.path.join(directory, f"http-{index}.sock")


class _Families:
    """A collector over already-gathered metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_metrics(texts: dict[int, str | None]) -> bytes:
    """Prometheus text from each process (None: did not answer) -> one exposition, every
    sample labelled with its process."""
    merged: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "kvplug_process_up",
        "1 if this serve process answered the scrape (kvplug serve --processes)",
        labels=["process"],
    )
    for index in sorted(texts):
        text = texts[index]
        up.add_metric([str(index)], 0.0 if text is None else 1.0)
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for s in family.samples:
                labels = {**s.labels, "process": str(index)}
                into.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), up]))  # type: ignore[arg-type]
    return generate_latest(registry)


class ProcessPeers:
    """Process ``index`` of ``count``: serves its own view on its Unix socket and answers the
    public ``/metrics`` and decision lookups for the whole serve."""

    def __init__(self, directory: str, index: int, count: int) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self.identity = {"index": index, "pid": os.getpid()}
        self._frontend: Any = None
        self._runner: web.AppRunner | None = None
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def install(self, frontend: Any) -> None:
        """Before ``build_app``: the public handlers become the serve-wide ones."""
        self._frontend = frontend
        self._own_metrics = frontend.handle_metrics
        self._own_decision = frontend.handle_decision
        frontend.handle_metrics = self.handle_metrics
        frontend.handle_decision = self.handle_decision

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._own_metrics)
        app.router.add_get("/kvplug/decisions/{decision_id}", self._local_decision)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        path = http_socket(self.directory, self.index)
        if os.path.exists(path):
            os.unlink(path)  # left by this index's previous process
        await web.UnixSite(self._runner, path).start()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            with contextlib.suppress(OSError):
                os.unlink(http_socket(self.directory, self.index))

    # -- this process's own view (the Unix socket) ---------------------------------------
    async def _local_decision(self, request: web.Request) -> web.Response:
        response = await self._own_decision(request)
        if response.status == 200:
            trace = json.loads(response.body)  # type: ignore[arg-type]
            trace["process"] = self.identity
            return web.json_response(trace)
        return response

    # -- asking the others -----------------------------------------------------------------
    def _session(self, index: int) -> aiohttp.ClientSession:
        session = self._sessions.get(index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=http_socket(self.directory, index))
            session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
            )
            self._sessions[index] = session
        return session

    async def _get(self, index: int, path: str) -> tuple[int, bytes] | None:
        try:
            async with self._session(index).get("http://localhost" + path) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.debug("process %d did not answer %s: %s", index, path, exc)
            return None

    async def handle_metrics(self, request: web.Request) -> web.Response:
        own = (await self._own_metrics(request)).body
        others = [i for i in range(self.count) if i != self.index]
        answers = await asyncio.gather(*(self._get(i, "/metrics") for i in others))
        texts: dict[int, str | None] = {self.index: bytes(own).decode()}  # type: ignore[arg-type]
        for i, answer in zip(others, answers, strict=True):
            texts[i] = answer[1].decode() if answer is not None and answer[0] == 200 else None
        return web.Response(
            body=merge_metrics(texts), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def handle_decision(self, request: web.Request) -> web.Response:
        local = await self._local_decision(request)
        if local.status == 200:
            return local
        decision_id = request.match_info["decision_id"]
        path = "/kvplug/decisions/" + quote(decision_id, safe="")
        others = [i for i in range(self.count) if i != self.index]
        for answer in await asyncio.gather(*(self._get(i, path) for i in others)):
            if answer is not None and answer[0] == 200:
                return web.Response(body=answer[1], content_type="application/json")
        return local  # nobody has it: this process's 404

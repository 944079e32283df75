"""Fault figures: what ``kvplug serve`` loses, and how fast it notices, when its engines or it
itself fail. Everything is a real process on loopback: two ``kvplug sim --engines 1`` engines
(``a`` and ``b``, vLLM-like: OpenAI HTTP, ``/metrics``, ZMQ KV events with a replay endpoint),
the router under test (``kvplug serve --per-try-timeout 1``, otherwise defaults), and a reference
``kvplug serve`` subscribed to the same engines that no fault touches (the baseline its index is
compared with).

Faults, each while light background traffic flows through the router (one request every
``--gap`` seconds, prompts sharing a few long prefixes):

* ``engine_killed``: engine ``a`` is SIGKILLed while streams run on both engines. Figures: streams
  lost (those on ``a``: they end with an error event, their bytes already went out, so they
  cannot be retried), streams on ``b`` that completed, requests after the kill, how many were
  retried on ``b`` and how many failed, time until ``a`` is marked down, requests routed to
  ``a`` after that (0: its blocks are excluded from then on), blocks still indexed for ``a``.
* ``engine_restarted``: ``a`` comes back on the same ports with an empty cache. Figures: time
  until it is healthy, until its stale blocks are purged from the index (the sequence numbers
  going back to 0 reveal the restart), until it serves again; failed requests.
* ``metrics_timeout``: ``a``'s ``/metrics`` (through a proxy here) stops answering. Figures:
  failed requests, time until the adapter's verdict takes ``a`` out, time until it is back once
  ``/metrics`` answers again.
* ``engine_hung``: engine ``a`` is SIGSTOPped (alive, silent: a hung GPU or event loop). The
  router runs with ``--per-try-timeout 1``. Figures: requests sent to it, how many failed, the
  slowest answer (an attempt waits the per-try timeout, then goes to ``b``), time until ``a`` is
  marked down (failed attempts, failed probes), time until it is back after SIGCONT.
* ``router_restarted``: the router under test is SIGKILLed and started again while the engines
  keep publishing. Figures: time until ``/ready``, until its index holds exactly the blocks
  the reference router's does, per worker (replayed from the engines' replay buffers).

    python benchmarks/fault_engines.py            # ~1 minute
    python benchmarks/fault_engines.py --quick    # the smoke run the tests use

Writes ``benchmarks/results/fault_engines.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.testing import (  # noqa: E402
    free_port,
    free_port_runs,
    raise_if_exited,
    serve_command,
    stop_process,
)

MODEL = "sim-llama-3-8b"
ENGINES = ("a", "b")
PREFIXES = [" ".join(f"doc{d}-w{i}" for i in range(60)) for d in range(6)]
PER_TRY = ["--per-try-timeout", "1"]  # the router under test gives up on a silent engine
_METRIC = re.compile(r"^(kvplug_[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# a /metrics proxy that can be told to hang (the "metrics endpoint timing out" fault)


class MetricsProxy:
    def __init__(self, target: str) -> None:
        self.target = target
        self.hang = False
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/metrics"
        return self.url

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(3600)
        assert self._session is not None
        try:
            async with self._session.get(self.target) as r:
                return web.Response(body=await r.read(), status=r.status)
        except aiohttp.ClientError:
            return web.Response(status=502)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


# ------------------------------------------------------------------------------------------
# the lab: engines, the router under test, the reference router


@dataclass
class Engine:
    name: str
    http: int
    events: int
    replay: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"


@dataclass
class Router:
    name: str
    port: int
    config: Path
    proc: subprocess.Popen | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Lab:
    def __init__(self, workdir: Path, speed: float = 1.0, serve_args: list[str] | None = None):
        self.workdir = workdir
        self.speed = speed
        self.serve_args = serve_args or []
        http, ev, rp = free_port_runs(2, 3)
        self.engines = {n: Engine(n, http + i, ev + i, rp + i) for i, n in enumerate(ENGINES)}
        self.proxy = MetricsProxy(self.engines["a"].url + "/metrics")
        self.routers: dict[str, Router] = {}
        self.session: aiohttp.ClientSession | None = None
        self._n = 0

    # -- processes --------------------------------------------------------------------------
    def start_engine(self, name: str) -> None:
        e = self.engines[name]
        out = open(self._log(f"engine-{name}"), "ab")  # noqa: SIM115 - the child's
        e.proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvplug.cli", "sim", "--engines", "1",
                "--base-port", str(e.http), "--events-base-port", str(e.events),
                "--replay-base-port", str(e.replay), "--speed", str(self.speed),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    def start_router(self, name: str) -> None:
        r = self.routers[name]
        out = open(self._log(f"router-{name}"), "ab")  # noqa: SIM115 - the child's
        r.proc = subprocess.Popen(
            serve_command(
                r.port,
                "--kv-block-size", "16", "--log-level", "warning",
                "--worker-config", str(r.config),
                "--health-interval", "1", "--health-timeout", "1",
                *self.serve_args, *r.extra,
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "KVPLUG_VLLM_METRICS_PERIOD": "0.5"},
        )  # fmt: skip

    def _write_config(self, name: str, metrics_a: str | None) -> Path:
        workers = []
        for e in self.engines.values():
            w: dict[str, Any] = {"id": e.name, "url": e.url, "engine": "vllm"}
            if e.name == "a" and metrics_a:
                w["metrics_url"] = metrics_a
            workers.append(w)
        path = self.workdir / f"workers-{name}.yaml"
        path.write_text(json.dumps({"workers": workers}))  # JSON is YAML
        return path

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        for n in ENGINES:
            self.start_engine(n)
        for n in ENGINES:
            await self._engine_up(n)
        self.proxy.target = self.engines["a"].url + "/metrics"  # a may have moved ports
        proxy_url = await self.proxy.start()
        config = self._write_config("r", proxy_url)
        self.routers["router"] = Router("router", free_port(), config, extra=PER_TRY)
        self.routers["reference"] = Router(
            "reference", free_port(), self._write_config("ref", None)
        )
        for n in self.routers:
            self.start_router(n)
        for r in self.routers.values():
            await self.wait_http(r.url + "/ready", r.proc)
        await self.warm_up()

    async def close(self) -> None:
        for r in self.routers.values():
            stop_process(r.proc, timeout=5, sig=signal.SIGTERM)
        for e in self.engines.values():
            stop_process(e.proc, timeout=5, sig=signal.SIGTERM)
        await self.proxy.stop()
        if self.session is not None:
            await self.session.close()

    async def _engine_up(self, name: str, attempts: int = 3) -> None:
        """Wait for an engine; if it lost one of its ports to another process between the
        probe and its bind (the ports were free when picked), start it again on fresh ones."""
        for attempt in range(attempts):
            e = self.engines[name]
            try:
                await self.wait_http(e.url + "/health", e.proc, log=self._log(f"engine-{name}"))
                return
            except RuntimeError as exc:
                if "already in use" not in str(exc) or attempt == attempts - 1:
                    raise
            e.http, e.events, e.replay = free_port_runs(1, 3)
            self.start_engine(name)

    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    async def wait_http(
        self,
        url: str,
        proc: subprocess.Popen | None,
        timeout: float = 30.0,
        log: Path | None = None,
    ):
        end = time.monotonic() + timeout
        assert self.session is not None
        while time.monotonic() < end:
            raise_if_exited(proc, url, log)
            try:
                async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{url} not ready within {timeout} s")

    # -- observing ----------------------------------------------------------------------------
    async def metrics(self, router: str = "router") -> dict[str, float]:
        """kvplug series, keyed ``name`` or ``name{labels}`` (``kvplug_worker_healthy{a}``)."""
        assert self.session is not None
        async with self.session.get(
            self.routers[router].url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
        ) as r:
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m is None:
                continue
            name, labels, value = m.groups()
            key = name
            if labels:
                vals = re.findall(r'="([^"]*)"', labels)
                key = f"{name}{{{','.join(vals)}}}"
            out[key] = float(value)
        return out

    async def blocks(self, router: str = "router") -> dict[str, float]:
        m = await self.metrics(router)
        return {w: m.get(f"kvplug_worker_kv_blocks{{{w}}}", -1.0) for w in ENGINES}

    async def wait_metric(
        self, pred, router: str = "router", timeout: float = 30.0, since: float | None = None
    ) -> float:
        """Seconds from ``since`` (default: now) until ``pred(metrics)`` holds (polled every
        25 ms); raises on timeout."""
        t0 = time.monotonic() if since is None else since
        while time.monotonic() - t0 < timeout:
            try:
                if pred(await self.metrics(router)):
                    return time.monotonic() - t0
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.025)
        raise TimeoutError(f"condition not met within {timeout} s")

    async def all_healthy(self, timeout: float = 30.0) -> None:
        for r in self.routers:
            await self.wait_metric(
                lambda m: all(m.get(f"kvplug_worker_healthy{{{w}}}") == 1.0 for w in ENGINES),
                r,
                timeout,
            )

    # -- traffic ------------------------------------------------------------------------------
    def prompt(self, prefix: int) -> str:
        self._n += 1
        return f"{PREFIXES[prefix % len(PREFIXES)]} question {self._n}"

    async def complete(
        self, prompt: str, *, max_tokens: int = 4, url: str | None = None
    ) -> tuple[int, str | None, float]:
        """(status, worker, seconds); status 0 when the connection failed."""
        assert self.session is not None
        t0 = time.monotonic()
        try:
            async with self.session.post(
                (url or self.routers["router"].url) + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
            ) as r:
                await r.read()
                return r.status, r.headers.get("x-kvplug-worker"), time.monotonic() - t0
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 0, None, time.monotonic() - t0

    async def warm_up(self) -> None:
        """Requests straight to both engines until both routers have indexed their events (a
        new subscriber may miss the first batch; the next one shows the gap, and it replays)."""
        for _ in range(100):
            for i, e in enumerate(self.engines.values()):
                await self.complete(self.prompt(i), url=e.url)
            ok = True
            for r in self.routers:
                b = await self.blocks(r)
                ok = ok and all(v > 0 for v in b.values())
            if ok:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("the routers indexed no KV events from the engines")

    async def stream(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One streamed completion through the router: worker, events, how it ended."""
        assert self.session is not None
        out: dict[str, Any] = {"worker": None, "events": 0, "done": False, "error": None}
        try:
            async with self.session.post(
                self.routers["router"].url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True},
            ) as r:
                out["worker"] = r.headers.get("x-kvplug-worker")
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        out["done"] = True
                    elif line.startswith(b"data: "):
                        out["events"] += 1
                        if b'"error"' in line:
                            out["error"] = json.loads(line[6:])["error"]["message"][:120]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out


class Traffic:
    """Background requests through the router, one every ``gap`` seconds."""

    def __init__(self, lab: Lab, gap: float, url: str | None = None) -> None:
        self.lab = lab
        self.gap = gap
        self.url = url
        self.results: list[tuple[float, int, str | None]] = []  # (sent at, status, worker)
        self.latencies: list[tuple[float, int, float]] = []  # (sent at, status, seconds)
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()

    def start(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        return self

    async def _one(self, i: int) -> None:
        t = time.monotonic()
        status, worker, took = await self.lab.complete(self.lab.prompt(i), url=self.url)
        self.results.append((t, status, worker))
        self.latencies.append((t, status, took))

    async def _run(self) -> None:
        i = 0
        while True:
            task = asyncio.create_task(self._one(i))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            i += 1
            await asyncio.sleep(self.gap)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._inflight:
            await asyncio.gather(*self._inflight)

    def since(self, t: float) -> list[tuple[float, int, str | None]]:
        return [r for r in self.results if r[0] >= t]


# ------------------------------------------------------------------------------------------
# the faults


async def engine_killed_and_restarted(lab: Lab, quick: bool) -> list[dict[str, Any]]:
    await lab.all_healthy()
    max_tokens = 600 if quick else 2000
    streams = [asyncio.create_task(lab.stream(lab.prompt(i), max_tokens)) for i in range(8)]
    before = await lab.metrics()
    traffic = Traffic(lab, lab_gap(quick)).start()
    await asyncio.sleep(0.6)  # streams under way on both engines
    stale = (await lab.blocks())["a"]
    t_kill = time.monotonic()
    lab.engines["a"].proc.kill()  # type: ignore[union-attr]
    down_s = await lab.wait_metric(lambda m: m.get("kvplug_worker_healthy{a}") == 0.0, since=t_kill)
    t_down = t_kill + down_s
    await asyncio.sleep(1.0 if quick else 3.0)
    results = await asyncio.gather(*streams)
    after_kill = traffic.since(t_kill)
    after = await lab.metrics()
    killed = {
        "fault": "engine_killed",
        "streams": len(results),
        "streams_on_killed_engine": sum(r["worker"] == "a" for r in results),
        "streams_lost": sum(not r["done"] for r in results),
        "streams_lost_on_other_engine": sum(r["worker"] == "b" and not r["done"] for r in results),
        "requests_after_kill": len(after_kill),
        "requests_retried": after.get("kvplug_retries_total{aggregated}", 0.0)
        - before.get("kvplug_retries_total{aggregated}", 0.0),
        "requests_failed": sum(s != 200 for _, s, _ in after_kill),
        "time_to_mark_down_s": round(down_s, 3),
        "routed_to_killed_after_down": sum(w == "a" for t, _, w in traffic.since(t_down)),
        "blocks_of_killed_engine_indexed": stale,
        "blocks_still_indexed_while_down": after.get("kvplug_worker_kv_blocks{a}", 0.0),
    }
    log(f"engine_killed: {killed}")

    # -- restart it: same ports, empty cache ---------------------------------------------------
    t_restart = time.monotonic()
    lab.start_engine("a")
    healthy_s = await lab.wait_metric(
        lambda m: m.get("kvplug_worker_healthy{a}") == 1.0, since=t_restart
    )
    purged_s = await lab.wait_metric(
        lambda m: m.get("kvplug_worker_kv_blocks{a}", stale) < stale / 2, since=t_restart
    )
    served_s = None
    end = time.monotonic() + 20
    while time.monotonic() < end:
        served = [t for t, s, w in traffic.since(t_restart) if w == "a" and s == 200]
        if served:
            served_s = served[0] - t_restart
            break
        await asyncio.sleep(0.05)
    await traffic.stop()
    after_restart = traffic.since(t_restart)
    restarted = {
        "fault": "engine_restarted",
        "time_to_healthy_s": round(healthy_s, 3),
        "time_to_purge_stale_blocks_s": round(purged_s, 3),
        "time_to_first_served_s": None if served_s is None else round(served_s, 3),
        "stale_blocks_before": stale,
        "blocks_after": (await lab.blocks())["a"],
        "requests_after_restart": len(after_restart),
        "requests_failed": sum(s != 200 for _, s, _ in after_restart),
    }
    log(f"engine_restarted: {restarted}")
    return [killed, restarted]


def lab_gap(quick: bool) -> float:
    return 0.1 if quick else 0.05


async def metrics_timeout(lab: Lab, quick: bool) -> dict[str, Any]:
    await lab.all_healthy()
    traffic = Traffic(lab, lab_gap(quick)).start()
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    lab.proxy.hang = True
    try:
        down_s = await lab.wait_metric(
            lambda m: m.get("kvplug_worker_healthy{a}") == 0.0, timeout=30, since=t0
        )
        t_down = t0 + down_s
        await asyncio.sleep(0.5)
    finally:
        lab.proxy.hang = False
    t_back = time.monotonic()
    back_s = await lab.wait_metric(lambda m: m.get("kvplug_worker_healthy{a}") == 1.0, since=t_back)
    await asyncio.sleep(0.3)
    await traffic.stop()
    during = traffic.since(t0)
    row = {
        "fault": "metrics_timeout",
        "requests": len(during),
        "requests_failed": sum(s != 200 for _, s, _ in during),
        "time_to_mark_down_s": round(down_s, 3),
        "routed_to_it_while_down": sum(w == "a" for t, _, w in during if t_down <= t < t_back),
        "time_to_back_after_metrics_answer_s": round(back_s, 3),
    }
    log(f"metrics_timeout: {row}")
    return row


async def engine_hung(lab: Lab, quick: bool) -> dict[str, Any]:
    await lab.all_healthy()
    traffic = Traffic(lab, lab_gap(quick)).start()
    await asyncio.sleep(0.3)
    proc = lab.engines["a"].proc
    assert proc is not None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGSTOP)
    try:
        down_s = await lab.wait_metric(lambda m: m.get("kvplug_worker_healthy{a}") == 0.0, since=t0)
        await asyncio.sleep(1.0 if quick else 3.0)
    finally:
        proc.send_signal(signal.SIGCONT)
    t_cont = time.monotonic()
    back_s = await lab.wait_metric(
        lambda m: m.get("kvplug_worker_healthy{a}") == 1.0, since=t_cont, timeout=60
    )
    await asyncio.sleep(0.3)
    await traffic.stop()
    during = [r for r in traffic.latencies if r[0] >= t0]
    row = {
        "fault": "engine_hung",
        "requests": len(during),
        "requests_failed": sum(s != 200 for _, s, _ in during),
        "slowest_answer_s": round(max((d for _, _, d in during), default=0.0), 3),
        "time_to_mark_down_s": round(down_s, 3),
        "time_to_back_after_sigcont_s": round(back_s, 3),
    }
    log(f"engine_hung: {row}")
    return row


async def router_restarted(lab: Lab, quick: bool) -> dict[str, Any]:
    await lab.all_healthy()
    # events keep flowing while the router is down: requests straight to the engines
    direct = [Traffic(lab, 0.2, e.url).start() for e in lab.engines.values()]
    await asyncio.sleep(0.3)
    router = lab.routers["router"]
    t_kill = time.monotonic()
    router.proc.kill()  # type: ignore[union-attr]
    router.proc.wait()  # type: ignore[union-attr]
    await asyncio.sleep(0.5 if quick else 2.0)  # down: the engines publish meanwhile
    t_start = time.monotonic()
    lab.start_router("router")
    await lab.wait_http(router.url + "/ready", router.proc, timeout=60)
    ready_s = time.monotonic() - t_start
    match_s = None
    last: tuple[dict, dict] = ({}, {})
    end = time.monotonic() + 30
    while time.monotonic() < end:
        mine, ref = await lab.blocks("router"), await lab.blocks("reference")
        last = (mine, ref)
        if mine == ref and all(v > 0 for v in mine.values()):
            match_s = time.monotonic() - t_start
            break
        await asyncio.sleep(0.025)
    for t in direct:
        await t.stop()
    # with the traffic stopped both indexes settle: they must agree exactly
    await asyncio.sleep(0.5)
    settled = (await lab.blocks("router"), await lab.blocks("reference"))
    row = {
        "fault": "router_restarted",
        "down_s": round(t_start - t_kill, 3),
        "time_to_ready_s": round(ready_s, 3),
        "time_to_index_match_s": None if match_s is None else round(match_s, 3),
        "blocks_router": settled[0],
        "blocks_reference": settled[1],
        "index_matches": settled[0] == settled[1],
        "engine_requests_failed": sum(s != 200 for t in direct for _, s, _ in t.results),
    }
    if match_s is None:
        row["last_seen"] = last
    log(f"router_restarted: {row}")
    return row


# ------------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| fault | figure | value |", "| --- | --- | --- |"]
    for row in rows:
        for k, v in row.items():
            if k != "fault":
                lines.append(f"| {row['fault']} | {k} | {v} |")
    return "\n".join(lines)


async def run(quick: bool, speed: float, logs: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvplug-faults-") as tmp:
        if logs:  # keep the processes' logs
            Path(logs).mkdir(parents=True, exist_ok=True)
            tmp = logs
        lab = Lab(Path(tmp), speed=speed)
        log("starting two kvplug sim engines, the router under test and a reference router")
        try:
            await lab.start()
            rows: list[dict[str, Any]] = []
            log("fault 1/4: SIGKILL engine a mid-stream, then restart it")
            rows += await engine_killed_and_restarted(lab, quick)
            log("fault 2/4: engine a's /metrics times out")
            rows.append(await metrics_timeout(lab, quick))
            log("fault 3/4: SIGSTOP engine a (hung), then SIGCONT")
            rows.append(await engine_hung(lab, quick))
            log("fault 4/4: SIGKILL the router and start it again")
            rows.append(await router_restarted(lab, quick))
        except BaseException:
            for f in sorted(Path(tmp).glob("*.log")):
                print(f"--- {f.name} (tail)\n{f.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            await lab.close()
    return {"quick": quick, "speed": speed, "faults": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short streams and pauses (tests)")
    ap.add_argument("--speed", type=float, default=1.0, help="kvplug sim --speed")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fault_engines.json"))
    ap.add_argument("--logs", default=None, help="keep the processes' logs in this directory")
    args = ap.parse_args()
    report = asyncio.run(run(args.quick, args.speed, args.logs))
    print(table(report["faults"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

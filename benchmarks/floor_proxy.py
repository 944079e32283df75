"""The floor under ``kvplug serve``'s CPU per request: the same HTTP stacks, none of the routing.

The server ``kvplug serve`` runs (uvloop, kvplug's HTTP lane for the two routed endpoints with
aiohttp behind it, no access log) with one handler that reads the body, sends it to the engines
in turn over ``kvplug.frontend.engine_http.EnginePool`` (the engine hop ``kvplug serve`` uses)
and answers with the engine's bytes - streamed answers relayed as they arrive. ``--aiohttp``
serves with aiohttp's server alone (``kvplug serve --no-http-lane``). No parsing, tokens,
routing, metrics, traces or timeouts: what ``benchmarks/bench_frontend.py --floor`` measures
here is what the two HTTP hops and the event loop cost in Python, so ``kvplug serve``'s figure
minus this one is what kvplug's own request handling costs.

``--route`` adds the real routing decision and nothing else (the ceiling of a lean path): the
body's token ids read by kvplug's parser (its C reader, ``kvplug._token_json``), one
``Router.route`` (mode ``kv``, block size 16, the engines as workers ``e0``, ``e1``, ...: what
``kvplug serve`` builds from ``--worker e0=URL``) whose pick gets the request, and
``Router.on_finish`` once the answer is relayed. ``bench_frontend.py --ceiling`` measures it.

``--native`` serves with the compiled lane of ``kvplug serve --data-path native``
(``kvplug._lane``) in place of the Python stacks: its ``decide`` picks the engines in turn (or,
with ``--route``, as above) and writes the engine's head, its ``finish`` does nothing (or
``Router.on_finish``); any other request's connection is closed. ``kvplug serve --data-path
native`` minus this is what the glue (``kvplug/frontend/native_glue.py``) costs; this is the
lane's own cost (C, the two callbacks' crossing, the kernel's sockets).

    python benchmarks/floor_proxy.py PORT ENGINE_URL [ENGINE_URL ...] [--aiohttp] [--route]
    python benchmarks/floor_proxy.py PORT ENGINE_URL [ENGINE_URL ...] --native [--route]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

if not os.environ.get("PYTHONPATH"):  # else it names the kvplug to run (ab_frontend.py's trees)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kvplug.config import RouterConfig  # noqa: E402
from kvplug.frontend.engine_http import EnginePool  # noqa: E402
from kvplug.frontend.listener import Listeners  # noqa: E402
from kvplug.frontend.parsing import parse_request  # noqa: E402
from kvplug.request import RouteRequest  # noqa: E402
from kvplug.router import Router  # noqa: E402
from kvplug.workers import Worker  # noqa: E402


def make_router(engines: list[str]) -> Router:
    """The router ``kvplug serve --kv-block-size 16 --worker e0=URL ...`` builds."""
    router = Router(RouterConfig(kv_block_size=16, router_mode="kv"))
    for i, url in enumerate(engines):
        router.add_worker(Worker(f"e{i}", url=url, engine="openai"))
    return router


def route_once(router: Router, body: bytes, path: str, request_id: str) -> str:
    """``--route``'s work before the engine hop: the body's token ids, one routing decision
    (the caller ends it with ``router.on_finish(request_id)``); the chosen worker's id."""
    req = parse_request(body, path)
    tokens = req.prompt_ids if req.prompt_ids is not None else ()
    return router.route(RouteRequest(request_id, tokens, cache_salt=req.cache_salt)).worker_id


async def serve(port: int, engines: list[str], lane: bool = True, route: bool = False) -> None:
    pool = EnginePool(5.0, 600.0)
    turns = itertools.cycle(engines)
    router = make_router(engines) if route else None
    urls = {f"e{i}": url for i, url in enumerate(engines)}
    keys = itertools.count()

    async def forward(request) -> web.StreamResponse:  # aiohttp's request or the lane's
        body = await request.read()
        if router is None:
            return await relay(request, next(turns), body)
        rid = f"r{next(keys)}"
        worker_id = route_once(router, body, request.path, rid)
        try:
            return await relay(request, urls[worker_id], body)
        finally:
            router.on_finish(rid)

    async def relay(request, base: str, body: bytes) -> web.StreamResponse:
        upstream = await pool.post(base + request.path, body, {"Content-Type": "application/json"})
        ctype = upstream.headers.get("content-type", "application/json")
        if not ctype.startswith("text/event-stream"):
            data = await upstream.read()
            upstream.release()
            return web.Response(
                status=upstream.status,
                body=data,
                content_type=None,
                headers={"Content-Type": ctype},
            )
        out = web.StreamResponse(status=upstream.status, headers={"Content-Type": ctype})
        await out.prepare(request)
        while chunk := await upstream.readany():
            await out.write(chunk)
        await out.write_eof()
        upstream.release()
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    handlers = {b"/v1/completions": forward, b"/v1/chat/completions": forward}
    listeners = Listeners(runner, 0)
    await listeners.listen(
        "127.0.0.1", port, lane=handlers if lane else None, max_body_bytes=1 << 24
    )
    await asyncio.Event().wait()


async def serve_native(port: int, engines: list[str], route: bool = False) -> None:
    """The compiled lane alone: decide by turns (or ``route_once``), the engine's head."""
    from kvplug._lane import Lane

    loop = asyncio.get_running_loop()
    router = make_router(engines) if route else None
    index = {f"e{i}": i for i in range(len(engines))}
    turns = itertools.cycle(range(len(engines)))
    keys = itertools.count()
    paths = (b"/v1/completions", b"/v1/chat/completions")  # the lane's kinds 0 and 1
    heads = []
    for url in engines:
        netloc = urlsplit(url).netloc.encode()
        heads.append(
            [
                b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"Content-Length: " % (path, netloc)
                for path in paths
            ]
        )

    def decide(kind, body, request_id, authorization, fields):
        token = None
        if router is None:
            up = next(turns)
        else:
            token = f"r{next(keys)}"
            up = index[route_once(router, body, paths[kind].decode(), token)]
        return up, b"%s%d\r\n\r\n" % (heads[up][kind], len(body)), None, b"", token

    def finish(token, status, outcome, tail):
        if router is not None:
            router.on_finish(token)

    listening = socket.create_server(("127.0.0.1", port), backlog=1024)
    listening.setblocking(False)
    lane = Lane(
        [listening.fileno()],
        decide,
        lambda token: None,
        finish,
        lambda fd, data: os.close(fd),  # not a plain routed request: not the floor's to serve
        max_body=1 << 24,
    )
    for i, url in enumerate(engines):
        parts = urlsplit(url)
        lane.set_upstream(i, parts.hostname, parts.port)
    loop.add_reader(lane.fileno(), lane.poll)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--aiohttp", action="store_true", help="aiohttp's server alone, no lane")
    ap.add_argument(
        "--route", action="store_true", help="add the routing decision (token ids, kv mode)"
    )
    ap.add_argument(
        "--native", action="store_true", help="the compiled lane (--data-path native's)"
    )
    args = ap.parse_args()
    if args.native:
        main_coro = serve_native(args.port, args.engines, args.route)
    else:
        main_coro = serve(args.port, args.engines, not args.aiohttp, args.route)
    try:
        import uvloop

        uvloop.run(main_coro)
    except ImportError:
        asyncio.run(main_coro)


if __name__ == "__main__":
    main()

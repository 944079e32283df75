"""The floor under ``kvplug serve``'s CPU per request: the same HTTP stacks, none of the routing.

The server ``kvplug serve`` runs (uvloop, kvplug's HTTP lane for the two routed endpoints with
aiohttp behind it, no access log) with one handler that reads the body, sends it to the engines
in turn over ``kvplug.frontend.engine_http.EnginePool`` (the engine hop ``kvplug serve`` uses)
and answers with the engine's bytes - streamed answers relayed as they arrive. ``--aiohttp``
serves with aiohttp's server alone (``kvplug serve --no-http-lane``). No parsing, tokens,
routing, metrics, traces or timeouts: what ``benchmarks/bench_frontend.py --floor`` measures
here is what the two HTTP hops and the event loop cost in Python, so ``kvplug serve``'s figure
minus this one is what kvplug's own request handling costs.

    python benchmarks/floor_proxy.py PORT ENGINE_URL [ENGINE_URL ...] [--aiohttp]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kvplug.frontend.engine_http import EnginePool  # noqa: E402
from kvplug.frontend.listener import Listeners  # noqa: E402


async def serve(port: int, engines: list[str], lane: bool = True) -> None:
    pool = EnginePool(5.0, 600.0)
    turns = itertools.cycle(engines)

    async def forward(request) -> web.StreamResponse:  # aiohttp's request or the lane's
        body = await request.read()
        upstream = await pool.post(
            next(turns) + request.path, body, {"Content-Type": "application/json"}
        )
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--aiohttp", action="store_true", help="aiohttp's server alone, no lane")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.port, args.engines, not args.aiohttp))
    except ImportError:
        asyncio.run(serve(args.port, args.engines, not args.aiohttp))


if __name__ == "__main__":
    main()

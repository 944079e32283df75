"""CPU per request of the compiled lane's Python callbacks (kvplug/frontend/native_glue.py).

With ``kvplug serve --data-path native`` the HTTP work is C; what Python still does for a plain
token-id completion is ``decide`` (parse, route, trace record, the engine's head, kvplug's
answer headers) and ``finish`` (the trace's end, load released, ``/metrics``, outlier
detection), plus ``first_byte`` for a stream. This measures those calls directly, on a real
``Frontend`` and ``Router`` (mode ``kv``, block size 16) with two workers, on bench_frontend's
~512-token token-id bodies (8 shared 384-token prefixes), each answer's end handed to ``finish``
as the lane does (the instant engine's answer as the tail).

Both run with kvplug serve's garbage-collector settings (``gc_tuning.tune_for_serving``).
The baseline, in the same rounds (alternating): ``floor_proxy.py --route``'s work per request
(the body's token ids, one ``Router.route``, ``Router.on_finish``): the least any KV-routing
data path can do in Python. The difference is what the glue adds for traces, metrics,
retries and the head; two more runs split it (non-streamed): ``Frontend.route_stage`` alone
(the Python path's routing step: trace record, lifecycle, route metrics) and with the answer's
end as ``finish`` records it. And the body's parse alone (``parse_token_prompt``: the one-pass
reader of the common body) against the ``msgspec`` head decode it replaced
(``parse_token_prompt_decoded``, still the path of the bodies the reader leaves).

    python benchmarks/glue_cost.py                  # ~30 s
    python benchmarks/glue_cost.py --profile        # and where the glue's time goes (cProfile)

Writes ``benchmarks/results/glue_cost.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import resource
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_frontend import MODEL, make_prompts, token_ids  # noqa: E402
from floor_proxy import make_router, route_once  # noqa: E402
from instant_engine import answers  # noqa: E402

from kvplug.config import RouterConfig  # noqa: E402
from kvplug.frontend.app import Frontend, ServeSettings  # noqa: E402
from kvplug.frontend.config import spec_from_mapping  # noqa: E402
from kvplug.frontend.gc_tuning import tune_for_serving  # noqa: E402
from kvplug.frontend.hints import NO_HINTS  # noqa: E402
from kvplug.frontend.native_glue import (  # noqa: E402
    KIND_COMPLETIONS,
    OK,
    NativeGlue,
    answer_tokens,
)
from kvplug.frontend.parsing import (  # noqa: E402
    COMPLETIONS,
    parse_token_prompt,
    parse_token_prompt_decoded,
)
from kvplug.frontend.streaming import whole_answer_read  # noqa: E402
from kvplug.frontend.tokens import SOURCE_REQUEST  # noqa: E402
from kvplug.router import Router  # noqa: E402
from kvplug.workers import Stage  # noqa: E402

ENGINES = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]  # never connected to


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bodies(n: int, stream: bool) -> list[bytes]:
    return [
        json.dumps(
            {"model": MODEL, "prompt": token_ids(p), "stream": stream, "max_tokens": 8}
        ).encode()
        for p in make_prompts(n)
    ]


def answer_tail(stream: bool) -> bytes:
    """The instant engine's answer body (8 tokens, with usage), as the lane's tail has it."""
    wire = answers(8)["completions_stream" if stream else "completions"]
    body = wire.split(b"\r\n\r\n", 1)[1]
    if stream:  # the events without their chunk framing, as the lane relays them
        events = [line for line in body.split(b"\r\n") if line.startswith(b"data:")]
        body = b"".join(e + b"\n\n" for e in events)
    return body[-4096:]


async def make_glue() -> NativeGlue:
    """``kvplug serve --kv-block-size 16 --worker e0=URL --worker e1=URL --data-path native``'s
    control plane, without sockets (health probes off: the engines are not there)."""
    router = Router(RouterConfig(kv_block_size=16, router_mode="kv"))
    frontend = Frontend(router, ServeSettings(health_interval=0))
    specs = [
        spec_from_mapping({"id": f"e{i}", "url": url, "engine": "openai"}, f"worker e{i}")
        for i, url in enumerate(ENGINES)
    ]
    await frontend.fleet.add_many(specs)
    glue = NativeGlue(frontend)
    glue.register_upstream = lambda upstream_id, host, port: None
    return glue


def run_glue(glue: NativeGlue, requests: list[bytes], tail: bytes, stream: bool) -> float:
    """CPU us per request of decide (+ first_byte) + finish."""
    decide, first_byte, finish = glue.decide, glue.first_byte, glue.finish
    c0 = cpu()
    for body in requests:
        token = decide(KIND_COMPLETIONS, body, None, None)[4]  # type: ignore[index,misc]
        if stream:
            first_byte(token)
        finish(token, 200, OK, tail)
    return (cpu() - c0) / len(requests) * 1e6


def run_floor(router: Router, requests: list[bytes]) -> float:
    """CPU us per request of floor_proxy --route's work."""
    c0 = cpu()
    for i, body in enumerate(requests):
        rid = f"r{i}"
        route_once(router, body, COMPLETIONS, rid)
        router.on_finish(rid)
    return (cpu() - c0) / len(requests) * 1e6


def run_stage(glue: NativeGlue, requests: list[bytes], tail: bytes, with_end: bool) -> float:
    """CPU us per request of the Python path's routing step alone (``Frontend.route_stage``:
    the floor plus the trace record, lifecycle and route metrics), and with ``with_end`` the
    answer's end as ``finish`` records it (first token, trace, ``/metrics``, outliers): the
    glue's cost split into the shared steps and its own."""
    fe = glue.frontend
    c0 = cpu()
    for body in requests:
        req = parse_token_prompt(body)
        assert req is not None
        ids = req.prompt_ids
        ctx = fe.request_context(req, None, ids, SOURCE_REQUEST, None, NO_HINTS, None)
        routed = fe.route_stage(ctx, Stage.AGGREGATED, 0, frozenset(), None)
        if with_end:
            fe.request_started()
            whole_answer_read(routed.lifecycle, 200, answer_tokens(tail))
            fe.record_answer(ctx, routed, 200, "ok", None, routed.lifecycle.tokens)
            fe.count_request(COMPLETIONS, 200, False, 0.0)
        routed.lifecycle.finish()
    return (cpu() - c0) / len(requests) * 1e6


def run_parse(parse, requests: list[bytes]) -> float:
    """CPU us per request of one body parser."""
    c0 = cpu()
    for body in requests:
        parse(body)
    return (cpu() - c0) / len(requests) * 1e6


def _summary(values: list[float]) -> dict:
    return {
        "median_us": round(statistics.median(values), 2),
        "min_us": round(min(values), 2),
        "max_us": round(max(values), 2),
        "rounds_us": [round(v, 2) for v in values],
    }


async def main_async(args) -> dict:
    glue = await make_glue()
    floor_router = make_router(ENGINES)
    tune_for_serving()  # the collector's settings kvplug serve runs with (both sides)
    results: dict[str, dict] = {}
    for stream in (False, True):
        requests = bodies(args.requests, stream)
        tail = answer_tail(stream)
        # warm: code paths, the frontend's cached metric children, the index's tables
        run_glue(glue, requests[:200], tail, stream)
        run_floor(floor_router, requests[:200])
        runs = {
            "glue": partial(run_glue, glue, requests, tail, stream),
            "floor_route": partial(run_floor, floor_router, requests),
        }
        if not stream:  # the split, once
            runs["route_stage"] = partial(run_stage, glue, requests, tail, False)
            runs["route_stage_and_end"] = partial(run_stage, glue, requests, tail, True)
            runs["parse"] = partial(run_parse, parse_token_prompt, requests)
            runs["parse_decoded"] = partial(run_parse, parse_token_prompt_decoded, requests)
        measured: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            names = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in names:
                measured[name].append(runs[name]())
        kind = "streamed" if stream else "non-streamed"
        results[kind] = {name: _summary(values) for name, values in measured.items()}
        glue_us, floor_us = measured["glue"], measured["floor_route"]
        results[kind]["glue_minus_floor_us"] = round(
            statistics.median(g - f for g, f in zip(glue_us, floor_us, strict=True)), 2
        )
        assert glue.frontend.router.stats()["active_requests"] == 0  # every request finished
    if args.profile:
        requests = bodies(args.requests, False)
        tail = answer_tail(False)
        prof = cProfile.Profile()
        prof.enable()
        run_glue(glue, requests, tail, False)
        prof.disable()
        print("\nwhere the glue's time goes (non-streamed, cProfile, tottime):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return results


def _cell(r: dict | None) -> str:
    return "" if r is None else f"{r['median_us']} ({r['min_us']}-{r['max_us']})"


def table(results: dict) -> str:
    lines = [
        "| request | glue decide+finish (us) | floor_proxy --route (us) | glue - floor (us) "
        "| route_stage (us) | route_stage + answer's end (us) | parse (us) "
        "| parse, msgspec head (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, r in results.items():
        lines.append(
            f"| {kind} | {_cell(r['glue'])} | {_cell(r['floor_route'])} "
            f"| {r['glue_minus_floor_us']} | {_cell(r.get('route_stage'))} "
            f"| {_cell(r.get('route_stage_and_end'))} | {_cell(r.get('parse'))} "
            f"| {_cell(r.get('parse_decoded'))} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one glue round")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "glue_cost.json"))
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    doc = {
        "what": "CPU us per request of native_glue's callbacks vs floor_proxy --route's work",
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "loadavg": load,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(f"\nloadavg {' '.join(load)}; wrote {args.out}")


if __name__ == "__main__":
    main()

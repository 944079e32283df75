"""SGLang's own routers vs kvplug's launcher on one request stream: KV hit rate and TTFT.

For each router a fresh fleet of simulated engines that speak SGLang's side of the contract
(``/server_info`` with the ``kv_events`` descriptor, KV events in the 0.5.23 msgpack map form
over ZMQ with SGLang's replay framing, ``/v1/loads``, ``/get_load``, ``/tokenize``) runs in this
process; the router runs as its own process, started with the same command line shape:

* ``sglang-router``: ``python -m sglang_router.launch_router --policy cache_aware`` (0.3.2)
* ``smg``: ``python -m smg.launch_router --policy cache_aware`` (1.13)
* ``kvplug``: ``python -m kvplug.integrations.sglang.launch_router --policy kvplug`` (kvplug
  serve's default routing)
* ``kvplug-kv``: the same with ``--router-mode kv`` (Dynamo's cost alone)
* ``kvplug-protect`` (on request): the same with ``--router-affinity affinity-protect``, the
  default routing before the balance guard
* ``kvplug-balance`` (on request): the same with ``--router-affinity affinity-balance``, the
  default routing before issue 14's twenty-fourth pass (the shipped prefill model; runs made
  before it, ``*_fitted.json``, name today's default ``kvplug-fitted`` and this one ``kvplug``)

The request stream is the start of the bundled Mooncake conversation trace (text prompts whose
512-character blocks follow the trace's ``hash_ids``: byte-level tokens on the simulated
engines), sent at the trace's arrival times (``--speedup`` compresses them) as streaming
completions. Reported per router: prompt-token hit rate on the engines (cached / prompt tokens,
the engines' own count), TTFT p50/p90/p99 measured by the client, errors; and each router's
ratios to sglang-router (the baseline). JSON to ``benchmarks/results/sglang_router.json``.

    python benchmarks/bench_sglang_router.py                     # 600 requests, 4 engines
    python benchmarks/bench_sglang_router.py --limit 100 --routers sglang-router kvplug
    python benchmarks/bench_sglang_router.py --rounds 2  # ranges over rounds, order flipped each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.integrations.sglang.wire import encode_batch  # noqa: E402

from kvplug.events import BlockMoved, BlockStored  # noqa: E402
from kvplug.sim.server import FleetOptions, SimServer  # noqa: E402
from kvplug.sim.traces import TRACE_BLOCK_TOKENS, load_trace  # noqa: E402
from kvplug.testing import free_port_run, free_ports  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "sglang_router.json"
WORDS = "the cache router prefix block token engine fast warm hit decode prefill batch".split()


class SglangSimServer(SimServer):
    """A simulated engine with SGLang's HTTP and event faces (0.5.23)."""

    def __init__(self, index: int, opts: FleetOptions) -> None:
        super().__init__(index, opts)
        # SGLang 0.5.23's payload; the PUB/replay framing ([topic, seq, payload], replies
        # with the topic frame) is the same as the vLLM publisher's
        self.publisher.encode = self._encode_sglang  # type: ignore[method-assign]

    @staticmethod
    def _encode_sglang(events, ts=None) -> bytes:
        # stores carry tokens; moves and token-less tier copies have no SGLang form
        keep = [
            e
            for e in events
            if not isinstance(e, BlockMoved)
            and not (isinstance(e, BlockStored) and e.token_ids is None)
        ]
        return encode_batch(keep, "0.5.23", ts=ts or 0.0, attn_dp_rank=0)

    def app(self) -> web.Application:
        app = super().app()
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.h_server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.h_model_info)
        app.router.add_get("/v1/loads", self.h_loads)
        app.router.add_get("/get_load", self.h_get_load)
        app.router.add_get("/health_generate", self.h_health)
        return app

    async def h_server_info(self, request: web.Request) -> web.Response:
        o = self.opts
        return web.json_response(
            {
                "model_path": o.model,
                "served_model_name": o.model,
                "page_size": o.block_size,
                "dp_size": 1,
                "kv_events": {
                    "endpoint_host": o.host,
                    "endpoint_port_base": o.events_base_port + self.index,
                    "replay_endpoint_port_base": o.replay_base_port + self.index,
                    "topic": self.topic,
                    "block_size": o.block_size,
                    "dp_size": 1,
                },
            }
        )

    async def h_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.opts.model, "tokenizer_path": None, "is_generation": True}
        )

    def _load(self) -> dict:
        e = self.engine
        return {
            "dp_rank": 0,
            "num_running_reqs": e.num_running,
            "num_waiting_reqs": e.num_waiting,
            "token_usage": e.kv_usage(),
        }

    async def h_loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [self._load()]})

    async def h_get_load(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response([{"dp_rank": 0, "num_reqs": e.num_running + e.num_waiting}])


def prompt_text(hash_ids, input_length: int) -> str:
    """Text whose i-th 512-character block depends on hash_ids[i] only (byte-level tokens)."""
    blocks = []
    for h in hash_ids[: -(-input_length // TRACE_BLOCK_TOKENS)]:
        rng = np.random.default_rng(h)
        words = rng.choice(WORDS, size=TRACE_BLOCK_TOKENS // 3)
        blocks.append(" ".join(words)[:TRACE_BLOCK_TOKENS].ljust(TRACE_BLOCK_TOKENS, "."))
    return "".join(blocks)[:input_length]


def router_command(name: str, port: int, urls: list[str], block_size: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    if name == "sglang-router":
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            *common,
            "--policy",
            "cache_aware",
        ]
    if name == "smg":
        return [sys.executable, "-m", "smg.launch_router", *common, "--policy", "cache_aware"]
    if name in ("kvplug", "kvplug-kv", "kvplug-protect", "kvplug-balance"):
        # kvplug: its default routing; kvplug-kv: Dynamo's cost alone; kvplug-protect: the
        # default before the balance guard (kvplug serve flags the launcher passes through)
        mode = {
            "kvplug-kv": ["--router-mode", "kv"],
            "kvplug-protect": ["--router-affinity", "affinity-protect"],
            "kvplug-balance": ["--router-affinity", "affinity-balance"],
        }.get(name, [])
        return [
            sys.executable, "-m", "kvplug.integrations.sglang.launch_router", *common,
            "--policy", "kvplug", "--admin-port", str(free_port_run(1)), *mode,
        ]  # fmt: skip
    raise ValueError(name)


async def wait_routable(session, url: str, model: str, proc, deadline: float) -> None:
    body = {"model": model, "prompt": "warm up", "max_tokens": 1}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status == 200:
                    await resp.read()
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("router did not serve a completion in time")


async def one_request(session, url, model, text, max_tokens, t_send, out):
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True}
    ttft = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out["errors"] += 1
                await resp.read()
                return
            async for line in resp.content:
                if line.startswith(b"data:") and ttft is None and b"[DONE]" not in line:
                    ttft = time.monotonic() - t_send
            if ttft is not None:
                out["ttft"].append(ttft)
            else:
                out["errors"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError):
        out["errors"] += 1


async def start_fleet(server_cls, opts: FleetOptions, ports: list[int]) -> list:
    """``opts.engines`` simulated engines on free ports (``ports``: 3 per engine: HTTP, events,
    replay); engine i serves on base + i, so each base is shifted onto its free port."""
    n = opts.engines
    servers = []
    for i in range(n):
        opts_i = FleetOptions(**{**opts.__dict__})
        opts_i.base_port = ports[i] - i
        opts_i.events_base_port = ports[n + i] - i
        opts_i.replay_base_port = ports[2 * n + i] - i
        s = server_cls(i, opts_i)
        await s.start()
        servers.append(s)
    return servers


def reset_engine_counters(servers) -> None:
    """The warm-up request is not part of the measurement."""
    for s in servers:
        s.engine.stats["prompt_tokens"] = s.engine.stats["cached_tokens"] = 0
        s.counters["requests"] = 0


async def replay(session, url: str, model: str, records, texts, args, name: str, out) -> float:
    """Send the records at their (sped-up) arrival times, streamed; returns the wall time."""
    t0 = time.monotonic()
    tasks = []
    for i, (rec, text) in enumerate(zip(records, texts, strict=True)):
        delay = t0 + rec.arrival_s / args.speedup - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        max_tokens = max(1, min(rec.output_length, args.max_output))
        tasks.append(
            asyncio.create_task(
                one_request(session, url, model, text, max_tokens, time.monotonic(), out)
            )
        )
        if (i + 1) % 100 == 0:
            print(f"  {name}: {i + 1}/{len(records)} sent", file=sys.stderr, flush=True)
    await asyncio.gather(*tasks)
    return time.monotonic() - t0


def stop_router(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def affinity_stats(session, url: str) -> dict[str, float]:
    """A kvplug router's affinity counters from its ``/metrics`` (``affinity.*``: the moves, and
    with ``affinity-fitted`` the first tokens it learnt from and its solves), read before it
    stops; {} for other routers or when unreadable."""
    prefix = 'kvplug_router_stat{stat="affinity.'
    try:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    stats = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            stats[key[len(prefix) : key.index('"', len(prefix))]] = float(value)
    return stats


def summary(name: str, records, servers, out, wall: float) -> dict:
    """Hit rate from the engines' own counters, TTFT percentiles from the client."""
    prompt = sum(s.engine.stats["prompt_tokens"] for s in servers)
    cached = sum(s.engine.stats["cached_tokens"] for s in servers)
    ttft = np.asarray(out["ttft"]) if out["ttft"] else np.asarray([np.nan])
    return {
        "router": name,
        "requests": len(records),
        "errors": out["errors"],
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "wall_s": wall,
        "per_engine_requests": [s.counters["requests"] for s in servers],
        **({"affinity": out["affinity"]} if out.get("affinity") else {}),
    }


async def run_router(name: str, args, records, texts, log_dir: Path) -> dict:
    ports = free_ports(3 * args.engines + 1)
    opts = FleetOptions(
        engines=args.engines,
        base_port=0,
        block_size=args.block_size,
        speed=args.speed,
        capacity_blocks=args.capacity_blocks,
    )
    servers = await start_fleet(SglangSimServer, opts, ports)
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    port = ports[-1]
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        router_command(name, port, urls, args.block_size),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log_path, "w"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    out: dict = {"ttft": [], "errors": 0}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await wait_routable(session, url, opts.model, proc, time.monotonic() + 60)
            reset_engine_counters(servers)
            wall = await replay(session, url, opts.model, records, texts, args, name, out)
            if name.startswith("kvplug"):
                out["affinity"] = await affinity_stats(session, url)
    finally:
        stop_router(proc)
        for s in servers:
            await s.stop()
    return summary(name, records, servers, out, wall)


def available(name: str) -> bool:
    module = {"sglang-router": "sglang_router", "smg": "smg"}.get(name, "kvplug")
    import importlib.util

    return importlib.util.find_spec(module) is not None


def table(rows: list[dict], base: dict | None) -> str:
    head = (
        f"{'router':<14} {'hit rate':>9} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'p90 vs base':>11} {'p99 vs base':>11} {'errors':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p90 = r["ttft_p90_s"] / base["ttft_p90_s"] if base else float("nan")
        p99 = r["ttft_p99_s"] / base["ttft_p99_s"] if base else float("nan")
        lines.append(
            f"{r['router']:<14} {r['hit_rate']:>8.1%} {r['ttft_p50_s']:>8.3f}s "
            f"{r['ttft_p90_s']:>7.3f}s {r['ttft_p99_s']:>7.3f}s {p90:>10.2f}x {p99:>10.2f}x "
            f"{r['errors']:>6}"
        )
    return "\n".join(lines)


def ranges(by_round: list[list[dict]], routers: list[str], base_name: str) -> list[dict]:
    """Per router, the range over rounds of its hit rate and TTFT p99, and of its p99 against
    the baseline's in the same round."""
    out = []
    for name in routers:
        mine = [next((r for r in rs if r["router"] == name), None) for rs in by_round]
        bases = [next((r for r in rs if r["router"] == base_name), None) for rs in by_round]
        hit = [r["hit_rate"] for r in mine if r]
        p99 = [r["ttft_p99_s"] for r in mine if r]
        vs = [
            r["ttft_p99_s"] / b["ttft_p99_s"] for r, b in zip(mine, bases, strict=True) if r and b
        ]
        out.append(
            {
                "router": name,
                "rounds": len(hit),
                "hit_rate": [min(hit), max(hit)] if hit else None,
                "ttft_p99_s": [min(p99), max(p99)] if p99 else None,
                "ttft_p99_vs_base": [min(vs), max(vs)] if vs else None,
            }
        )
    return out


def range_table(summary: list[dict]) -> str:
    head = f"{'router':<15} {'hit rate':>15} {'TTFT p99':>17} {'p99 vs base':>13}"
    head += "  (ranges over rounds)"
    lines = [head, "-" * len(head)]
    for s in summary:
        if not s["hit_rate"]:
            continue
        hit = f"{s['hit_rate'][0]:.1%}-{s['hit_rate'][1]:.1%}"
        p99 = f"{s['ttft_p99_s'][0]:.3f}-{s['ttft_p99_s'][1]:.3f}s"
        vs = s["ttft_p99_vs_base"]
        vs_text = f"{vs[0]:.2f}-{vs[1]:.2f}x" if vs else "-"
        lines.append(f"{s['router']:<15} {hit:>15} {p99:>17} {vs_text:>13}")
    return "\n".join(lines)


def run_rounds(routers: list[str], rounds: int, run_one, what: str) -> list[dict]:
    """Every router once per round, ``run_one(name)`` each; the order flips every round, so
    neither side always runs on a machine warmed (or loaded) by the other."""
    rows = []
    for k in range(rounds):
        for name in routers if k % 2 == 0 else routers[::-1]:
            print(f"round {k + 1}/{rounds}, {name}: {what} ...", file=sys.stderr)
            rows.append({**run_one(name), "round": k + 1})
    return rows


def report_rounds(rows: list[dict], routers: list[str], rounds: int, base_name: str, table):
    """Print each round's table (ratios to ``base_name`` in that round) and, over several
    rounds, the ranges; returns the ranges."""
    by_round = [[r for r in rows if r["round"] == k + 1] for k in range(rounds)]
    for k, round_rows in enumerate(by_round):
        base = next((r for r in round_rows if r["router"] == base_name), None)
        if rounds > 1:
            print(f"round {k + 1}")
        print(table(sorted(round_rows, key=lambda r: routers.index(r["router"])), base))
    summary = ranges(by_round, routers, base_name)
    if rounds > 1:
        print(range_table(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--routers",
        nargs="+",
        choices=["sglang-router", "smg", "kvplug", "kvplug-kv", "kvplug-protect", "kvplug-balance"],
        default=["sglang-router", "smg", "kvplug", "kvplug-kv"],
    )
    p.add_argument("--limit", type=int, default=600, help="trace requests (default 600)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16, help="engine page size")
    p.add_argument("--capacity-blocks", type=int, default=None)
    p.add_argument("--speed", type=float, default=1.0, help="engine model speed (wall)")
    p.add_argument("--speedup", type=float, default=1.0, help="trace arrival compression")
    p.add_argument("--max-output", type=int, default=64, help="cap on output tokens")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--rounds", type=int, default=1, help="every router once per round, the order flipped"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: >= 1")
    # sglang-router probes workers with HTTP/2 prior knowledge (gRPC detection): the simulated
    # engines answer 400 and aiohttp logs each one
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    routers = [r for r in args.routers if available(r)]
    for r in set(args.routers) - set(routers):
        print(f"skipping {r}: not installed (pip install 'kvplug[test]')", file=sys.stderr)
    records = load_trace(limit=args.limit)
    texts = [prompt_text(r.hash_ids, r.input_length) for r in records]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kvplug-bench-sglang-router"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    rows = run_rounds(
        routers,
        args.rounds,
        lambda name: asyncio.run(run_router(name, args, records, texts, log_dir)),
        f"{len(records)} requests on {args.engines} engines",
    )
    summary_rows = report_rounds(rows, routers, args.rounds, "sglang-router", table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                },
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                "baseline": "sglang-router" if "sglang-router" in routers else None,
                "results": rows,
                "ranges": summary_rows,
                "router_logs": str(log_dir),
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Router replicas with and without NATS load sync, side by side on identical work.

Three kvplug routers (replicas) front the same 8 workers; requests arrive on the replicas in
turn (Poisson, random prompt lengths, no shared prefixes, so placement is pure load balancing);
each finishes after a service time proportional to its tokens. A god's-eye ledger keeps each
worker's true in-flight prefill tokens over all replicas. Per decision it records the chosen
worker's true load minus the least-loaded worker's ("excess": 0 means the pick was right
for the whole fleet). A single router seeing everything is the reference. Real nats-server on
loopback; the same seeded arrivals for every configuration; rounds rotate the order.

    python benchmarks/bench_replicas.py [--rounds 3] [--requests 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvplug.config import RouterConfig
from kvplug.replica_sync import LoadSync
from kvplug.request import RouteRequest
from kvplug.router import Router
from kvplug.testing import free_port
from kvplug.workers import Worker

OUT = Path(__file__).parent / "results" / "bench_replicas.json"
WORKERS = 8


def workload(n: int, seed: int) -> list[tuple[float, list[int], float]]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(400.0)  # 400 req/s offered
        tokens = [rng.randrange(1, 50_000) for _ in range(rng.choice((128, 512, 2048, 4096)))]
        out.append((t, tokens, 0.02 + len(tokens) * 2e-5))  # service: 20 ms + 20 µs/token
    return out


async def run(config: str, work, nats_url: str | None) -> dict:
    replicas = 1 if config == "one router" else 3
    routers = []
    for i in range(replicas):
        r = Router(RouterConfig(kv_block_size=16, router_mode="kv"), rng=random.Random(i))
        for w in range(WORKERS):
            r.add_worker(Worker(f"w{w}"))
        routers.append(r)
    syncs = []
    if config == "3 replicas, NATS sync":
        for i, r in enumerate(routers):
            s = LoadSync(r, nats_url, namespace=f"bench{time.monotonic_ns()}", replica_id=f"r{i}")
            syncs.append(s)
        for s in syncs:  # same namespace for the three
            s.subject = syncs[0].subject
            await s.start()
    ledger = {f"w{w}": 0 for w in range(WORKERS)}
    excess: list[int] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    pending = set()

    async def finish(router, rid, worker, tokens, service):
        await asyncio.sleep(service)
        router.on_first_token(rid)
        ledger[worker] -= tokens
        router.on_finish(rid)

    for n, (at, tokens, service) in enumerate(work):
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        router = routers[n % replicas]
        d = router.route(RouteRequest(f"q{n}", tokens))
        excess.append(ledger[d.worker_id] - min(ledger.values()))
        ledger[d.worker_id] += len(tokens)
        pending.add(asyncio.create_task(finish(router, f"q{n}", d.worker_id, len(tokens), service)))
    await asyncio.gather(*pending)
    for s in syncs:
        await s.close()
    excess.sort()
    return {
        "config": config,
        "decisions": len(excess),
        "right_pick_pct": 100.0 * sum(e == 0 for e in excess) / len(excess),
        "excess_mean_tokens": statistics.fmean(excess),
        "excess_p99_tokens": excess[int(0.99 * (len(excess) - 1))],
    }


async def main_async(args) -> dict:
    binary = shutil.which("nats-server")
    if binary is None:
        sys.exit("nats-server is not installed (Debian: apt-get install nats-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
    await asyncio.sleep(0.5)
    configs = ["one router", "3 replicas, no sync", "3 replicas, NATS sync"]
    rows: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        for rnd in range(args.rounds):
            work = workload(args.requests, seed=rnd)
            order = configs[rnd % 3 :] + configs[: rnd % 3]  # rotate who goes first
            for config in order:
                res = await run(config, work, f"nats://127.0.0.1:{port}")
                rows[config].append(res)
                print(
                    f"round {rnd + 1}/{args.rounds} {config:24s} right pick "
                    f"{res['right_pick_pct']:5.1f} %  excess mean {res['excess_mean_tokens']:7.0f} "
                    f"p99 {res['excess_p99_tokens']:6d} tokens",
                    flush=True,
                )
    finally:
        proc.terminate()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    print("\n| configuration | right pick % | excess mean tokens | excess p99 tokens |")
    print("|---|---:|---:|---:|")

    def rng_(key, fmt):
        vals = [r[key] for r in rows[c]]
        return f"{fmt(min(vals))}–{fmt(max(vals))}"

    for c in rows:
        print(
            f"| {c} | {rng_('right_pick_pct', lambda v: f'{v:.1f}')} | "
            f"{rng_('excess_mean_tokens', lambda v: f'{v:.0f}')} | "
            f"{rng_('excess_p99_tokens', lambda v: f'{v:.0f}')} |"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""Replay cost against fleet size: requests replayed per CPU-second from 8 to 1,024 engines.

The load per engine is held constant: a generated multi-turn workload whose session rate grows
with the fleet (1.5 sessions/s per 8 engines), cut at the same number of requests per engine.
Each size is replayed under ``kv`` twice, event-driven (only the engines with a step starting
before an arrival are touched) and with the old scan (every engine stepped and collected at
every arrival); both must give the same hit rate and mean TTFT (to 0.5 %: decode runs are
fast-forwarded in different chunks, so times differ in the last bits). Reported: CPU seconds
(process time) per 1,000 requests, requests per CPU-second, the router's share (time inside
``router.route()``) and the speed-up.

    python benchmarks/bench_replay_scale.py                     # 8 ... 1024 engines
    python benchmarks/bench_replay_scale.py --sizes 8 64 --per-engine 50
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.sim.engine import EngineConfig  # noqa: E402
from kvplug.sim.policies import parse_policy  # noqa: E402
from kvplug.sim.traces import parse_workload  # noqa: E402
from kvplug.sim.virtual import ReplayConfig, replay, summarize  # noqa: E402


def workload(n_engines: int, per_engine: int):
    rate = 1.5 * n_engines / 8
    total = per_engine * n_engines
    # sessions average ~8 turns: enough session arrivals for `total` requests, with margin
    duration = max(60.0, 2.0 * total / (rate * 8))
    recs = parse_workload(f"multi-turn:session_rate={rate},duration={duration}")
    return recs[:total]


def run(records, n_engines: int, event_driven: bool, policy: str = "kv") -> dict:
    pol = parse_policy(policy)
    cfg = ReplayConfig(
        n_engines=n_engines,
        engine=EngineConfig(),
        feed_events=pol.feed_events,
        event_driven=event_driven,
    )
    c0, w0 = time.process_time(), time.perf_counter()
    res = replay(records, pol.router_config(512), cfg, router_factory=pol.router_factory())
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    s = summarize(res)
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "route_s": res.route_seconds,
        "requests": len(records),
        "hit_rate": s["hit_rate"],
        "ttft_p99_s": s["ttft_p99_s"],
        "ttft_mean_s": s["ttft_mean_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[8, 32, 128, 512, 1024])
    ap.add_argument("--per-engine", type=int, default=100, help="requests per engine")
    ap.add_argument("--json", default="benchmarks/results/replay_scale.json")
    args = ap.parse_args(argv)
    rows = []
    print(
        f"{'engines':>7} {'requests':>8} {'scan cpu/1k':>11} {'event cpu/1k':>12} "
        f"{'event req/cpu-s':>15} {'router share':>12} {'speed-up':>8}",
        flush=True,
    )
    warm = workload(8, 20)
    run(warm, 8, True)  # imports, the core's first calls: not part of any size's figure
    run(warm, 8, False)
    for i, n in enumerate(args.sizes):
        recs = workload(n, args.per_engine)
        if i % 2:  # alternate which goes first
            scan = run(recs, n, False)
            event = run(recs, n, True)
        else:
            event = run(recs, n, True)
            scan = run(recs, n, False)
        # the lazy decode runs are fast-forwarded in other chunks than the scan's: the same
        # replay up to floating-point rounding (a rare tie between two times may flip)
        same = (
            abs(event["hit_rate"] - scan["hit_rate"]) < 0.005
            and abs(event["ttft_mean_s"] - scan["ttft_mean_s"]) <= 0.005 * scan["ttft_mean_s"]
        )
        if not same:
            raise SystemExit(f"{n} engines: event-driven and scan replays differ: {event} {scan}")
        row = {
            "engines": n,
            "requests": len(recs),
            "event_driven": event,
            "scan": scan,
            "event_req_per_cpu_s": len(recs) / event["cpu_s"],
            "scan_req_per_cpu_s": len(recs) / scan["cpu_s"],
            "speedup": scan["cpu_s"] / event["cpu_s"],
            "router_share": event["route_s"] / event["wall_s"] if event["wall_s"] else 0.0,
        }
        rows.append(row)
        print(
            f"{n:>7} {len(recs):>8} {1000 * scan['cpu_s'] / len(recs):>10.2f}s "
            f"{1000 * event['cpu_s'] / len(recs):>11.2f}s {row['event_req_per_cpu_s']:>15.0f} "
            f"{row['router_share']:>11.0%} {row['speedup']:>7.2f}x",
            flush=True,
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows, "per_engine": args.per_engine}, indent=1) + "\n")
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay cost against fleet size: requests replayed per CPU-second from 8 to 1,024 engines.

The load per engine is held constant: a generated multi-turn workload whose session rate grows
with the fleet (1.5 sessions/s per 8 engines), cut at the same number of requests per engine.
Each size is replayed under ``kv`` twice, event-driven (only the engines with a step starting
before an arrival are touched) and with the old scan (every engine stepped and collected at
every arrival); both must give the same hit rate and mean TTFT (to 0.5 %: decode runs are
fast-forwarded in different chunks, so times differ in the last bits). Reported: CPU seconds
(process time) per 1,000 requests, requests per CPU-second, the router's share (time inside
``router.route()``) and the speed-up.

Each size is replayed ``--rounds`` times, scan and event-driven taking turns to go first, and
every figure is reported as a range over the rounds. ``--million N`` then replays ``N`` requests
(default off; the README's figure is 1,000,000) on 1,024 engines event-driven only, with
progress, to show what a fleet that size costs end to end on one core.

    python benchmarks/bench_replay_scale.py                     # 8 ... 1024 engines, 3 rounds
    python benchmarks/bench_replay_scale.py --million 1000000   # and a million requests
    python benchmarks/bench_replay_scale.py --sizes 8 64 --per-engine 50 --rounds 1
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


def run(records, n_engines: int, event_driven: bool, policy: str = "kv", progress=None) -> dict:
    pol = parse_policy(policy)
    cfg = ReplayConfig(
        n_engines=n_engines,
        engine=EngineConfig(),
        feed_events=pol.feed_events,
        event_driven=event_driven,
    )
    c0, w0 = time.process_time(), time.perf_counter()
    res = replay(
        records,
        pol.router_config(512),
        cfg,
        router_factory=pol.router_factory(),
        progress=progress,
    )
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


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(values), max(values)
    return (
        fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"
    )


def same_replay(event: dict, scan: dict) -> bool:
    # the lazy decode runs are fast-forwarded in other chunks than the scan's: the same
    # replay up to floating-point rounding (a rare tie between two times may flip)
    return (
        abs(event["hit_rate"] - scan["hit_rate"]) < 0.005
        and abs(event["ttft_mean_s"] - scan["ttft_mean_s"]) <= 0.005 * scan["ttft_mean_s"]
    )


def plot(doc: dict, path: Path) -> Path:
    """ms of CPU per request against fleet size, both replays, the bars spanning the rounds."""
    from kvplug.sim.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    sizes = [r["engines"] for r in doc["rows"]]
    for key, label in (
        ("scan", "scan every engine per arrival (before)"),
        ("event_driven", "event-driven"),
    ):
        per_req = [
            [1000 * x[key]["cpu_s"] / r["requests"] for x in r["rounds"]] for r in doc["rows"]
        ]
        mid = [sorted(v)[len(v) // 2] for v in per_req]
        err = [
            [m - min(v) for m, v in zip(mid, per_req, strict=True)],
            [max(v) - m for m, v in zip(mid, per_req, strict=True)],
        ]
        ax.errorbar(sizes, mid, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("engines (30 requests per engine, constant load per engine)")
    ax.set_ylabel("ms of CPU per replayed request")
    ax.set_title("Replay cost against fleet size (median, bars: range over rounds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def million_run(n_requests: int, n_engines: int = 1024) -> dict:
    """One event-driven replay of ``n_requests`` on ``n_engines``, progress every 5 %."""
    t0 = time.perf_counter()
    recs = workload(n_engines, -(-n_requests // n_engines))[:n_requests]
    gen_s = time.perf_counter() - t0
    print(
        f"\n{len(recs):,} requests on {n_engines:,} engines, event-driven "
        f"(workload generated in {gen_s:.0f} s) ...",
        flush=True,
    )
    step = max(1, len(recs) // 20)
    done = [0]
    c0 = time.process_time()

    def progress(n: int) -> None:
        done[0] += n
        if done[0] % step == 0:
            cpu = time.process_time() - c0
            print(f"  {done[0]:>9,} requests, {cpu:6.0f} s CPU", flush=True)

    got = run(recs, n_engines, True, progress=progress)
    got["engines"] = n_engines
    got["req_per_cpu_s"] = len(recs) / got["cpu_s"]
    print(
        f"{len(recs):,} requests on {n_engines:,} engines: {got['cpu_s'] / 60:.1f} CPU-minutes, "
        f"{got['wall_s'] / 60:.1f} minutes wall, {got['req_per_cpu_s']:,.0f} requests per "
        f"CPU-second, hit rate {got['hit_rate']:.1%}",
        flush=True,
    )
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[8, 32, 128, 512, 1024])
    ap.add_argument("--per-engine", type=int, default=100, help="requests per engine")
    ap.add_argument("--json", default="benchmarks/results/replay_scale.json")
    ap.add_argument("--rounds", type=int, default=3, help="replays of each size, per mode")
    ap.add_argument(
        "--million",
        type=int,
        default=0,
        metavar="N",
        help="then replay N requests on 1,024 engines, event-driven only (0: skip)",
    )
    ap.add_argument("--plot", default="docs/img/replay_scale.png", help="PNG ('' for none)")
    ap.add_argument(
        "--plot-only", action="store_true", help="redraw --plot from --json, replay nothing"
    )
    args = ap.parse_args(argv)
    if args.plot_only:
        print(f"plot: {plot(json.loads(Path(args.json).read_text()), Path(args.plot))}")
        return 0
    rows = []
    print(
        f"{'engines':>7} {'requests':>8} {'scan ms CPU/req':>15} {'event ms CPU/req':>16} "
        f"{'event req/CPU-s':>15} {'router share':>12} {'speed-up':>11}",
        flush=True,
    )
    warm = workload(8, 20)
    run(warm, 8, True)  # imports, the core's first calls: not part of any size's figure
    run(warm, 8, False)
    turn = 0
    for n in args.sizes:
        recs = workload(n, args.per_engine)
        events, scans = [], []
        for _ in range(args.rounds):
            if turn % 2:  # alternate which goes first
                scan = run(recs, n, False)
                event = run(recs, n, True)
            else:
                event = run(recs, n, True)
                scan = run(recs, n, False)
            turn += 1
            if not same_replay(event, scan):
                raise SystemExit(
                    f"{n} engines: event-driven and scan replays differ: {event} {scan}"
                )
            events.append(event)
            scans.append(scan)
        k = len(recs)
        row = {
            "engines": n,
            "requests": k,
            "rounds": [{"event_driven": e, "scan": c} for e, c in zip(events, scans, strict=True)],
            "event_req_per_cpu_s": [k / e["cpu_s"] for e in events],
            "scan_req_per_cpu_s": [k / c["cpu_s"] for c in scans],
            "speedup": [c["cpu_s"] / e["cpu_s"] for e, c in zip(events, scans, strict=True)],
            "router_share": [e["route_s"] / e["wall_s"] if e["wall_s"] else 0.0 for e in events],
        }
        rows.append(row)
        print(
            f"{n:>7} {k:>8} {span([1000 * c['cpu_s'] / k for c in scans]):>15} "
            f"{span([1000 * e['cpu_s'] / k for e in events]):>16} "
            f"{span(row['event_req_per_cpu_s'], '{:,.0f}'):>15} "
            f"{span([100 * x for x in row['router_share']], '{:.0f}') + '%':>12} "
            f"{span(row['speedup']) + 'x':>11}",
            flush=True,
        )
    million = million_run(args.million) if args.million else None
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "python benchmarks/bench_replay_scale.py " + " ".join(argv or sys.argv[1:]),
            "per_engine": args.per_engine,
            "rounds": args.rounds,
            "rows": rows,
            "million": million,
        }
        out.write_text(json.dumps(doc, indent=1) + "\n")
        if args.plot:
            print(f"plot: {plot(doc, Path(args.plot))}")
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

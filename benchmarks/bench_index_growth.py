"""Event application while the index fills: the router's index pre-sized for the fleet's KV
capacity (``Router._presize_index``, what ``kvplug serve`` does once the engines report
``num_gpu_blocks`` or the worker config gives ``kv_capacity_blocks``) against the same index
growing from empty (capacity unknown: the behaviour before, the baseline), alternating round by
round on identical work.

Workload (seeded, the same for both): ``--workers`` engines of ``--capacity`` blocks each; store
events of 32 new blocks (distinct random chains, Python lists, as a decoder hands them over),
four per ``Router.apply_events`` call (one subscriber batch, i.e. one turn of the event loop),
until the engines' caches are full. Each call is timed on its own: while a table grows, the call
that crosses its load limit rehashes the whole table, and the event loop, which also routes,
stops for that long.

    python benchmarks/bench_index_growth.py                 # 64 engines x 125 k blocks, 3 rounds
    python benchmarks/bench_index_growth.py --capacity 20000 --rounds 2   # quick
    python benchmarks/bench_index_growth.py --approx --capacity 16384 \
        --out benchmarks/results/bench_index_growth_approx.json --plot ''

``--approx``: approximate mode (no KV events), where the router records every routed prompt in
a side index on the same event loop (``kvplug.approx``); each call routes one prompt of 128 new
blocks (2,048 tokens, hashing included) and finishes it, until the side index holds the fleet's
capacity (its block cap, ``--router-max-tree-size``, set to that). The side index is pre-sized
the same way (``ApproxIndex.presize``) since issue 14's fourteenth pass.

Prints a table (median and range over rounds per figure), writes
``benchmarks/results/bench_index_growth.json`` and plots the first round's call latencies
against the blocks indexed (``--plot``, default ``docs/img/index_growth.png``; '' for none).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures import save_figure  # noqa: E402
from hostinfo import cpu_model  # noqa: E402

from kvplug.config import RouterConfig  # noqa: E402
from kvplug.events import BlockStored  # noqa: E402
from kvplug.request import RouteRequest  # noqa: E402
from kvplug.router import Router  # noqa: E402
from kvplug.workers import Worker  # noqa: E402

BLOCKS_PER_EVENT = 32
EVENTS_PER_BATCH = 4
STALL_MS = 1.0  # a call this long is counted as a stall of the event loop


def fill(
    workers: int, capacity: int, presized: bool, seed: int, approx: bool = False
) -> tuple[dict, list[float]]:
    """One fill of the fleet's caches: its figures, and every call's latency in ms."""
    total = workers * capacity
    if approx:
        cfg = RouterConfig(kv_block_size=16, router_kv_events=False, router_max_tree_size=total)
    else:
        cfg = RouterConfig(kv_block_size=16)
    r = Router(cfg)
    for i in range(workers):
        r.add_worker(Worker(f"w{i}", kv_capacity_blocks=capacity if presized else 0))
    rng = np.random.default_rng(seed)
    if approx:
        return fill_by_routing(r, total, presized, rng)
    per_batch = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    lat_ms: list[float] = []
    cpu = 0.0
    stored = 0
    engine_hash = 0
    gc.collect()
    gc.disable()
    try:
        while stored < total:
            n = min(per_batch, total - stored)
            hashes = rng.integers(1, 2**63, size=n, dtype=np.int64).tolist()
            batch = []
            for k in range(0, n, BLOCKS_PER_EVENT):
                m = min(BLOCKS_PER_EVENT, n - k)
                batch.append(
                    BlockStored(
                        worker_id=f"w{(stored + k) // BLOCKS_PER_EVENT % workers}",
                        engine_hashes=list(range(engine_hash, engine_hash + m)),
                        block_hashes=hashes[k : k + m],
                    )
                )
                engine_hash += m
            c0, t0 = time.process_time(), time.perf_counter()
            r.apply_events(batch)
            t1, c1 = time.perf_counter(), time.process_time()
            lat_ms.append((t1 - t0) * 1e3)
            cpu += c1 - c0
            stored += n
    finally:
        gc.enable()
    st = r.index.core.stats()
    assert st["blocks"] == total, st  # every block indexed, on both sides
    return figures(presized, total, lat_ms, cpu, r.index.core.memory_bytes()), lat_ms


def figures(presized: bool, total: int, lat_ms: list[float], cpu: float, memory: int) -> dict:
    """One fill's figures from its calls' latencies (ms) and CPU time (s)."""
    lat = sorted(lat_ms)
    stalls = [x for x in lat_ms if x >= STALL_MS]
    return {
        "presized": presized,
        "blocks": total,
        "calls": len(lat_ms),
        "cpu_ns_per_block": cpu / total * 1e9,
        "call_p50_us": lat[len(lat) // 2] * 1e3,
        "call_p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e3,
        "call_max_ms": lat[-1],
        "stalls": len(stalls),
        "stall_ms_total": sum(stalls),
        "stalls_ms": [round(x, 2) for x in stalls],
        "memory_mib": memory / 2**20,
    }


def fill_by_routing(
    r: Router, total: int, presized: bool, rng: np.random.Generator
) -> tuple[dict, list[float]]:
    """fill() in approximate mode: route (and finish) one 128-block prompt per call."""
    per_call = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    side = r._approx
    assert side is not None
    lat_ms: list[float] = []
    cpu = 0.0
    routed = 0
    gc.collect()
    gc.disable()
    try:
        while routed < total:
            n = min(per_call, total - routed)
            tokens = rng.integers(0, 128_000, size=n * 16, dtype=np.int64).tolist()
            req = RouteRequest(f"r{len(lat_ms)}", tokens)
            c0, t0 = time.process_time(), time.perf_counter()
            r.route(req)
            t1, c1 = time.perf_counter(), time.process_time()
            r.on_finish(req.request_id)
            lat_ms.append((t1 - t0) * 1e3)
            cpu += c1 - c0
            routed += n
    finally:
        gc.enable()
    assert side.stats()["blocks"] == total and side.counters["capped"] == 0, side.stats()
    return figures(presized, total, lat_ms, cpu, side.index.core.memory_bytes()), lat_ms


def span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict, f: str = "{:.1f}") -> str:
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"


FIGURES = (
    ("CPU per block, ns", "cpu_ns_per_block", "{:.0f}"),
    ("call p50, us", "call_p50_us", "{:.1f}"),
    ("call p99, us", "call_p99_us", "{:.1f}"),
    ("longest call, ms", "call_max_ms", "{:.2f}"),
    ("calls over 1 ms", "stalls", "{:.0f}"),
    ("time in calls over 1 ms, ms", "stall_ms_total", "{:.0f}"),
    ("index memory, MiB", "memory_mib", "{:.0f}"),
)


def plot(latencies: dict[str, list[float]], per_call: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for (label, lat), colour in zip(latencies.items(), ("tab:red", "tab:blue"), strict=True):
        blocks = np.arange(1, len(lat) + 1) * per_call / 1e6
        ax.scatter(blocks, lat, s=3, color=colour, label=label, rasterized=True)
    ax.set_yscale("log")
    ax.axhline(STALL_MS, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("blocks indexed (millions)")
    ax.set_ylabel("one apply_events call (ms)")
    ax.set_title("Applying KV events while the index fills: each call's latency")
    ax.legend(markerscale=4)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=125_000, help="blocks per engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--approx",
        action="store_true",
        help="approximate mode: fill the side index by routing prompts (no events)",
    )
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "bench_index_growth.json")
    )
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "index_growth.png"))
    args = ap.parse_args(argv)
    total = args.workers * args.capacity
    print(
        f"bench_index_growth: {args.workers} engines x {args.capacity:,} blocks = {total:,}"
        f" blocks, {args.rounds} rounds, on {cpu_model()}",
        flush=True,
    )
    rounds: list[dict] = []
    first: dict[str, list[float]] = {}
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        rd = {}
        for presized in order:
            got, lat = fill(args.workers, args.capacity, presized, seed=i, approx=args.approx)
            rd["presized" if presized else "growing"] = got
            if i == 0:
                first["pre-sized (now)" if presized else "growing (before)"] = lat
            print(
                f"round {i + 1}/{args.rounds} {'pre-sized' if presized else 'growing':9}:"
                f" {got['cpu_ns_per_block']:.0f} ns CPU/block, longest call"
                f" {got['call_max_ms']:.2f} ms, {got['stalls']} calls over {STALL_MS:g} ms"
                f" ({got['stall_ms_total']:.0f} ms), load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        rounds.append(rd)
    summary = {
        side: {key: span([rd[side][key] for rd in rounds]) for _, key, _ in FIGURES}
        for side in ("growing", "presized")
    }
    summary["cpu_growing_over_presized"] = span(
        [rd["growing"]["cpu_ns_per_block"] / rd["presized"]["cpu_ns_per_block"] for rd in rounds]
    )
    print(f"\n{'figure':30} {'growing (before)':>26} {'pre-sized (now)':>26}")
    for label, key, f in FIGURES:
        print(
            f"{label:30} {fmt(summary['growing'][key], f):>26}"
            f" {fmt(summary['presized'][key], f):>26}"
        )
    ratio = summary["cpu_growing_over_presized"]
    print(f"{'CPU per block, growing / pre-sized':30} {fmt(ratio, '{:.2f}'):>26}")
    out = {
        "command": " ".join(
            ["python benchmarks/bench_index_growth.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "cpu_model": cpu_model(),
        "workers": args.workers,
        "capacity_per_worker": args.capacity,
        "blocks": total,
        "approx": args.approx,
        "blocks_per_event": BLOCKS_PER_EVENT,
        "events_per_call": EVENTS_PER_BATCH,
        "rounds": rounds,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    if args.plot:
        ordered = {k: first[k] for k in ("growing (before)", "pre-sized (now)")}
        plot(ordered, BLOCKS_PER_EVENT * EVENTS_PER_BATCH, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

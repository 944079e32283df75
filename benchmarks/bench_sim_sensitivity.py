"""Sensitivity of the headline to each simulator assumption, one at a time.

Each row changes one assumption from the defaults (``--steptime causal``, ``--realism ideal``,
1,640 blocks per engine, 8,192-token chunks) and replays the conversation trace (or
``--workload``) under kv, affinity and round-robin on 8 engines. Printed: hit rate and TTFT p99 per
policy and the kv / round-robin TTFT p99 ratio. JSON: ``benchmarks/results/sim_sensitivity.json``.

    python benchmarks/bench_sim_sensitivity.py              # the whole trace, ~10 min on 2 cores
    python benchmarks/bench_sim_sensitivity.py --limit 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.transport import PRESETS, LinkConfig  # noqa: E402

IDEAL = PRESETS["ideal"]
# (assumption, value shown, BenchSpec overrides)
VARIANTS: list[tuple[str, str, dict]] = [
    ("defaults", "-", {}),
    ("prefill context cost", "cached (2.45e-6)", {"steptime": "cached"}),
    ("prefill context cost", "ctx=1.5e-6 (mid)", {"steptime": "ctx=1.5e-6"}),
    ("router view", "realistic preset", {"link": PRESETS["realistic"]}),
    ("KV event delay", "100 ms", {"link": replace(IDEAL, event_delay_s=0.1)}),
    ("KV event delay", "1 s", {"link": replace(IDEAL, event_delay_s=1.0)}),
    ("KV event loss (with replay)", "10 %", {"link": replace(IDEAL, event_loss=0.1)}),
    (
        "KV event loss (no replay)",
        "10 %",
        {"link": replace(IDEAL, event_loss=0.1, replay_buffer=0)},
    ),
    ("gauge age", "5 s", {"link": replace(IDEAL, metrics_delay_s=5.0)}),
    ("report delay", "200 ms", {"link": replace(IDEAL, report_delay_s=0.2)}),
    ("KV capacity per engine", "1,200 blocks", {"capacity_blocks": 1200}),
    ("KV capacity per engine", "2,400 blocks", {"capacity_blocks": 2400}),
    ("chunked-prefill budget", "2,048 tokens", {"max_batched_tokens": 2048}),
]
POLICIES = ["kv", "affinity", "round-robin"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default=None, help="a generated workload instead of the trace")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="assumption names to run")
    ap.add_argument("--json", default="benchmarks/results/sim_sensitivity.json")
    args = ap.parse_args(argv)
    rows = []
    t0 = time.perf_counter()
    print(
        "| assumption | value | kv hit | kv p99 s | affinity hit | affinity p99 s "
        "| round-robin p99 s | kv/rr p99 |\n|---|---|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    for name, shown, overrides in VARIANTS:
        if args.only and name not in args.only and name != "defaults":
            continue
        spec = replace(
            BenchSpec(
                policies=list(POLICIES),
                workload=args.workload,
                limit=args.limit,
                link=LinkConfig(),
            ),
            **overrides,
        )
        report = run_bench(spec, jobs=args.jobs, progress=False)
        by = {r["policy"]: r for r in report["results"]}
        row = {
            "assumption": name,
            "value": shown,
            "fleet_lru_hit_rate": report["trace"]["fleet_lru_hit_rate"],
            **{
                p: {k: by[p][k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s")}
                for p in POLICIES
            },
        }
        rows.append(row)
        kv, aff, rr = by["kv"], by["affinity"], by["round-robin"]
        print(
            f"| {name} | {shown} | {kv['hit_rate']:.1%} | {kv['ttft_p99_s']:.2f} | "
            f"{aff['hit_rate']:.1%} | {aff['ttft_p99_s']:.2f} | {rr['ttft_p99_s']:.2f} | "
            f"{kv['ttft_p99_s'] / rr['ttft_p99_s']:.2f} |",
            flush=True,
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"rows": rows, "wall_s": time.perf_counter() - t0}, indent=1) + "\n"
        )
        print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far a policy's TTFT p99 is from the floor no placement can go under, per request.

A request's *floor* is its own prefill alone: its chunks at the engine's token budget over the
prefix it actually hit (``hit_device``), timed by the simulator's step-time model, with nothing
queued before it and nothing sharing its steps. kv's TTFT p99 on the conversation trace turns out
to be the p99 of these floors, so a policy can only tie it; this prints, per policy, the TTFT p99,
the p99 of its floors, and the requests above kv's p99 split into those whose floor is already
above it (no placement helps) and those that waited or were slowed into the tail (cold prompts:
less than ``min_share`` of the prompt cached; follow-ups: the rest).

    python benchmarks/bench_tail_floor.py                     # cached, ideal, the trace as stamped
    python benchmarks/bench_tail_floor.py --steptime causal --spread-seed 1 --policies kv affinity
    python benchmarks/bench_tail_floor.py --limit 300         # seconds: a small slice
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.sim.bench import BenchSpec  # noqa: E402
from kvplug.sim.policies import parse_policy  # noqa: E402
from kvplug.sim.steptime import StepTimeModel, parse_steptime  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402
from kvplug.sim.virtual import replay  # noqa: E402

MIN_SHARE = 0.1  # a request with less of its prompt cached counts as cold (affinity's default)


def floor_seconds(req, model: StepTimeModel, block_size: int, budget: int) -> float:
    """The request's own chunked prefill over the prefix it hit, alone on the engine."""
    done = min(req.hit_device * block_size, req.prompt_len - 1)  # the last token is computed
    ms = 0.0
    while done < req.prompt_len:
        n = min(budget, req.prompt_len - done)
        ms += max(model.prefill_ms(n, done), model.weights_ms)
        done += n
    return ms / 1000.0


def analyse(done, kv_p99: float, model: StepTimeModel, block_size: int, budget: int) -> dict:
    ttft = np.array([r.first_token - r.arrival for r in done])
    floor = np.array([floor_seconds(r, model, block_size, budget) for r in done])
    cold = np.array([r.hit_device < MIN_SHARE * r.prompt_blocks for r in done])
    above = ttft > kv_p99
    waited = above & (floor <= kv_p99)
    long_cold = cold & (floor > 5.0)
    excess = ttft[long_cold] - floor[long_cold]
    return {
        "requests": len(done),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "floor_p99_s": float(np.percentile(floor, 99)),
        "above_kv_p99": int(above.sum()),
        "floor_above_kv_p99": int((floor > kv_p99).sum()),
        "waited_cold": int((waited & cold).sum()),
        "waited_followup": int((waited & ~cold).sum()),
        "waited_mean_s": float((ttft - floor)[waited].mean()) if waited.any() else 0.0,
        "long_cold": int(long_cold.sum()),
        "long_cold_excess_mean_s": float(excess.mean()) if len(excess) else 0.0,
        "long_cold_excess_p90_s": float(np.percentile(excess, 90)) if len(excess) else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["kv", "affinity-rescue", "affinity-soonest"])
    ap.add_argument("--steptime", default="cached")
    ap.add_argument("--view", default="ideal", choices=list(PRESETS))
    ap.add_argument("--spread-seed", type=int, default=0, help="0 = the trace as stamped")
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format trace instead of the bundled one"
    )
    ap.add_argument(
        "--workload",
        default=None,
        help="a generated workload (multi-turn, agentic, shared-prefix, doc-qa) instead of a trace",
    )
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--json", default="benchmarks/results/tail_floor.json")
    args = ap.parse_args(argv)
    if args.policies[0] != "kv":
        ap.error("--policies: the first policy is the reference and must be kv")
    if args.spread_seed < 0:
        ap.error("--spread-seed: >= 0")
    if args.workload and (args.trace or args.spread_seed):
        ap.error("--workload: generated arrivals; not with --trace or --spread-seed")

    spec = BenchSpec(
        policies=list(args.policies),
        n_engines=args.engines,
        workload=args.workload,
        trace=args.trace,
        link=PRESETS[args.view],
        steptime=args.steptime,
        limit=args.limit,
        spread_arrivals=args.spread_seed > 0,
        seed=args.spread_seed,
    )
    model = parse_steptime(args.steptime)
    records = spec.records()
    t0 = time.perf_counter()
    kv_p99 = None
    rows = []
    for name in args.policies:
        print(f"replaying {name} ...", flush=True)
        pol = parse_policy(name)
        cfg = spec.replay_config(pol.feed_events)
        res = replay(
            records,
            pol.router_config(spec.block_tokens),
            cfg,
            policy=name,
            router_factory=pol.router_factory(),
        )
        done = [r for r in res.requests if not r.rejected]
        if kv_p99 is None:
            kv_p99 = float(np.percentile([r.first_token - r.arrival for r in done], 99))
        row = analyse(done, kv_p99, model, spec.block_tokens, cfg.engine.max_batched_tokens)
        rows.append({"policy": name, **row})

    head = "| policy | TTFT p99 s | vs kv | floor p99 s | above kv's p99 | floor above | "
    head += "waited: cold / follow-up (mean s) | cold > 5 s: excess mean / p90 s |"
    print(
        f"\n{args.workload or args.trace or 'the conversation trace'}, {args.steptime}, "
        f"view {args.view}, "
        f"spread seed {args.spread_seed}, "
        f"{rows[0]['requests']} requests"
    )
    print(head)
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ttft_p99_s']:.3f} | {r['ttft_p99_s'] / kv_p99:.4f}x | "
            f"{r['floor_p99_s']:.3f} | {r['above_kv_p99']} | {r['floor_above_kv_p99']} | "
            f"{r['waited_cold']} / {r['waited_followup']} ({r['waited_mean_s']:.2f}) | "
            f"{r['long_cold_excess_mean_s']:.3f} / {r['long_cold_excess_p90_s']:.3f} |"
        )
    wall = time.perf_counter() - t0
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "kv_ttft_p99_s": kv_p99, "rows": rows, "wall_s": wall}
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {out}")
    print(f"total wall time {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

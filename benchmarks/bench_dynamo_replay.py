"""kvplug's placements judged by Dynamo's own simulator, beside Dynamo's own KV router.

NVIDIA Dynamo ships an offline trace replay (``run_mocker_trace_replay`` in
``ai-dynamo-runtime``, what ``python -m dynamo.replay`` runs): its mocker engines (Dynamo's own
model of a vLLM engine: scheduler, chunked prefill, prefix cache, step timing) behind Dynamo's KV
router (``kv_router``, its default settings) or round robin. Its router cannot be swapped, but in
an aggregated fleet engines interact only through placement: what an engine does depends on the
requests it is sent and when. So any placement can be judged there by splitting the trace by
engine and replaying each part on one mocker engine. The method is checked on Dynamo's own
placement first: its ``kv_router`` decisions, split and replayed, must give back its whole-fleet
figures (the ``check`` row; the run stops if they do not).

Rows, all measured by the mocker, on the same trace, engines and settings:

* ``Dynamo kv_router``: Dynamo's router in its own simulator, closed loop (``--rounds`` runs: it
  breaks ties at random), with its defaults and as its users may tune it (``--dynamo-settings``);
* ``Dynamo round_robin``;
* each policy of kvplug's simulator (kvplug's own, and its replays of other routers' policies)
  at each ``--steptime`` end: its decisions made in kvplug's simulator (closed loop there, in
  the ``--view`` router view), then split and replayed in the mocker. They are open loop in the
  mocker. At the ``mocker`` end (the first by default) kvplug's simulator runs the mocker's own
  step timing (:data:`kvplug.sim.steptime.MOCKER`, measured by
  ``benchmarks/fit_mocker_steptime.py``), so those decisions saw the engines they are judged
  on, as Dynamo's router's do; at the ``causal`` and ``cached`` ends they saw kvplug's H200
  timing (slower engines, a longer tail), not the mocker's.

Hit rate is the mocker's: reused prompt tokens / prompt tokens. The bound is one LRU of the
fleet's memory shared by every request (kvplug's ``fleet_lru_hits``, in tokens).

Then the other way round: each of Dynamo's placements (its first run of each setting) replayed
in kvplug's simulator at each end, beside kvplug's policies there (closed loop), hit rate in
prompt blocks and TTFT p99 against kvplug's ``kv``.

    python benchmarks/bench_dynamo_replay.py                  # ~3 min on 2 cores
    python benchmarks/bench_dynamo_replay.py \\
        --trace benchmarks/data/mooncake_synthetic_trace.jsonl.gz \\
        --json benchmarks/results/dynamo_replay_synthetic.json \\
        --plot docs/img/dynamo_replay_synthetic.png

Needs the ``bench`` extra (``pip install -e '.[bench]'``). Prints a Markdown table, writes JSON
and a plot (hit rate against TTFT p99, every row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvplug.sim.baselines import BaselineConfig, FixedPlacement  # noqa: E402
from kvplug.sim.bench import (  # noqa: E402
    BenchSpec,
    fleet_lru_hit_rate,
    fleet_lru_hits,
    ttft_quantiles,
)
from kvplug.sim.engine import EngineConfig  # noqa: E402
from kvplug.sim.policies import parse_policy  # noqa: E402
from kvplug.sim.traces import TraceRecord  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402
from kvplug.sim.virtual import replay, summarize  # noqa: E402

POLICIES = [
    "affinity-fitted",
    "affinity-balance",
    "kv",
    "sglang-cache-aware",
    "smg-cache-aware",
    "vllm-kv-aware",
    "round-robin",
]
DYNAMO_KV = "Dynamo kv_router, defaults"
# Dynamo's router tuned as its users may: the weight of the prefill (uncached) blocks against the
# decode blocks (prefill_load_scale, formerly overlap_score_weight; 1 by default) and the credit
# a cached block earns (overlap_score_credit, 1 by default). A sweep of 17 settings on the
# conversation trace (benchmarks/results/dynamo_knob_sweep.json, its command there): hits rise
# with the scale to ~16 and stay, rise further with a credit of 4-8 at scales 64-256 (23.9-24.2 %),
# fall at a credit of 16; a temperature of 0.5 halves them. The last two are among its top ones
DYNAMO_SETTINGS = [
    "prefill_load_scale=16",
    "prefill_load_scale=16,overlap_score_credit=2",
    "prefill_load_scale=64,overlap_score_credit=4",
    "prefill_load_scale=128,overlap_score_credit=4",
]


def mocker_engine(spec: BenchSpec) -> dict:
    """The mocker's engine settings matching kvplug's simulated engine."""
    return {
        "engine": {
            "block_size": spec.block_tokens,
            "num_gpu_blocks": spec.capacity_blocks,
            "max_num_batched_tokens": spec.max_batched_tokens,
            "max_num_seqs": EngineConfig().max_num_seqs,
        }
    }


def arrival_ms(r: TraceRecord) -> int:
    """The record's arrival in whole ms, as the trace stamped it (kvplug's loader divided the
    trace's ms by 1,000 and rebased them; nothing here spreads or speeds them up)."""
    ms = r.arrival_s * 1000
    if abs(ms - round(ms)) > 1e-6:
        raise ValueError(f"arrival {r.arrival_s} s is not a whole ms: the mocker would move it")
    return int(round(ms))


def write_trace(records: list[TraceRecord], path: Path) -> None:
    """Mooncake JSONL, timestamps in ms."""
    with open(path, "w") as f:
        for r in records:
            row = {
                "timestamp": arrival_ms(r),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")


def mocker_run(
    dynamo, path: Path, spec: BenchSpec, workers: int, mode: str, setting: str = ""
) -> list[dict]:
    result = dynamo.run_mocker_trace_replay(
        [str(path)],
        extra_engine_args=mocker_engine(spec),
        num_workers=workers,
        router_mode=mode,
        router_config=dynamo.KvRouterConfig(**router_settings(setting)) if setting else None,
        trace_block_size=spec.block_tokens,
        capture_per_request=True,
    )
    return result.per_request


def router_settings(text: str) -> dict:
    """``prefill_load_scale=16,overlap_score_credit=2`` -> KvRouterConfig keyword arguments
    (numbers as int or float, true/false as bool, anything else as text)."""
    out: dict = {}
    for term in filter(None, text.split(",")):
        key, _, raw = (x.strip() for x in term.partition("="))
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    continue
        out[key] = value
    return out


def placement_of(records: list[TraceRecord], per_request: list[dict]) -> list[int]:
    """Per trace record, the engine the mocker's router sent it to. The mocker's records carry
    no trace line, so they are matched by arrival, prompt and output length; records sharing
    all three must be the same request (the same blocks), or which went where is unknowable."""
    by_key: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
    for p in per_request:
        key = (int(round(p["arrival_time_ms"])), p["input_length"], p["requested_output_length"])
        by_key[key].append(int(p["decode_worker_idx"]))
    seen: dict[tuple[int, int, int], tuple[int, ...]] = {}
    placement = []
    for r in records:
        key = (arrival_ms(r), r.input_length, r.output_length)
        if seen.setdefault(key, r.hash_ids) != r.hash_ids:
            raise ValueError(f"two different requests share arrival and lengths {key}")
        placement.append(by_key[key].popleft())
    return placement


def split_replay(
    dynamo, records: list[TraceRecord], placement: list[int], spec: BenchSpec, tmp: Path
) -> list[dict]:
    """Each engine's share of the trace replayed on one mocker engine; all requests' records."""
    out: list[dict] = []
    for engine in sorted(set(placement)):
        part = [r for r, e in zip(records, placement, strict=True) if e == engine]
        path = tmp / f"engine_{engine}.jsonl"
        write_trace(part, path)
        out.extend(mocker_run(dynamo, path, spec, 1, "round_robin"))
    return out


def same_run(a: dict, b: dict) -> bool:
    """The method check: the same requests and reused tokens exactly, the same TTFT quantiles
    within 0.2 % (the mocker's whole-fleet replay and its one-engine replay can differ in the
    fourth or fifth digit of a TTFT quantile: a median of 0.176502 s against 0.176526 s on 8
    engines, 0.241405 s against 0.241664 s, 0.11 %, in a 6-engine run the earlier 0.1 % stopped;
    the reused tokens never differ)."""
    exact = a["requests"] == b["requests"] and a["hit_rate"] == b["hit_rate"]
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
    return exact and all(abs(a[k] / b[k] - 1) <= 2e-3 for k in keys)


def figures(per_request: list[dict]) -> dict:
    reused = sum(p["reused_input_tokens"] for p in per_request)
    prompt = sum(p["input_length"] for p in per_request)
    ttft = ttft_quantiles([p["ttft_ms"] / 1000.0 for p in per_request])
    return {
        "requests": len(per_request),
        "hit_rate": reused / prompt,
        **{f"ttft_{q}_s": v for q, v in ttft.items()},
    }


def kvplug_placement(args: tuple[BenchSpec, str]) -> tuple[list[int], dict]:
    """The engine kvplug's ``policy`` sends each record to in kvplug's simulator, and its
    figures there (hit rate in prompt blocks)."""
    spec, policy = args
    pol = parse_policy(policy)
    res = replay(
        spec.records(),
        pol.router_config(spec.block_tokens),
        spec.replay_config(pol.feed_events),
        policy=pol.name,
        router_factory=pol.router_factory(),
    )
    index = {e.worker_id: i for i, e in enumerate(res.engines)}  # the fleet's order
    return [index[r.worker_id] for r in res.requests], sim_figures(res)


def sim_figures(res) -> dict:
    out = summarize(res)
    return {k: out[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s")}


def judged_by_kvplug(args: tuple[BenchSpec, list[int]]) -> dict:
    """A placement replayed in kvplug's simulator (open loop), its figures there."""
    spec, placement = args
    res = replay(
        spec.records(),
        BaselineConfig("fixed", spec.block_tokens),
        spec.replay_config(False),
        policy="fixed",
        router_factory=partial(FixedPlacement, placement=placement),
    )
    return sim_figures(res)


def token_bound(records: list[TraceRecord], spec: BenchSpec) -> float:
    """One LRU of the fleet's memory shared by every request, in reused prompt tokens (a fully
    cached prompt still computes its last token, as the engines do)."""
    hits = fleet_lru_hits(records, spec.capacity_blocks * spec.n_engines, spec.block_tokens)
    reused = sum(
        min(h * spec.block_tokens, r.input_length - 1) for h, r in zip(hits, records, strict=True)
    )
    return reused / sum(r.input_length for r in records)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=None, help="Mooncake JSONL (.gz); default: the bundled one")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--policies", nargs="*", default=POLICIES)
    ap.add_argument("--steptime", nargs="+", default=["mocker", "causal", "cached"])
    ap.add_argument("--view", choices=sorted(PRESETS), default="ideal", help="kvplug's router view")
    ap.add_argument("--rounds", type=int, default=3, help="runs of Dynamo's router")
    ap.add_argument(
        "--dynamo-settings",
        nargs="*",
        default=DYNAMO_SETTINGS,
        help="Dynamo's router also with these KvRouterConfig settings (KEY=VALUE,...)",
    )
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/dynamo_replay.json")
    ap.add_argument("--plot", default="docs/img/dynamo_replay.png", help="'' = none")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds: at least 1 (the method check runs on the first)")
    # Dynamo's router logs every decision at INFO; its log level comes from DYN_LOG
    os.environ.setdefault("DYN_LOG", "warn")
    try:
        from importlib.metadata import version

        import dynamo._core as dynamo

        dynamo_version = version("ai-dynamo-runtime")
    except ImportError:
        print("needs ai-dynamo-runtime: pip install -e '.[bench]'", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    base = BenchSpec(
        policies=[],
        n_engines=args.engines,
        trace=args.trace,
        limit=args.limit,
        link=PRESETS[args.view],
    )
    records = base.records()
    bound = token_bound(records, base)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        whole = tmp / "trace.jsonl"
        write_trace(records, whole)
        # kvplug's placements first, in parallel (kvplug's simulator is Python)
        jobs = [
            (replace(base, policies=[p], steptime=st), p)
            for st in args.steptime
            for p in args.policies
        ]
        print(f"kvplug's simulator: {len(jobs)} placements ...", flush=True)
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            placements = list(pool.map(kvplug_placement, jobs))
        print(f"  done ({time.perf_counter() - t_start:.0f} s)", flush=True)

        check = None
        dynamo_placements: dict[str, list[int]] = {}  # each setting's first run
        # its defaults, then as its users may tune it
        for setting in ["", *args.dynamo_settings]:
            name = f"Dynamo kv_router, {setting}" if setting else DYNAMO_KV
            for k in range(args.rounds):
                per_request = mocker_run(dynamo, whole, base, args.engines, "kv_router", setting)
                rows.append({"row": name, "round": k, **figures(per_request)})
                if k == 0:
                    dynamo_placements[name] = placement_of(records, per_request)
                if k == 0 and not setting:  # the method check: its placement split and replayed
                    again = figures(
                        split_replay(dynamo, records, dynamo_placements[name], base, tmp)
                    )
                    check = {"closed_loop": rows[-1], "split_replay": again}
                    if not same_run(again, rows[-1]):
                        print(f"method check failed: {check}", file=sys.stderr)
                        return 1
            print(f"{name}: {args.rounds} rounds", flush=True)
        per_request = mocker_run(dynamo, whole, base, args.engines, "round_robin")
        rows.append({"row": "Dynamo round_robin", "round": 0, **figures(per_request)})
        for (spec, policy), (placement, sim) in zip(jobs, placements, strict=True):
            got = figures(split_replay(dynamo, records, placement, base, tmp))
            rows.append(
                {
                    "row": f"{policy} ({spec.steptime})",
                    "policy": policy,
                    "steptime": spec.steptime,
                    "kvplug_sim_hit_rate": sim["hit_rate"],
                    **got,
                }
            )
            print(f"  {policy} ({spec.steptime}) judged by the mocker", flush=True)

    # the other way round: Dynamo's placements judged by kvplug's simulator, beside kvplug's
    # policies there (closed loop), at each step-time end
    judged = [
        (replace(base, steptime=st), name) for st in args.steptime for name in dynamo_placements
    ]
    print(f"kvplug's simulator judges {len(judged)} of Dynamo's placements ...", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        dynamo_in_kvplug = list(
            pool.map(judged_by_kvplug, [(spec, dynamo_placements[n]) for spec, n in judged])
        )
    kvplug_sim_rows = [
        {"row": f"{policy} (closed loop)", "steptime": spec.steptime, **sim}
        for (spec, policy), (_, sim) in zip(jobs, placements, strict=True)
    ] + [
        {"row": f"{name}: its placement", "steptime": spec.steptime, **sim}
        for (spec, name), sim in zip(judged, dynamo_in_kvplug, strict=True)
    ]
    block_bound = fleet_lru_hit_rate(records, base.capacity_blocks * base.n_engines)
    for st in args.steptime:
        here = [r for r in kvplug_sim_rows if r["steptime"] == st]
        kv = [r for r in here if r["row"] == "kv (closed loop)"]
        for r in here:
            r["share_of_bound"] = r["hit_rate"] / block_bound
            r["p99_vs_kv"] = r["ttft_p99_s"] / kv[0]["ttft_p99_s"] if kv else None

    dyn = [r for r in rows if r["row"] == DYNAMO_KV]  # the ratios are against its defaults
    dyn_hit = [r["hit_rate"] for r in dyn]
    dyn_p99 = [r["ttft_p99_s"] for r in dyn]
    for r in rows:  # against Dynamo's router: each of its rounds (a range)
        r["hit_vs_dynamo"] = [r["hit_rate"] / h for h in dyn_hit]
        r["p99_vs_dynamo"] = [r["ttft_p99_s"] / p for p in dyn_p99]
        r["share_of_bound"] = r["hit_rate"] / bound
    report = {
        "command": "python benchmarks/bench_dynamo_replay.py " + " ".join(sys.argv[1:]),
        "dynamo": f"ai-dynamo-runtime {dynamo_version}",
        "trace": args.trace or "bundled conversation trace",
        "view": args.view,
        "requests": len(records),
        "engines": args.engines,
        "mocker_engine": mocker_engine(base),
        "token_bound": bound,
        "block_bound": block_bound,
        "check": check,
        "rows": rows,
        "judged_by_kvplug": kvplug_sim_rows,
        "wall_s": time.perf_counter() - t_start,
    }
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0


def span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}–{hi:{fmt}}"


def print_table(report: dict) -> None:
    print(
        f"\n{report['requests']:,} requests, {report['engines']} engines, judged by Dynamo's "
        f"mocker ({report['dynamo']}); one-shared-LRU bound {report['token_bound']:.1%} of "
        "prompt tokens"
    )
    check = report["check"]
    split, closed = check["split_replay"], check["closed_loop"]
    print(
        f"method check: Dynamo's kv_router placement split and replayed: hit "
        f"{split['hit_rate']:.4f} / p99 {split['ttft_p99_s']:.3f} s against "
        f"{closed['hit_rate']:.4f} / {closed['ttft_p99_s']:.3f} s closed loop\n"
    )
    print(
        "| placement (Dynamo's: its own, closed loop; kvplug's simulator's: its decisions at that "
        "end) | hit rate | share of the bound "
        "| vs Dynamo's kv_router | TTFT p50 s | TTFT p99 s | p99 vs Dynamo's "
        "| hit in kvplug's simulator |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in report["rows"]:
        groups[r["row"]].append(r)
    for name, rs in groups.items():
        vs_hit = [x for r in rs for x in r["hit_vs_dynamo"]]
        vs_p99 = [x for r in rs for x in r["p99_vs_dynamo"]]
        sim = rs[0].get("kvplug_sim_hit_rate")
        print(
            f"| {name} | {span([r['hit_rate'] * 100 for r in rs], '.1f')} % "
            f"| {span([r['share_of_bound'] * 100 for r in rs], '.1f')} % "
            f"| {span(vs_hit, '.3f')}× | {span([r['ttft_p50_s'] for r in rs], '.3f')} "
            f"| {span([r['ttft_p99_s'] for r in rs], '.2f')} | {span(vs_p99, '.3f')}× "
            f"| {'' if sim is None else f'{sim:.1%}'} |"
        )

    print(
        f"\nThe other way round: judged by kvplug's simulator (one-shared-LRU bound "
        f"{report['block_bound']:.1%} of prompt blocks; kvplug's policies closed loop, "
        "Dynamo's placements from its first run, open loop)\n"
    )
    print(
        "| placement | step-time end | hit rate | share of the bound | TTFT p99 s | p99 vs kv's |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in report["judged_by_kvplug"]:
        vs = "" if r["p99_vs_kv"] is None else f"{r['p99_vs_kv']:.3f}×"
        print(
            f"| {r['row']} | {r['steptime']} | {r['hit_rate']:.1%} | {r['share_of_bound']:.1%} "
            f"| {r['ttft_p99_s']:.2f} | {vs} |"
        )


def plot(report: dict, path: str) -> None:
    """Hit rate against TTFT p99, every row (each of Dynamo's rounds a point)."""
    from kvplug.sim.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in report["rows"]:
        groups[r["row"]].append(r)
    dynamo_names = [n for n in groups if n.startswith("Dynamo kv_router")]
    # kvplug's other policies at the first --steptime end only (the default at every end)
    first = next((n[n.rindex(" (") :] for n in groups if not n.startswith("Dynamo")), None)
    blues = plt.get_cmap("Blues")
    markers = "s^Dv<>pPXh"
    others = 0
    for name, rs in groups.items():
        mine = not name.startswith(("Dynamo", POLICIES[0]))
        if mine and first and not name.endswith(first):
            continue
        style: dict = {"s": 42, "zorder": 3}
        if name in dynamo_names:  # Dynamo's own router: blue circles, darker = more tuned
            shade = 0.35 + 0.6 * dynamo_names.index(name) / max(len(dynamo_names) - 1, 1)
            style.update(marker="o", s=55, color=blues(shade), edgecolor="k", linewidth=0.4)
        elif name.startswith(POLICIES[0]):  # kvplug's default, on top; red: decided with the
            # mocker's timing, orange: with kvplug's H200 timing
            color = "red" if "(mocker)" in name else "orange"
            style.update(marker="*", s=190, color=color, edgecolor="k", linewidth=0.6, zorder=5)
        else:
            style.update(marker=markers[others % len(markers)])
            others += 1
        ax.scatter(
            [r["hit_rate"] for r in rs],
            [r["ttft_p99_s"] for r in rs],
            label=name + (f" ({len(rs)} runs)" if len(rs) > 1 else ""),
            **style,
        )
    bound = report["token_bound"]
    ax.axvline(bound, color="k", ls="--", lw=1, label="one shared LRU (fleet memory)")
    ax.axvline(0.95 * bound, color="k", ls=":", lw=1, label="95 % of it")
    ax.set_xlabel("KV hit rate (reused prompt tokens / prompt tokens), by Dynamo's mocker")
    ax.set_ylabel("TTFT p99 (s), by Dynamo's mocker")
    ax.set_title(
        f"Placements judged by Dynamo's own simulator ({report['dynamo']}): "
        f"{report['requests']:,} requests, {report['engines']} engines",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

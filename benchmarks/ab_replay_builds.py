"""The simulator's replay cost, two source trees side by side: CPU seconds to replay the same
requests, the trees taking turns round by round.

Each tree (``--base`` and ``--new``: a checkout built in place) replays in a fresh child
process per round, so each loads its own kvplug; the order alternates every round, so machine
load falls on both alike. ``--cases replay`` (the default), three replays a round: the
conversation trace's first 6,000 requests on 8 engines under ``kv``; its first 4,000 on 8
engines with a host tier under the default routing; a generated multi-turn workload (~23,000
requests) on 128 engines under ``kv``. ``--cases approx``: the whole conversation trace in the
realistic router view under approximate mode and under the default routing with a 2 s
predicted TTL (both record every routed prompt in a side index). Each child digests every
replay's hit rate, TTFT and E2E p99 and prefill tokens: both trees must give the same digests (a
change of the engines' defaults would show there); it also reports the mean ``Router.route``
time (wall, µs).

    python benchmarks/ab_replay_builds.py --base /tmp/base --new . --rounds 6
    python benchmarks/ab_replay_builds.py --base /tmp/base --new . --rounds 4 --cases approx \
        --out benchmarks/results/ab_replay_builds_approx.json

Prints a table (medians, ranges over rounds, base/new per round); writes
``benchmarks/results/ab_replay_builds.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(tree: str, case_set: str) -> dict:
    """One round of one tree: CPU seconds per replay, and each replay's results digested."""
    sys.path.insert(0, str(Path(tree).resolve()))
    import kvplug
    from kvplug.sim.engine import EngineConfig
    from kvplug.sim.policies import parse_policy
    from kvplug.sim.traces import load_trace, parse_workload
    from kvplug.sim.transport import PRESETS
    from kvplug.sim.virtual import ReplayConfig, replay, summarize

    loaded = Path(kvplug.__file__).resolve().parent.parent
    assert loaded == Path(tree).resolve(), f"{tree}: imported kvplug from {loaded}"
    ideal, realistic = PRESETS["ideal"], PRESETS["realistic"]
    if case_set == "approx":
        whole = load_trace()  # read once: both replays take the same records
        cases = [
            ("conversation, 8 engines, realistic view, approx", whole, 8, "approx", {}),
            (
                "the same, the default routing with a 2 s predicted TTL",
                whole,
                8,
                "affinity-fitted:router_predicted_ttl_secs=2",
                {},
            ),
        ]
        link = realistic
    else:
        cases = [
            ("conversation, 8 engines, kv", load_trace(limit=6000), 8, "kv", {}),
            (
                "conversation, 8 engines with a host tier, the default routing",
                load_trace(limit=4000),
                8,
                "affinity-fitted",
                {"host_capacity_blocks": 3280},
            ),
            (
                "multi-turn, 128 engines, kv",
                parse_workload("multi-turn:session_rate=24,duration=120,seed=3", 512),
                128,
                "kv",
                {},
            ),
        ]
        link = ideal
    out = {}
    for name, records, engines, policy, engine in cases:
        pol = parse_policy(policy)
        cfg = ReplayConfig(
            n_engines=engines,
            engine=EngineConfig(**engine),
            feed_events=pol.feed_events,
            link=link,
        )
        c0 = time.process_time()
        res = replay(
            records, pol.router_config(512), cfg, policy=policy, router_factory=pol.router_factory()
        )
        cpu = time.process_time() - c0
        s = summarize(res)
        key = [s["hit_rate"], s["ttft_p99_s"], s["e2e_p99_s"], s["prefill_tokens"]]
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        route_us = 1e6 * res.route_seconds / max(1, len(records))
        out[name] = {"cpu_s": cpu, "route_us": route_us, "requests": len(records), "digest": digest}
    return out


def span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def by_round(got: dict[str, list[dict]], case: str, key: str) -> tuple[list, list, list]:
    """One figure of one case, round by round: the base's, the new tree's, base / new."""
    base = [r[case][key] for r in got["base"]]
    new = [r[case][key] for r in got["new"]]
    return base, new, [b / n for b, n in zip(base, new, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="source tree of the baseline (built in place)")
    ap.add_argument("--new", help="source tree to compare (built in place)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--cases",
        choices=("replay", "approx"),
        default="replay",
        help="replay: the simulator's own cost (default); approx: the side index of routed "
        "prompts (approximate mode, a predicted TTL)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "ab_replay_builds.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.cases)))
        return 0
    if not (args.base and args.new):
        ap.error("--base and --new are required")
    got: dict[str, list[dict]] = {"base": [], "new": []}
    for rnd in range(args.rounds):
        for name in ("base", "new") if rnd % 2 == 0 else ("new", "base"):
            # resolved here: the child runs in / (nothing on its path but the tree)
            tree = str(Path(args.base if name == "base" else args.new).resolve())
            cmd = [sys.executable, __file__, "--child", tree, "--cases", args.cases]
            run = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd="/")
            if run.returncode != 0:
                raise SystemExit(f"child for {tree} failed:\n{run.stderr}")
            got[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"round {rnd + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    cases = []
    rows = []
    for case in got["base"][0]:
        base, new, ratios = by_round(got, case, "cpu_s")
        base_route, new_route, route_ratios = by_round(got, case, "route_us")
        same = len({r[case]["digest"] for r in got["base"] + got["new"]}) == 1
        cases.append(
            {
                "case": case,
                "requests": got["base"][0][case]["requests"],
                "base_cpu_s": base,
                "new_cpu_s": new,
                "base_over_new": ratios,
                "base_route_us": base_route,
                "new_route_us": new_route,
                "route_base_over_new": route_ratios,
                "same_results": same,
            }
        )
        rows.append(
            f"| {case} | {span(base)} | {span(new)} | {span(ratios)} | {span(route_ratios)} "
            f"| {'yes' if same else 'NO'} |"
        )
    print("| replay | base CPU s | new CPU s | base/new | route time base/new | same results |")
    print("|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "cases": cases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

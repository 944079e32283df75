"""The router's per-request cost, two source trees side by side: ``Router.route`` +
``Router.on_finish`` in CPU microseconds, the trees taking turns round by round.

Each tree (``--base`` and ``--new``: a checkout built in place, i.e. holding
``kvplug/_core*.so``) runs in a fresh child process per round, so both load their own kvplug
(Python and compiled core); the order alternates every round, so machine load (2 shared vCPUs
here) falls on both alike. A child builds the router ``kvplug serve --kv-block-size 16`` builds
(mode ``kv``, or the default routing with ``--router-mode affinity``; ``kv_cost``,
``--router-assume-kv-reuse`` on) with ``--workers`` workers and routes
bench_frontend's ~512-token token-id prompts (numpy uint32, as the frontend's parser hands
them over; 8 shared 384-token prefixes) with ``--inflight`` requests in flight (0: each
request finishes right after its decision, as glue_cost.py; 16: wrk's 16 connections, so the
active-block trie holds the shared prefixes), timing ``--requests`` decisions after a warm-up.

Each child also routes a fixed sequence with a seeded router, untimed, and digests every
decision's ``to_dict()`` (the pick, the trace's inputs and values, the formula text; without
``elapsed_us``): both trees must give the same digest (the same decisions and traces).

    python benchmarks/ab_route_cost.py --base /tmp/main15 --new .
    python benchmarks/ab_route_cost.py --base /tmp/main15 --new . --workers 2 --rounds 4
    python benchmarks/ab_route_cost.py --base /tmp/main15 --new . --router-mode affinity
    python benchmarks/ab_route_cost.py --base /tmp/main15 --new . --first-token  # + first tokens

Prints a table (medians, ranges over rounds, base/new ratio per round); writes
``benchmarks/results/ab_route_cost.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(
    tree: str, workers: int, inflight: int, requests: int, mode: str = "kv", first: bool = False
) -> dict:
    """One round of one tree: CPU us per route (+ on_first_token) + on_finish, and the
    decisions' digest."""
    sys.path.insert(0, str(Path(tree).resolve()))
    import numpy as np

    import kvplug
    from kvplug.config import RouterConfig
    from kvplug.request import RouteRequest
    from kvplug.router import Router
    from kvplug.workers import Worker

    # after kvplug: bench_frontend puts this checkout first on sys.path
    sys.path.insert(1, str(HERE))
    from bench_frontend import make_prompts, token_ids

    loaded = Path(kvplug.__file__).resolve().parent.parent
    assert loaded == Path(tree).resolve(), f"{tree}: imported kvplug from {loaded}"
    prompts = [np.asarray(token_ids(p), dtype=np.uint32) for p in make_prompts(512)]

    def router() -> Router:
        r = Router(RouterConfig(kv_block_size=16, router_mode=mode), rng=random.Random(7))
        for i in range(workers):
            r.add_worker(Worker(f"e{i}", url=f"http://127.0.0.1:{9001 + i}", engine="openai"))
        return r

    def run(r: Router, start: int, n: int, keep: list | None = None) -> float:
        route, finish, first_token = r.route, r.on_finish, r.on_first_token
        live: list[str] = []
        c0 = time.process_time()
        for i in range(start, start + n):
            rid = f"r{i}"
            d = route(RouteRequest(rid, prompts[i % len(prompts)]))
            if keep is not None:
                keep.append(d)
            if first:  # as the frontend reports a stream's first event
                first_token(rid)
            live.append(rid)
            if len(live) > inflight:
                finish(live.pop(0))
        for rid in live:
            finish(rid)
        return (time.process_time() - c0) / n * 1e6

    # the same decisions: a seeded router's traces, in full, digested
    decisions: list = []
    run(router(), 0, 600, decisions)
    digest = hashlib.sha256()
    for d in decisions:
        doc = d.to_dict()
        doc.pop("elapsed_us")
        digest.update(json.dumps(doc, sort_keys=True).encode())
    r = router()
    run(r, 0, 2000)  # warm: code paths, the index's and the trie's tables
    us = run(r, 2000, requests)
    assert r.stats()["active_requests"] == 0
    return {"us": us, "digest": digest.hexdigest()}


def one_round(
    tree: str, workers: int, inflight: int, requests: int, mode: str, first: bool = False
) -> dict:
    cmd = [
        sys.executable, __file__, "--child", tree, "--workers", str(workers),
        "--inflight", str(inflight), "--requests", str(requests), "--router-mode", mode,
    ] + (["--first-token"] if first else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"child for {tree} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="source tree of the baseline (built in place)")
    ap.add_argument("--new", help="source tree to compare (built in place)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--inflight", type=int, nargs="+", default=[0, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=20000, help="timed decisions per round")
    ap.add_argument(
        "--router-mode", default="kv", help="kv (default) or affinity: kvplug serve's default"
    )
    ap.add_argument(
        "--first-token",
        action="store_true",
        help="report each request's first token between its route and its finish, as the "
        "frontend does for a stream (Router.on_first_token in the timed loop)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "ab_route_cost.json"))
    args = ap.parse_args(argv)
    if args.child:
        got = child(
            args.child,
            args.workers[0],
            args.inflight[0],
            args.requests,
            args.router_mode,
            args.first_token,
        )
        print(json.dumps(got))
        return 0
    if not (args.base and args.new):
        ap.error("--base and --new are required")
    results: dict = {"args": vars(args), "cases": []}
    rows = []
    for workers in args.workers:
        for inflight in args.inflight:
            got: dict[str, list[dict]] = {"base": [], "new": []}
            for rnd in range(args.rounds):
                for name in ("base", "new") if rnd % 2 == 0 else ("new", "base"):
                    tree = args.base if name == "base" else args.new
                    got[name].append(
                        one_round(
                            tree,
                            workers,
                            inflight,
                            args.requests,
                            args.router_mode,
                            args.first_token,
                        )
                    )
                print(
                    f"[{workers} workers, {inflight} in flight] round {rnd + 1}/{args.rounds}: "
                    f"base {got['base'][-1]['us']:.2f} us, new {got['new'][-1]['us']:.2f} us "
                    f"(load {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                )
            base = [g["us"] for g in got["base"]]
            new = [g["us"] for g in got["new"]]
            ratios = [b / n for b, n in zip(base, new, strict=True)]
            same = len({g["digest"] for g in got["base"] + got["new"]}) == 1
            case = {
                "workers": workers,
                "inflight": inflight,
                "base_us": base,
                "new_us": new,
                "base_over_new": ratios,
                "same_decisions": same,
            }
            results["cases"].append(case)
            rows.append(
                f"| {workers} | {inflight} | {span(base)} | {span(new)} | {span(ratios)} "
                f"| {'yes' if same else 'NO'} |"
            )
    print("| workers | in flight | base route+finish us | new route+finish us | base/new "
          "| same decisions |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(c["same_decisions"] for c in results["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

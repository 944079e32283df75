"""Router decision latency: hash + query + load + filters + cost + pick, per decision.

For each fleet size, the index holds ~``--blocks`` (block, endpoint) entries: filler chains of
random hashes plus a few real 8,192-token documents cached on several workers at different
prefix lengths (so decisions see real, varied overlaps). Each decision routes one 8,192-token
prompt (numpy uint32 tokens; hashing included) and the request is finished right after, so the
load stays steady. Baselines measured in the same run:

* ``hash+query``: ``index.request_hashes`` + ``index.query`` alone (the core's floor);
* ``round-robin``: a full ``Router.route`` in round-robin mode (no hashing, no query).

Also measured: decisions with ``--inflight`` requests kept in flight (each decision finishes
the oldest), so the active-block dedup (``--router-assume-kv-reuse``, on by default) walks a
populated trie of shared document prefixes, and the same with the flag off; the default routing
(``kvplug serve`` with no ``--router-mode``: kv's cost, then the affinity decision in Python) with
the same requests in flight, and beside it the default before issue 14's twenty-fourth pass
(``affinity-balance``: no fitted prefill model) and the default on engines registered with
vLLM's ``--long-prefill-token-threshold`` 2048 (``capped``: predicting with the step cap), the
three taking turns; the same kv
decision with busy thresholds and an attribute threshold
(``gpu_utilization<=0.9``, all fresh, nobody over) configured, i.e. the cost of the filters;
and approximate mode (no events: each decision also records its prompt in the side index).

Usage: python benchmarks/bench_router.py [--workers 8 64 512] [--blocks 1000000]
       [--decisions 2000] [--prompt-tokens 8192] [--block-size 16] [--inflight 32]
       [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hostinfo

from hostinfo import cpu_model  # noqa: E402

from kvplug import core  # noqa: E402
from kvplug.config import RouterConfig  # noqa: E402
from kvplug.events import BlockStored  # noqa: E402
from kvplug.request import RouteRequest  # noqa: E402
from kvplug.router import Router  # noqa: E402
from kvplug.workers import Worker  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bench_router.json"
PREVIOUS_DEFAULT_AFFINITY = "affinity-balance"  # the default before issue 14's 24th pass
# the default routing again, its engines registered with vLLM's --long-prefill-token-threshold:
# what predicting with the step cap costs a decision
CAPPED_THRESHOLD = 2048


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def build(
    n_workers: int, mode: str, args, docs: list[np.ndarray], rng: np.random.Generator, seed: int
) -> Router:
    cfg = RouterConfig(
        router_mode=mode,
        kv_block_size=args.block_size,
        router_max_prompt_tokens=max(args.prompt_tokens, 1 << 20),
    )
    r = Router(cfg, rng=random.Random(seed))
    # the fleet's caches as full as the index: the router pre-sizes its index for their sum, so
    # a larger declared capacity would measure a sparser table than the ~--blocks it holds
    capacity = max(1, args.blocks // n_workers)
    for i in range(n_workers):
        r.add_worker(Worker(f"w{i}", kv_capacity_blocks=capacity, max_batched_tokens=8192))
    if mode != "kv":
        return r
    chain = args.prompt_tokens // args.block_size
    # real documents: each on 4 workers with different cached prefix lengths
    stored = 0
    for d, toks in enumerate(docs):
        h = np.asarray(r.index.request_hashes(toks), dtype=np.uint64)
        for j in range(min(4, n_workers)):
            w = int(rng.integers(n_workers))
            n = int(len(h) * (j + 1) / 4)
            r.apply_event(
                BlockStored(
                    worker_id=f"w{w}",
                    engine_hashes=list(range(10**9 * d, 10**9 * d + n)),
                    block_hashes=h[:n].tolist(),
                )
            )
            stored += n
    # filler: random chains, each on one worker
    eh = 1 << 40
    while stored < args.blocks:
        n = min(chain, args.blocks - stored)
        hs = rng.integers(1, 2**63, size=n, dtype=np.int64).astype(np.uint64)
        r.apply_event(
            BlockStored(
                worker_id=f"w{int(rng.integers(n_workers))}",
                engine_hashes=list(range(eh, eh + n)),
                block_hashes=hs.tolist(),
            )
        )
        eh += n
        stored += n
    return r


def time_route(
    r: Router, prompts: list[np.ndarray], n: int, hits: list[int] | None = None
) -> list[float]:
    out = []
    for i in range(n):
        req = RouteRequest(f"r{i}", prompts[i % len(prompts)])
        t0 = time.perf_counter_ns()
        d = r.route(req)
        out.append((time.perf_counter_ns() - t0) / 1000)
        if hits is not None:
            hits.append(d.overlap_blocks)
        r.on_finish(req.request_id)
    return out


def time_route_inflight(r: Router, prompts: list[np.ndarray], n: int, window: int) -> list[float]:
    """Route with ``window`` requests in flight: each decision finishes the oldest one."""
    out = []
    live: list[str] = []
    for i in range(n):
        req = RouteRequest(f"f{i}", prompts[i % len(prompts)])
        t0 = time.perf_counter_ns()
        r.route(req)
        out.append((time.perf_counter_ns() - t0) / 1000)
        live.append(req.request_id)
        if len(live) > window:
            r.on_finish(live.pop(0))
    for rid in live:
        r.on_finish(rid)
    return out


def time_floor(r: Router, prompts: list[np.ndarray], n: int) -> tuple[list[float], list[float]]:
    hash_us, query_us = [], []
    for i in range(n):
        toks = prompts[i % len(prompts)]
        t0 = time.perf_counter_ns()
        h = r.index.request_hashes(toks)
        t1 = time.perf_counter_ns()
        r.index.query(h)
        t2 = time.perf_counter_ns()
        hash_us.append((t1 - t0) / 1000)
        query_us.append((t2 - t1) / 1000)
    return hash_us, query_us


def measure(
    n: int,
    args,
    docs: list[np.ndarray],
    prompts: list[np.ndarray],
    rng: np.random.Generator,
    turn: int = 0,
) -> dict:
    """One round at ``n`` workers: a fresh fleet and index, every decision kind timed."""
    t0 = time.perf_counter()
    r = build(n, "kv", args, docs, rng, seed=n)
    fill_s = time.perf_counter() - t0
    warm = max(50, args.decisions // 20)
    time_route(r, prompts, warm)
    overlap: list[int] = []
    kv = time_route(r, prompts, args.decisions, overlap)
    kv_hit = [t for t, o in zip(kv, overlap, strict=True) if o > 0]
    kv_miss = [t for t, o in zip(kv, overlap, strict=True) if o == 0]
    inflight = time_route_inflight(r, prompts, args.decisions, args.inflight)
    active_nodes = r.load.active.nodes()
    hash_us, query_us = time_floor(r, prompts, args.decisions)
    # the same fleet and index without the dedup (--no-router-assume-kv-reuse)
    rn = Router(
        RouterConfig(kv_block_size=args.block_size, router_mode="kv", router_assume_kv_reuse=False),
        rng=random.Random(n),
        index=r.index,
    )
    for w in r.workers.values():
        rn.add_worker(w)
    time_route(rn, prompts, warm)
    inflight_nodedup = time_route_inflight(rn, prompts, args.decisions, args.inflight)
    # same fleet and index, with busy and attribute thresholds configured
    rf = Router(
        RouterConfig(
            kv_block_size=args.block_size,
            router_mode="kv",
            active_decode_blocks_threshold=0.9,
            active_prefill_tokens_threshold_frac=4.0,
            router_attribute_thresholds=["gpu_utilization<=0.9"],
            router_attribute_max_age=1e9,
        ),
        rng=random.Random(n),
        index=r.index,
    )
    for w in r.workers.values():
        rf.add_worker(w)
        rf.set_attributes(w.worker_id, {"gpu_utilization": 0.5})
    time_route(rf, prompts, warm)
    kv_filtered = time_route(rf, prompts, args.decisions)
    # approximate mode (no events): every decision also records its prompt in the side
    # index (and, once the 2^20-block cap is reached, drops the oldest record)
    ra = Router(
        RouterConfig(kv_block_size=args.block_size, router_mode="kv", router_kv_events=False),
        rng=random.Random(n),
    )
    for w in r.workers.values():
        ra.add_worker(w)
    time_route(ra, prompts, warm)
    kv_approx = time_route(ra, prompts, args.decisions)
    # the default routing (kvplug serve with no --router-mode: kv's cost, then the affinity
    # decision), the same fleet and index, with requests in flight
    defaults = RouterConfig()

    def affinity_router(affinity: str, like: Router, threshold: int = 0) -> Router:
        router = Router(
            RouterConfig(
                kv_block_size=args.block_size,
                router_mode=defaults.router_mode,
                router_affinity=affinity,
                router_max_prompt_tokens=max(args.prompt_tokens, 1 << 20),
            ),
            rng=random.Random(n),
            index=like.index,
        )
        for w in like.workers.values():
            if threshold:
                w = dataclasses.replace(w, long_prefill_token_threshold=threshold)
            router.add_worker(w)
        time_route_inflight(router, prompts, warm, args.inflight)
        return router

    # and the default before issue 14's twenty-fourth pass (no fitted prefill model, no
    # per-engine speeds) on the same fleet and index: what the fit costs a decision; and the
    # default on engines with a long_prefill_token_threshold. The three take turns going first,
    # round by round
    rd = affinity_router(defaults.router_affinity, r)
    rp = affinity_router(PREVIOUS_DEFAULT_AFFINITY, r)
    rc = affinity_router(defaults.router_affinity, r, CAPPED_THRESHOLD)
    routers = {"default": rd, "previous": rp, "capped": rc}
    names = list(routers)
    order = names[turn % 3 :] + names[: turn % 3]
    timed = {
        k: time_route_inflight(routers[k], prompts, args.decisions, args.inflight) for k in order
    }
    default_inflight, previous_inflight = timed["default"], timed["previous"]
    capped_inflight = timed["capped"]
    rr = build(n, "round-robin", args, docs, rng, seed=n)
    time_route(rr, prompts, warm)
    base = time_route(rr, prompts, args.decisions)
    floor = [a + b for a, b in zip(hash_us, query_us, strict=True)]
    row = {
        "workers": n,
        "indexed_entries": r.index.stats().get("entries", args.blocks),
        "fill_seconds": round(fill_s, 2),
        "kv_median_us": statistics.median(kv),
        "kv_p99_us": percentile(kv, 0.99),
        "kv_median_us_cached_prefix": statistics.median(kv_hit) if kv_hit else None,
        "kv_median_us_no_prefix": statistics.median(kv_miss) if kv_miss else None,
        "mean_overlap_blocks_of_pick": statistics.fmean(overlap),
        "inflight": args.inflight,
        "kv_inflight_median_us": statistics.median(inflight),
        "kv_inflight_p99_us": percentile(inflight, 0.99),
        "kv_inflight_no_reuse_median_us": statistics.median(inflight_nodedup),
        "default_mode": f"{defaults.router_mode}:{defaults.router_affinity}",
        "default_inflight_median_us": statistics.median(default_inflight),
        "default_inflight_p99_us": percentile(default_inflight, 0.99),
        "previous_default_mode": f"{defaults.router_mode}:{PREVIOUS_DEFAULT_AFFINITY}",
        "previous_default_inflight_median_us": statistics.median(previous_inflight),
        "previous_default_inflight_p99_us": percentile(previous_inflight, 0.99),
        "capped_threshold": CAPPED_THRESHOLD,
        "capped_default_inflight_median_us": statistics.median(capped_inflight),
        "capped_default_inflight_p99_us": percentile(capped_inflight, 0.99),
        "active_trie_nodes_after": active_nodes,
        "kv_with_filters_median_us": statistics.median(kv_filtered),
        "kv_with_filters_p99_us": percentile(kv_filtered, 0.99),
        "approx_median_us": statistics.median(kv_approx),
        "approx_p99_us": percentile(kv_approx, 0.99),
        "hash_median_us": statistics.median(hash_us),
        "query_median_us": statistics.median(query_us),
        "hash_query_median_us": statistics.median(floor),
        "router_overhead_median_us": statistics.median(kv) - statistics.median(floor),
        "round_robin_median_us": statistics.median(base),
        "round_robin_p99_us": percentile(base, 0.99),
    }
    row["kv_over_round_robin"] = row["kv_median_us"] / row["round_robin_median_us"]
    row["kv_over_hash_query"] = row["kv_median_us"] / row["hash_query_median_us"]
    del r, rf, ra, rr, rn, rd, rp, rc
    return row


def median_row(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds, its range beside the decision times
    (``<figure>_range``: [lowest, highest]) and the rounds themselves."""
    row = dict(rounds[0])
    for key in rounds[0]:
        # a split by prefix can be empty in a round (None): the median of the others
        values = [r[key] for r in rounds if isinstance(r[key], float)]
        if values and key != "fill_seconds":
            row[key] = statistics.median(values)
            if key.endswith("_us"):
                row[f"{key}_range"] = [min(values), max(values)]
    row["rounds"] = rounds
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the fleet sizes")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    docs = [
        rng.integers(0, 128_000, size=args.prompt_tokens, dtype=np.uint32) for _ in range(args.docs)
    ]
    # prompts: half start with a cached document (then diverge), half are fresh
    prompts = []
    for i in range(64):
        p = rng.integers(0, 128_000, size=args.prompt_tokens, dtype=np.uint32)
        if i % 2 == 0:
            d = docs[i % len(docs)]
            cut = int(rng.integers(args.prompt_tokens // 4, args.prompt_tokens))
            p[:cut] = d[:cut]
        prompts.append(p)
    # rounds alternate the fleet sizes, so a noisy moment on a shared machine hits each;
    # each figure is the median over rounds, with every round kept in the JSON
    per_round: dict[int, list[dict]] = {n: [] for n in args.workers}
    for k in range(args.rounds):
        for n in args.workers:
            per_round[n].append(measure(n, args, docs, prompts, rng, turn=k))
            print(f"round {k + 1}/{args.rounds}: {n} workers done", file=sys.stderr, flush=True)
    rows = [median_row(per_round[n]) for n in args.workers]
    hdr = (
        f"{'workers':>7} {'entries':>9} {'kv med':>8} {'kv p99':>8} {'inflight':>8} "
        f"{'no-reuse':>8} {'default':>8} {'previous':>8} {'capped':>8} {'+filters':>8} "
        f"{'approx':>7} "
        f"{'hash':>7} {'query':>7} "
        f"{'overhead':>8} {'rr med':>7} {'kv/rr':>6}"
    )
    print(
        f"core backend: {core.backend}; prompt {args.prompt_tokens} tokens, block "
        f"{args.block_size}; {args.decisions} decisions; times in microseconds"
    )
    print(hdr)
    for x in rows:
        print(
            f"{x['workers']:>7} {x['indexed_entries']:>9} {x['kv_median_us']:>8.1f} "
            f"{x['kv_p99_us']:>8.1f} {x['kv_inflight_median_us']:>8.1f} "
            f"{x['kv_inflight_no_reuse_median_us']:>8.1f} {x['default_inflight_median_us']:>8.1f} "
            f"{x['previous_default_inflight_median_us']:>8.1f} "
            f"{x['capped_default_inflight_median_us']:>8.1f} "
            f"{x['kv_with_filters_median_us']:>8.1f} "
            f"{x['approx_median_us']:>7.1f} "
            f"{x['hash_median_us']:>7.1f} {x['query_median_us']:>7.1f} "
            f"{x['router_overhead_median_us']:>8.1f} {x['round_robin_median_us']:>7.1f} "
            f"{x['kv_over_round_robin']:>6.1f}"
        )
    out = {
        "benchmark": "bench_router",
        "command": "python benchmarks/bench_router.py " + " ".join(argv or sys.argv[1:]),
        "core_backend": core.backend,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "load_average_after": os.getloadavg(),
        "params": vars(args),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

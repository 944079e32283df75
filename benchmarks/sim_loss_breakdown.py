"""Where a policy's hits go short of the one-shared-LRU bound, measured in one replay.

For every request the replay asks, right after the routing decision and with the engines'
own caches in view (god's view, not the router's):

* **held nowhere**: prompt blocks the one-shared-LRU bound hits but no engine's cache (device
  or host) holds at decision time: the partitioned caches evicted them or held duplicates;
* **held, not used**: blocks the engine holding the longest prefix has beyond the chosen
  engine's, split by what the policy decided (for kvplug's routing, the affinity counter that
  moved: ``guarded`` = the TTFT or work guard sent the request away from the holder,
  ``protected``, ``rescued``, ``spread``, ``kept_kv``; other routers: ``moved``);
* **evicted before admission**: held by the chosen engine at the decision, gone at admission.

Two checks on the held-nowhere part, sampled every ``--sample`` decisions: how many of the
device blocks the engines hold are copies of a block another engine holds (capacity the one
shared LRU has and the partitions spend twice), and each engine's cache lifetime per 10-minute
window, capacity / blocks evicted in it (an LRU's characteristic time: partitions evicting at
equal lifetimes keep what one shared LRU of their memory would, up to the granularity of
requests; unequal ones evict some blocks younger than the shared LRU would).

It lists the largest "held, not used" decisions with what the holder had queued (the engine's
waiting and in-prefill requests: prompt tokens, tokens still to compute, seconds since
arrival), and, for the trace, the gap between a session's turns (a follow-up's arrival after the
request it shares its longest prefix with).

    python benchmarks/sim_loss_breakdown.py                           # default routing, cached end
    python benchmarks/sim_loss_breakdown.py --policy kv --steptime causal --view realistic
    python benchmarks/sim_loss_breakdown.py --workload agentic --json /tmp/x.json

Prints the breakdown; writes JSON (default benchmarks/results/sim_loss_breakdown.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench_routing_quality import add_engine_options  # noqa: E402

from kvplug.sim.bench import BenchSpec, fleet_lru_hits  # noqa: E402
from kvplug.sim.policies import parse_policy  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402
from kvplug.sim.virtual import replay  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# affinity counters that name a decision (kept_kv counts every decision affinity left alone)
DECISION_TAGS = ("guarded", "balanced", "protected", "rescued", "spread", "affinity", "kept_kv")


def policy_counters(router) -> dict[str, int]:
    policy = getattr(router, "policy", None)
    stats = policy.stats() if policy is not None else None
    return dict(stats) if isinstance(stats, dict) else {}


def decision_tag(before: dict[str, int], after: dict[str, int]) -> str:
    moved = [k for k in DECISION_TAGS if after.get(k, 0) != before.get(k, 0)]
    return moved[0] if moved else "moved"


def session_gaps(records, block_tokens: int, min_blocks: int = 8) -> list[float]:
    """Per follow-up (at least ``min_blocks`` leading blocks seen before), seconds since the
    arrival of the latest request holding its longest seen prefix."""
    last: dict[int, int] = {}
    gaps = []
    for i, r in enumerate(records):
        ids = r.hash_ids[: r.input_length // block_tokens]
        seen, prev = 0, -1
        for h in ids:
            if h not in last:
                break
            seen, prev = seen + 1, last[h]
        if seen >= min_blocks:
            gaps.append(r.arrival_s - records[prev].arrival_s)
        for h in ids:
            last[h] = i
    return gaps


def duplicate_share(copies: list[tuple[float, int, int]]) -> float | None:
    """Mean share of the engines' device blocks that are copies (held elsewhere too), over the
    samples after the first tenth of the run (the caches are filling before)."""
    later = copies[len(copies) // 10 :]
    held = sum(c[1] for c in later)
    return (held - sum(c[2] for c in later)) / held if held else None


def cache_lifetimes(
    evicted_at: list[tuple[float, dict[str, int]]], capacity: dict[str, int], window: float = 600.0
) -> dict[float, dict[str, float]]:
    """Per window (its start, s) and engine: capacity / blocks evicted in it x the window, for
    windows in which every engine evicted (a filling cache has no lifetime yet)."""
    out: dict[float, dict[str, float]] = {}
    if not evicted_at:
        return out
    start, first = evicted_at[0]
    for t, counts in evicted_at[1:]:
        if t - start < window:
            continue
        span = t - start
        evicted = {w: counts[w] - first.get(w, 0) for w in counts}
        if all(evicted.values()):
            out[start] = {w: capacity[w] * span / n for w, n in sorted(evicted.items())}
        start, first = t, counts
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="affinity-fitted")
    ap.add_argument("--workload", default=None, help="a generated workload (default: the trace)")
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format trace file instead of the bundled one"
    )
    ap.add_argument("--steptime", default="cached", help="causal or cached (default cached)")
    ap.add_argument("--view", default="ideal", choices=sorted(PRESETS))
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--top", type=int, default=15, help="largest held-not-used decisions listed")
    ap.add_argument("--sample", type=int, default=200, help="decisions between cache samples")
    ap.add_argument("--json", default=str(RESULTS / "sim_loss_breakdown.json"))
    add_engine_options(ap)
    args = ap.parse_args(argv)

    spec = BenchSpec(
        policies=[args.policy],
        n_engines=args.engines,
        workload=args.workload,
        trace=args.trace,
        link=PRESETS[args.view],
        steptime=args.steptime,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        kv_allocation=args.kv_allocation,
    )
    records = spec.records()
    bt = spec.block_tokens
    pol = parse_policy(args.policy)
    seen: dict[str, dict] = {}
    capacity: dict[str, int] = {}
    copies: list[tuple[float, int, int]] = []  # (t, device blocks held, distinct blocks)
    evicted_at: list[tuple[float, dict[str, int]]] = []  # (t, each engine's evictions so far)

    def observe(t, rreq, decision, router, engines) -> None:
        if len(seen) % args.sample == 0:
            held_blocks: Counter[int] = Counter()
            for e in engines.values():
                held_blocks.update(e.cache.device_blocks())
            copies.append((t, sum(held_blocks.values()), len(held_blocks)))
            evicted_at.append((t, {w: e.cache.counters["evicted"] for w, e in engines.items()}))
            capacity.update({w: e.cache.capacity for w, e in engines.items()})
        hashes = [int(h) for h in rreq.block_hashes]
        held = {}
        for wid, e in engines.items():
            device, host = e.cache.match_prefix(hashes)
            held[wid] = device + host
        best = max(held, key=held.__getitem__)
        counters = policy_counters(router)
        holder = engines[best]
        queue = [*holder.prefilling, *holder.waiting]
        seen[rreq.request_id] = {
            "t": t,
            "held": held,
            "to": decision.worker_id,
            "holder": best,
            "counters": counters,
            "holder_queue": [
                (q.prompt_len, q.prompt_len - q.computed, round(t - q.arrival, 1)) for q in queue
            ],
        }

    print(
        f"replaying {args.policy} on {args.workload or args.trace or 'the conversation trace'} "
        f"({len(records)} requests, {args.engines} engines, {args.steptime}, {args.view})...",
        flush=True,
    )
    t0 = time.perf_counter()
    res = replay(
        records,
        pol.router_config(bt),
        spec.replay_config(pol.feed_events),
        policy=pol.name,
        router_factory=pol.router_factory(),
        observe=observe,
    )
    wall = time.perf_counter() - t0
    bound = fleet_lru_hits(records, args.engines * spec.capacity_blocks, bt)
    total = sum(len(r.hash_ids[: r.input_length // bt]) for r in records)

    by_tag: Counter[str] = Counter()
    count_by_tag: Counter[str] = Counter()
    held_nowhere = evicted = hit_sum = held_sum = 0
    lost_rows = []
    prev_counters: dict[str, int] = {}
    for rec_bound, req in zip(bound, res.requests, strict=True):
        info = seen.get(req.request_id)
        if info is None:  # rejected before a decision
            continue
        tag = decision_tag(prev_counters, info["counters"]) if info["counters"] else "moved"
        prev_counters = info["counters"]
        held = info["held"]
        best = held[info["holder"]]
        at_chosen = held[info["to"]]
        got = req.hit_device + req.hit_host
        hit_sum += got
        held_sum += best
        held_nowhere += max(rec_bound - best, 0)
        evicted += max(at_chosen - got, 0)
        if best > at_chosen:
            by_tag[tag] += best - at_chosen
            count_by_tag[tag] += 1
            lost_rows.append(
                {
                    "request": req.request_id,
                    "t": round(info["t"], 1),
                    "blocks": req.prompt_blocks,
                    "forgone": best - at_chosen,
                    "decision": tag,
                    "ttft_s": round(req.first_token - req.arrival, 2),
                    "holder_queue": info["holder_queue"],
                }
            )
    bound_sum = sum(bound)
    lost_rows.sort(key=lambda r: -r["forgone"])

    def pts(blocks: int) -> str:  # points of the prompt blocks, and share of the bound
        return f"{100 * blocks / total:5.2f} pts ({100 * blocks / bound_sum:4.1f} % of the bound)"

    bound_pts = 100 * bound_sum / total
    print(f"\n{args.policy}: hit {pts(hit_sum)}; bound {bound_pts:.2f} % ({wall:.0f} s)")
    print(f"  held by some engine at decision:  {pts(held_sum)}")
    print(f"  bound's blocks held nowhere:      {pts(held_nowhere)}")
    print(f"  held, not used (by decision):     {pts(sum(by_tag.values()))}")
    for tag, blocks in by_tag.most_common():
        print(f"    {tag:<12} {pts(blocks)} in {count_by_tag[tag]} decisions")
    print(f"  evicted between decision and admission: {pts(evicted)}")
    if lost_rows:
        print("\nlargest held-not-used decisions (holder's queue: prompt, to compute, age s):")
        for r in lost_rows[: args.top]:
            q = ", ".join(f"{p}/{n}/{a}" for p, n, a in r["holder_queue"][:4])
            print(
                f"  t={r['t']:>7} {r['forgone']:>4}/{r['blocks']:<4} blocks {r['decision']:<10}"
                f" TTFT {r['ttft_s']:>6} s  holder queue: {q or '-'}"
            )
    dup_share = duplicate_share(copies)
    lifetimes = cache_lifetimes(evicted_at, capacity)
    if dup_share is not None:
        print(f"\ndevice blocks that are copies of another engine's: {100 * dup_share:.2f} %")
    if lifetimes:
        spread = [max(w.values()) / min(w.values()) for w in lifetimes.values() if w]
        print(
            "cache lifetime per engine and 10-minute window (capacity / evictions), s:\n"
            + "\n".join(
                f"  {int(t0):>5} s: " + " ".join(f"{v:5.0f}" for v in w.values())
                for t0, w in lifetimes.items()
            )
            + f"\n  longest / shortest in a window: {min(spread):.2f}-{max(spread):.2f}x"
        )
    gaps = session_gaps(records, bt) if args.workload is None else []
    gap_q = [round(x, 1) for x in statistics.quantiles(gaps, n=20)] if len(gaps) > 20 else []
    if gap_q:
        print(
            f"\nturn gaps ({len(gaps)} follow-ups): p5 {gap_q[0]} s, p50 {gap_q[9]} s, "
            f"p95 {gap_q[18]} s"
        )
    out = {
        "command": "python benchmarks/sim_loss_breakdown.py " + " ".join(argv or sys.argv[1:]),
        "policy": args.policy,
        "workload": args.workload or args.trace or "conversation",
        "steptime": args.steptime,
        "view": args.view,
        "engines": args.engines,
        "prompt_blocks": total,
        "bound_blocks": bound_sum,
        "hit_blocks": hit_sum,
        "held_blocks": held_sum,
        "held_nowhere_blocks": held_nowhere,
        "held_not_used_blocks": dict(by_tag),
        "held_not_used_decisions": dict(count_by_tag),
        "evicted_before_admission_blocks": evicted,
        "largest": lost_rows[: args.top],
        "turn_gap_quantiles_s": gap_q,
        "duplicate_share_of_device_blocks": dup_share,
        "cache_lifetime_s_by_window": {str(int(k)): v for k, v in lifetimes.items()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

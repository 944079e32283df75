"""Benchmark of kvplug's C core against the pure-Python reference (and Dynamo's RadixTree).

Seeded synthetic workload: popular system prompts (Zipf), multi-turn sessions that grow, unique
tails; 16-token blocks; N stored blocks (holdings) spread over 8, 64 and 512 workers. Reports:

* apply throughput (blocks/s): store_tokens per event (hashing included), store of
  precomputed hashes, and KvIndex.apply_many over normalised BlockStored events;
* query latency median / p99 (us) through the Python binding for 128 / 1,024 / 8,192-token
  prompts (precomputed hashes, reused output buffer), plus hash + query end to end;
* hashing throughput (tokens/s) from a numpy buffer and from a Python list;
* memory per million stored blocks (the C index's own accounting and the RSS delta);
* the reference on fewer operations in the same run, and ratios; NVIDIA Dynamo's RadixTree
  (``ai-dynamo-runtime``) on the identical workload when it is installed.

    python benchmarks/bench_core.py            # 1M blocks (a few minutes on 2 cores)
    python benchmarks/bench_core.py --small    # 100k blocks, quick

Writes benchmarks/results/bench_core.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# numpy's OpenBLAS threads spin on a small shared machine and steal the core from the benchmark
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvplug import _reference as ref  # noqa: E402
from kvplug.core import load_backend  # noqa: E402
from kvplug.events import BlockStored  # noqa: E402
from kvplug.index import KvIndex  # noqa: E402

core = load_backend("c")
BS = 16
VOCAB = 128_000
ENGINE_SEED = 0xE11E  # engine hashes: a different namespace of our own hash (like vLLM's)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Event:
    worker: int
    parent: int | None  # engine hash of the parent block
    engine: np.ndarray  # u64 engine hashes
    seq: np.ndarray  # u64 kvplug sequence hashes (precomputed)
    local: np.ndarray  # u64 local hashes (Dynamo's tokens_hash)
    tokens: np.ndarray  # uint32 tokens of the blocks


@dataclass
class Workload:
    workers: int
    events: list[Event]
    holdings: int
    sessions: list[np.ndarray]  # block-content ids of each session's chain
    content: np.ndarray  # (n_unique_blocks, BS) uint32


def make_workload(workers: int, target_blocks: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    n_sys = 64
    sys_len = rng.integers(16, 128, n_sys)  # system prompts: 256 .. 2,048 tokens
    popularity = 1.0 / np.arange(1, n_sys + 1)
    popularity /= popularity.sum()
    next_id = 0
    sys_ids = []
    for n in sys_len:
        sys_ids.append(np.arange(next_id, next_id + n))
        next_id += n
    # chains are planned first (block ids), content and hashes come after
    plans: list[tuple[int, int, np.ndarray, list[tuple[int, int]]]] = []
    sys_on_worker: set[tuple[int, int]] = set()
    holdings = 0
    while holdings < target_blocks:
        s = int(rng.choice(n_sys, p=popularity))
        w = int(rng.integers(workers))
        turns = int(rng.integers(1, 6))
        grow = rng.integers(4, 48, turns)
        chain = [sys_ids[s]]
        spans = []  # (start, end) block positions of each store event
        pos = len(sys_ids[s])
        if (w, s) not in sys_on_worker:
            sys_on_worker.add((w, s))
            spans.append((0, pos))
            holdings += pos
        for g in grow:
            chain.append(np.arange(next_id, next_id + g))
            next_id += g
            spans.append((pos, pos + g))
            pos += g
            holdings += g
        plans.append((w, s, np.concatenate(chain), spans))
    content = rng.integers(0, VOCAB, size=(next_id, BS), dtype=np.uint32)
    events: list[Event] = []
    sessions = []
    for w, _s, chain, spans in plans:
        toks = content[chain].ravel()
        local, seq = core.hash_blocks(toks, BS)
        _, eng = core.hash_blocks(toks, BS, ENGINE_SEED, with_local=False)
        sessions.append(chain)
        for a, b in spans:
            events.append(
                Event(
                    worker=w,
                    parent=None if a == 0 else int(eng[a - 1]),
                    engine=eng[a:b],
                    seq=seq[a:b],
                    local=local[a:b],
                    tokens=toks[a * BS : b * BS],
                )
            )
    return Workload(workers, events, holdings, sessions, content)


def make_queries(wl: Workload, n_tokens: int, count: int, seed: int):
    """Prompts of n_tokens: an existing session's chain, cut or extended with new blocks."""
    rng = np.random.default_rng(seed)
    nb = n_tokens // BS
    out = []
    for _ in range(count):
        chain = wl.sessions[int(rng.integers(len(wl.sessions)))]
        toks = wl.content[chain[:nb]].ravel()
        if len(toks) < n_tokens:
            extra = rng.integers(0, VOCAB, n_tokens - len(toks), dtype=np.uint32)
            toks = np.concatenate([toks, extra])
        local, seq = core.hash_blocks(toks, BS)
        out.append((toks, local, seq))
    return out


# ---- measurements ------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def time_queries(fn, queries) -> tuple[float, float]:
    lat = []
    for q in queries:
        t0 = time.perf_counter_ns()
        fn(q)
        lat.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(lat), pct(lat, 99)


def apply_c_tokens(idx, events) -> float:
    t0 = time.perf_counter()
    for ev in events:
        idx.store_tokens(ev.worker, 0, ev.parent, ev.engine, ev.tokens, BS)
    return time.perf_counter() - t0


def apply_c_hashes(idx, events) -> float:
    t0 = time.perf_counter()
    for ev in events:
        idx.store(ev.worker, 0, ev.engine, ev.seq)
    return time.perf_counter() - t0


def batched_by_worker(events, max_blocks: int = 65536):
    """Concatenate consecutive events per worker into store() batches of up to max_blocks."""
    per: dict[int, list[Event]] = {}
    for ev in events:
        per.setdefault(ev.worker, []).append(ev)
    out = []
    for w, evs in per.items():
        eng = np.concatenate([e.engine for e in evs])
        seq = np.concatenate([e.seq for e in evs])
        for a in range(0, len(eng), max_blocks):
            out.append((w, eng[a : a + max_blocks], seq[a : a + max_blocks]))
    return out


def apply_c_batches(idx, batches) -> float:
    t0 = time.perf_counter()
    for w, eng, seq in batches:
        idx.store(w, 0, eng, seq)
    return time.perf_counter() - t0


def apply_kvindex(events, workers: int) -> tuple[float, int]:
    kv = KvIndex(BS)
    for w in range(workers):
        kv.add_endpoint(f"w{w}")
    evs = [
        BlockStored(
            worker_id=f"w{ev.worker}",
            parent_engine_hash=ev.parent,
            engine_hashes=ev.engine,
            token_ids=ev.tokens,
        )
        for ev in events
    ]
    t0 = time.perf_counter()
    rep = kv.apply_many(evs)
    dt = time.perf_counter() - t0
    assert rep.dropped == 0, rep
    return dt, rep.blocks


def first_blocks(events, n_blocks):
    out, total = [], 0
    for ev in events:
        if total >= n_blocks:
            break
        out.append(ev)
        total += len(ev.engine)
    return out, total


def dynamo_events(events):
    out = []
    for i, ev in enumerate(events):
        blocks = [
            {"block_hash": int(e), "tokens_hash": int(h)}
            for e, h in zip(ev.engine.tolist(), ev.local.tolist(), strict=True)
        ]
        body = {
            "event_id": i,
            "data": {"stored": {"parent_hash": ev.parent, "blocks": blocks}},
            "dp_rank": 0,
        }
        out.append((ev.worker, json.dumps(body).encode()))
    return out


def bench_workers(workers: int, args, dynamo) -> dict:
    res: dict = {"workers": workers}
    wl = make_workload(workers, args.blocks, seed=1000 + workers)
    n_blocks = sum(len(ev.engine) for ev in wl.events)
    res["stored_blocks"] = n_blocks
    res["events"] = len(wl.events)
    res["blocks_per_event"] = n_blocks / len(wl.events)

    # C: store_tokens (hashing included), then a fresh index with precomputed hashes
    gc.collect()
    rss0 = rss_bytes()
    idx = core.Index()
    dt = apply_c_tokens(idx, wl.events)
    rss1 = rss_bytes()
    res["c_apply_tokens_blocks_per_s"] = n_blocks / dt
    st = idx.stats()
    assert st["entries"] == n_blocks, (st, n_blocks)
    res["c_memory_bytes"] = idx.memory_bytes()
    res["c_mib_per_million_blocks"] = idx.memory_bytes() / 2**20 / (n_blocks / 1e6)
    res["c_rss_mib_per_million_blocks"] = (rss1 - rss0) / 2**20 / (n_blocks / 1e6)
    res["distinct_blocks"] = st["blocks"]
    idx2 = core.Index()
    res["c_apply_hashes_blocks_per_s"] = n_blocks / apply_c_hashes(idx2, wl.events)
    idx2 = core.Index()
    # a router knows its fleet's KV capacity (engine maps are per endpoint: spread over workers)
    idx2.reserve(st["blocks"], st["engine_mappings"], workers)
    res["c_apply_tokens_presized_blocks_per_s"] = n_blocks / apply_c_tokens(idx2, wl.events)
    batches = batched_by_worker(wl.events)
    idx2 = core.Index()
    res["c_apply_batched_blocks_per_s"] = n_blocks / apply_c_batches(idx2, batches)
    idx2 = core.Index()
    idx2.reserve(st["blocks"], st["engine_mappings"], workers)
    res["c_apply_batched_presized_blocks_per_s"] = n_blocks / apply_c_batches(idx2, batches)
    idx2 = None
    batches = None

    sub, sub_blocks = first_blocks(wl.events, args.ref_blocks)
    dt, blocks = apply_kvindex(wl.events if not args.small else sub, workers)
    res["kvindex_apply_many_blocks_per_s"] = blocks / dt

    ridx = ref.Index()
    t0 = time.perf_counter()
    for ev in sub:
        ridx.store_tokens(ev.worker, 0, ev.parent, ev.engine.tolist(), ev.tokens.tolist(), BS)
    res["ref_apply_tokens_blocks_per_s"] = sub_blocks / (time.perf_counter() - t0)
    res["ref_apply_blocks"] = sub_blocks

    # queries against the full C index
    out = core.QueryResult()
    res["queries"] = {}
    for n_tok in (128, 1024, 8192):
        qs = make_queries(wl, n_tok, args.queries, seed=n_tok + workers)
        q: dict = {}
        hashes = [s for _, _, s in qs]
        for h in hashes[:50]:  # warm caches and buffers
            idx.query(h, out)
        q["c_median_us"], q["c_p99_us"] = time_queries(lambda h: idx.query(h, out), hashes)
        walked = []
        for h in hashes:
            walked.append(idx.query(h, out).walked)
        q["mean_walked_blocks"] = float(np.mean(walked))
        toks = [t for t, _, _ in qs]
        q["c_hash_and_query_median_us"], q["c_hash_and_query_p99_us"] = time_queries(
            lambda t: idx.query(core.hash_blocks(t, BS, with_local=False)[1], out), toks
        )
        # the reference on a small index (its prefix of the events) and fewer queries
        rq = [list(map(int, s)) for s in hashes[: args.ref_queries]]
        q["ref_median_us"], q["ref_p99_us"] = time_queries(ridx.query, rq)
        q["ratio_ref_over_c"] = q["ref_median_us"] / q["c_median_us"]
        res["queries"][n_tok] = q
        if dynamo is not None:
            res.setdefault("_dyn_queries", {})[n_tok] = [list(map(int, l_)) for _, l_, _ in qs]
    del ridx

    if dynamo is not None:
        res.update(bench_dynamo(dynamo, wl, res.pop("_dyn_queries"), args))
    idx = None
    gc.collect()
    return res


def bench_dynamo(dynamo, wl: Workload, queries: dict, args) -> dict:
    out: dict = {}
    evs = dynamo_events(wl.events)
    n_blocks = sum(len(ev.engine) for ev in wl.events)
    gc.collect()
    rss0 = rss_bytes()
    tree = dynamo.RadixTree()
    t0 = time.perf_counter()
    for w, body in evs:
        tree.apply_event(w, body)
    tree.find_matches([0])  # applies are queued to a worker thread: wait for them
    dt = time.perf_counter() - t0
    time.sleep(0.2)
    out["dynamo_apply_blocks_per_s"] = n_blocks / dt
    out["dynamo_rss_mib_per_million_blocks"] = (rss_bytes() - rss0) / 2**20 / (n_blocks / 1e6)
    out["dynamo_queries"] = {}
    for n_tok, qs in queries.items():
        qs = qs[: args.dynamo_queries]
        for q in qs[:20]:
            tree.find_matches(q)
        med, p99 = time_queries(tree.find_matches, qs)
        out["dynamo_queries"][n_tok] = {"median_us": med, "p99_us": p99}
    del tree
    return out


def bench_hashing(args, dynamo) -> dict:
    rng = np.random.default_rng(5)
    n = args.hash_tokens
    toks = rng.integers(0, VOCAB, n, dtype=np.uint32)
    res: dict = {}
    core.hash_blocks(toks[: 1 << 16], BS, with_local=False)
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        core.hash_blocks(toks, BS, with_local=False)
        reps.append(time.perf_counter() - t0)
    res["c_numpy_tokens_per_s"] = n / min(reps)
    small = toks[: 1 << 20].tolist()
    t0 = time.perf_counter()
    core.hash_blocks(small, BS, with_local=False)
    res["c_list_tokens_per_s"] = len(small) / (time.perf_counter() - t0)
    tiny = small[: args.ref_hash_tokens]
    t0 = time.perf_counter()
    ref.hash_blocks(tiny, BS)
    res["ref_list_tokens_per_s"] = len(tiny) / (time.perf_counter() - t0)
    res["ratio_c_numpy_over_ref"] = res["c_numpy_tokens_per_s"] / res["ref_list_tokens_per_s"]
    if dynamo is not None:
        t0 = time.perf_counter()
        dynamo.compute_block_hash_for_seq(small, BS)
        res["dynamo_list_tokens_per_s"] = len(small) / (time.perf_counter() - t0)
    return res


# ---- report ------------------------------------------------------------------------------------
def fmt_rate(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def table(results: dict) -> str:
    lines = []
    h = results["hashing"]
    lines.append("hashing (tokens/s)")
    lines.append(f"  C from numpy uint32 buffer   {fmt_rate(h['c_numpy_tokens_per_s'])}")
    lines.append(f"  C from Python list           {fmt_rate(h['c_list_tokens_per_s'])}")
    lines.append(
        f"  reference (list)             {fmt_rate(h['ref_list_tokens_per_s'])}"
        f"   C/ref = {h['ratio_c_numpy_over_ref']:.0f}x"
    )
    if "dynamo_list_tokens_per_s" in h:
        d = h["dynamo_list_tokens_per_s"]
        lines.append(
            f"  Dynamo compute_block_hash_for_seq (list) {fmt_rate(d)}"
            f"   C numpy/Dynamo = {h['c_numpy_tokens_per_s'] / d:.1f}x,"
            f" C list/Dynamo = {h['c_list_tokens_per_s'] / d:.1f}x"
        )
    for r in results["workers"]:
        w = r["workers"]
        lines.append("")
        lines.append(
            f"{w} workers: {r['stored_blocks']:,} stored blocks"
            f" ({r['distinct_blocks']:,} distinct),"
            f" {r['events']:,} events ({r['blocks_per_event']:.1f} blocks/event)"
        )
        lines.append(
            f"  apply blocks/s: C store_tokens {fmt_rate(r['c_apply_tokens_blocks_per_s'])},"
            f" presized {fmt_rate(r['c_apply_tokens_presized_blocks_per_s'])},"
            f" C store(hashes) {fmt_rate(r['c_apply_hashes_blocks_per_s'])},"
            f" batched {fmt_rate(r['c_apply_batched_blocks_per_s'])}"
            f" (presized {fmt_rate(r['c_apply_batched_presized_blocks_per_s'])}),"
            f" KvIndex.apply_many {fmt_rate(r['kvindex_apply_many_blocks_per_s'])},"
            f" reference {fmt_rate(r['ref_apply_tokens_blocks_per_s'])}"
            f" (C/ref {r['c_apply_tokens_blocks_per_s'] / r['ref_apply_tokens_blocks_per_s']:.0f}x)"
        )
        if "dynamo_apply_blocks_per_s" in r:
            d = r["dynamo_apply_blocks_per_s"]
            lines.append(
                f"  Dynamo RadixTree.apply_event {fmt_rate(d)} blocks/s"
                f" (C store_tokens/Dynamo {r['c_apply_tokens_blocks_per_s'] / d:.1f}x)"
            )
        lines.append(
            f"  memory: C accounting {r['c_mib_per_million_blocks']:.1f} MiB/M blocks,"
            f" RSS delta {r['c_rss_mib_per_million_blocks']:.1f} MiB/M blocks"
            + (
                f"; Dynamo RSS delta {r['dynamo_rss_mib_per_million_blocks']:.1f} MiB/M blocks"
                if "dynamo_rss_mib_per_million_blocks" in r
                else ""
            )
        )
        lines.append(
            "  query (us)   C med   C p99  hash+query med   ref med  ref/C"
            + ("   Dynamo med  Dynamo p99  Dynamo/C" if "dynamo_queries" in r else "")
            + "   walked"
        )
        for n_tok, q in r["queries"].items():
            row = (
                f"  {n_tok:>5} tok  {q['c_median_us']:6.2f}  {q['c_p99_us']:6.2f}"
                f"  {q['c_hash_and_query_median_us']:14.2f}  {q['ref_median_us']:8.1f}"
                f"  {q['ratio_ref_over_c']:5.0f}x"
            )
            if "dynamo_queries" in r:
                d = r["dynamo_queries"][n_tok]
                row += (
                    f"   {d['median_us']:10.2f}  {d['p99_us']:10.2f}"
                    f"  {d['median_us'] / q['c_median_us']:7.1f}x"
                )
            row += f"   {q['mean_walked_blocks']:.0f}"
            lines.append(row)
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The docs table (docs/core.md) from a results dict."""
    dyn = "dynamo_apply_blocks_per_s" in results["workers"][0]
    out = []
    h = results["hashing"]
    out.append("| hashing | tokens/s | vs reference | vs Dynamo |")
    out.append("| --- | --- | --- | --- |")
    d = h.get("dynamo_list_tokens_per_s")
    ref_rate = h["ref_list_tokens_per_s"]
    for label, key in (
        ("C, numpy uint32 buffer", "c_numpy_tokens_per_s"),
        ("C, Python list", "c_list_tokens_per_s"),
    ):
        out.append(
            f"| {label} | {fmt_rate(h[key])} | {h[key] / ref_rate:.0f}x | {h[key] / d:.1f}x |"
            if d
            else f"| {label} | {fmt_rate(h[key])} | {h[key] / ref_rate:.0f}x | - |"
        )
    out.append("")
    head = (
        "| workers | C store_tokens per event | same, presized | C store, 64k batches"
        " | same, presized | KvIndex.apply_many | reference"
    )
    head += " | Dynamo apply_event |" if dyn else " |"
    out.append(head)
    out.append("| --- " * (8 if dyn else 7) + "|")
    for r in results["workers"]:
        row = (
            f"| {r['workers']} | {fmt_rate(r['c_apply_tokens_blocks_per_s'])}"
            f" | {fmt_rate(r['c_apply_tokens_presized_blocks_per_s'])}"
            f" | {fmt_rate(r['c_apply_batched_blocks_per_s'])}"
            f" | {fmt_rate(r['c_apply_batched_presized_blocks_per_s'])}"
            f" | {fmt_rate(r['kvindex_apply_many_blocks_per_s'])}"
            f" | {fmt_rate(r['ref_apply_tokens_blocks_per_s'])}"
        )
        if dyn:
            row += f" | {fmt_rate(r['dynamo_apply_blocks_per_s'])}"
        out.append(row + " |")
    out.append("")
    head = "| workers | prompt | C median us | C p99 us | hash+query median us | ref median us"
    head += " | Dynamo median us | Dynamo p99 us | Dynamo / C |" if dyn else " |"
    out.append(head)
    out.append("| --- " * (9 if dyn else 6) + "|")
    for r in results["workers"]:
        for n_tok, q in r["queries"].items():
            row = (
                f"| {r['workers']} | {n_tok} | {q['c_median_us']:.2f} | {q['c_p99_us']:.2f}"
                f" | {q['c_hash_and_query_median_us']:.2f} | {q['ref_median_us']:.1f}"
            )
            if dyn:
                dq = r["dynamo_queries"][n_tok]
                row += (
                    f" | {dq['median_us']:.2f} | {dq['p99_us']:.2f}"
                    f" | {dq['median_us'] / q['c_median_us']:.1f}x"
                )
            out.append(row + " |")
    out.append("")
    out.append("| workers | C MiB per M blocks (own accounting) | C RSS delta | Dynamo RSS delta |")
    out.append("| --- | --- | --- | --- |")
    for r in results["workers"]:
        dr = r.get("dynamo_rss_mib_per_million_blocks")
        out.append(
            f"| {r['workers']} | {r['c_mib_per_million_blocks']:.1f}"
            f" | {r['c_rss_mib_per_million_blocks']:.1f}"
            f" | {'-' if dr is None else f'{dr:.1f}'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="100k blocks, fewer queries")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--no-dynamo", action="store_true", help="skip ai-dynamo-runtime")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_core.json"))
    args = ap.parse_args(argv)
    args.blocks = 100_000 if args.small else 1_000_000
    args.queries = 300 if args.small else 2000
    args.dynamo_queries = 100 if args.small else 500
    args.ref_blocks = 5_000 if args.small else 20_000
    args.ref_queries = 20 if args.small else 50
    args.hash_tokens = 4_000_000 if args.small else 64_000_000
    args.ref_hash_tokens = 16_384

    dynamo = None
    dynamo_note = None
    if not args.no_dynamo:
        try:
            import dynamo._core as dynamo  # type: ignore[import-not-found,no-redef]
        except Exception as err:  # noqa: BLE001 - any failure means "not available here"
            dynamo_note = f"ai-dynamo-runtime not available: {err}"
    results: dict = {
        "command": "python benchmarks/bench_core.py" + (" --small" if args.small else ""),
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg(),
        },
        "block_size": BS,
        "target_stored_blocks": args.blocks,
        "dynamo": dynamo_note or "ai-dynamo-runtime " + _dynamo_version(),
    }
    results["hashing"] = bench_hashing(args, dynamo)
    results["workers"] = [bench_workers(w, args, dynamo) for w in args.workers]
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    text = table(results)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    md = Path(args.out).with_suffix(".md")
    md.write_text(markdown(results) + "\n")
    print(f"\nwrote {args.out} and {md}")
    return 0


def _dynamo_version() -> str:
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())

"""kvplug's C core side by side with NVIDIA Dynamo's own indexer, alternating every round.

Both implementations get identical work, in the same round, one after the other (the order
flips every round), so a ratio is always taken between two measurements made moments apart on
the same (shared, noisy) machine; each ratio is reported as a range over the rounds.

Workload (seeded): 64 system prompts (Zipf popularity), multi-turn sessions that grow, pinned
to a random worker; 16-token blocks; ~1 M stored blocks spread over 8, 64 and 512 workers,
delivered as one store event per turn (~30 blocks). Like for like, per operation:

* apply: one call per store event on both sides, hashes precomputed on both sides (no hashing
  inside apply): kvplug ``Index.store(worker, 0, engine_hashes, block_hashes)`` with Python
  lists; Dynamo ``RadixTree.apply_event(worker, json_bytes)`` with its KV-event JSON (its only
  input form; encoded before the clock starts). The clock stops when the index answers a probe
  query with the last event applied (Dynamo applies on a background thread; the probe goes
  through the same queue, so its answer confirms every earlier event). Wall and process CPU
  time (all threads) are both reported.
* query: a Python list of block hashes in, per-worker scores out as a Python dict on both
  sides: kvplug ``Index.query(list, out).scores()``, Dynamo ``find_matches(list).scores``;
  the same prompts, the same number of calls. Every answer is compared (round 1).
* hash + query: a prompt as a Python list of token ids in, scores dict out (the routing path):
  kvplug ``seq_hashes`` then ``query``; Dynamo ``compute_block_hash_for_seq`` then
  ``find_matches``.
* hashing: the token lists of store events (a Python list of ints, what a decoded vLLM event
  gives) and prompt lists, the two sides taking turns pass by pass (best of 10 each); kvplug
  ``seq_hashes(list, 16)``, Dynamo ``compute_block_hash_for_seq(list, 16)``; each returns
  what its own query takes (a numpy array of sequence hashes, a list). Timed twice: the 256
  events' lists built once and hashed pass after pass (~4 MB of int objects, out of the L2
  cache: bound by reading them), and as a subscriber has them, each side hashing lists it has
  just decoded from the events' msgpack bytes, 8 events at a time (in the cache).
* apply as ``kvplug serve`` runs it: the router pre-sizes its index for the fleet's KV
  capacity (``Router._presize_index``; here the fleet's caches are taken as just full, i.e. a
  capacity of the stored blocks), so the same apply is also timed into an index pre-sized
  with ``Index.reserve``, the reservation inside the clock (``kvplug_presized``: ratios and
  memory against the same Dynamo rounds; Dynamo's tree has no such call).
* the machine: Dynamo's calls are hand-offs to its background thread; on a VM an idle vCPU
  takes ~100 µs to wake for one, which an idle run would time instead of Dynamo's index. So one
  busy loop per other core runs at nice 19 for the whole run (yielding to Dynamo's thread at
  once); ``--no-keep-awake`` measures without it.
* memory: RSS delta of building the index in a fresh subprocess per side and round (the same
  inputs built first; ``gc.collect()`` and ``malloc_trim(0)`` before both readings, so freed
  heap is returned to the OS on both sides).

numpy inputs into kvplug (which Dynamo's API does not take) are reported separately and
labelled as such, as are kvplug-only figures (64 k-block batches into a pre-sized index).

    python benchmarks/bench_core.py                 # 1 M blocks, 8/64/512 workers, 5 rounds
    python benchmarks/bench_core.py --small         # 100 k blocks, 3 rounds, quick
    python benchmarks/bench_core.py --no-dynamo     # kvplug only (no ratios)

Needs ``ai-dynamo-runtime`` (``pip install -e '.[bench]'``) for the side by side. Prints
progress and a table; writes benchmarks/results/bench_core.json (and .md) and plots every
round's ratio against issue 14's aims (``--plot``, default docs/img/bench_core_ratios.png;
``--plot-from JSON`` draws it from a results file alone).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# numpy's OpenBLAS threads spin on a small shared machine and steal the core from the benchmark
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hostinfo

from figures import save_figure  # noqa: E402
from hostinfo import cpu_model  # noqa: E402

from kvplug.core import load_backend  # noqa: E402

core = load_backend("c")
BS = 16
VOCAB = 128_000
ENGINE_SEED = 0xE11E  # engine hashes: a different namespace of our own hash (like vLLM's)
PROMPT_LENGTHS = (128, 1024, 8192)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_libc = ctypes.CDLL(None)


def release_freed_heap() -> None:
    """Collect garbage and hand freed heap (every malloc arena) back to the OS."""
    gc.collect()
    if hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def load_dynamo():
    try:
        import dynamo._core as dynamo  # type: ignore[import-not-found]
    except Exception as err:  # noqa: BLE001 - any failure means "not available here"
        return None, f"ai-dynamo-runtime not available: {err}"
    try:
        from importlib.metadata import version

        ver = version("ai-dynamo-runtime")
    except Exception:  # noqa: BLE001
        ver = "?"
    return dynamo, f"ai-dynamo-runtime {ver}"


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Event:
    worker: int
    parent: int | None  # engine hash of the parent block
    engine: np.ndarray  # u64 engine hashes
    seq: np.ndarray  # u64 kvplug sequence hashes (precomputed)
    local: np.ndarray  # u64 local hashes: Dynamo's tokens_hash (Dynamo's own block hash)
    tokens: np.ndarray  # uint32 tokens of the blocks
    session: int  # index into Workload.sessions
    end: int  # the session's blocks 0 .. end are stored on the worker after this event


@dataclass
class Workload:
    workers: int
    events: list[Event]
    blocks: int
    sessions: list[np.ndarray]  # block-content ids of each session's chain
    content: np.ndarray  # (n_unique_blocks, BS) uint32


def make_workload(workers: int, target_blocks: int, seed: int, dynamo=None) -> Workload:
    """With `dynamo`, the local hashes are Dynamo's own (compute_block_hash_for_seq), so its
    radix tree is keyed exactly as a Dynamo router's would be; otherwise kvplug's."""
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
    plans: list[tuple[int, np.ndarray, list[tuple[int, int]]]] = []
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
        plans.append((w, np.concatenate(chain), spans))
    content = rng.integers(0, VOCAB, size=(next_id, BS), dtype=np.uint32)
    events: list[Event] = []
    sessions = []
    for w, chain, spans in plans:
        toks = content[chain].ravel()
        local, seq = core.hash_blocks(toks, BS)
        if dynamo is not None:
            local = np.array(dynamo.compute_block_hash_for_seq(toks.tolist(), BS), np.uint64)
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
                    session=len(sessions) - 1,
                    end=b,
                )
            )
    n_blocks = sum(len(ev.engine) for ev in events)
    return Workload(workers, events, n_blocks, sessions, content)


def prompt_tokens(wl: Workload, n_tokens: int, count: int, seed: int) -> list[np.ndarray]:
    """Prompts of n_tokens: an existing session's chain, cut or extended with new tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        chain = wl.sessions[int(rng.integers(len(wl.sessions)))]
        toks = wl.content[chain[: n_tokens // BS]].ravel()
        if len(toks) < n_tokens:
            extra = rng.integers(0, VOCAB, n_tokens - len(toks), dtype=np.uint32)
            toks = np.concatenate([toks, extra])
        out.append(toks)
    return out


def dynamo_event_json(i: int, ev: Event) -> bytes:
    """Dynamo's KV-event JSON for one store event (block_hash = the engine hash,
    tokens_hash = the local block hash its radix tree keys on)."""
    blocks = [
        {"block_hash": e, "tokens_hash": h}
        for e, h in zip(ev.engine.tolist(), ev.local.tolist(), strict=True)
    ]
    body = {
        "event_id": i,
        "data": {"stored": {"parent_hash": ev.parent, "blocks": blocks}},
        "dp_rank": 0,
    }
    return json.dumps(body).encode()


# ---- the two sides -----------------------------------------------------------------------------
class KvplugSide:
    """kvplug's C core through its Python binding (kvplug._core)."""

    name = "kvplug"

    def __init__(self) -> None:
        self.idx = None
        self.out = core.QueryResult()

    @staticmethod
    def apply_inputs(wl: Workload) -> list:
        return [(ev.worker, ev.engine.tolist(), ev.seq.tolist()) for ev in wl.events]

    @staticmethod
    def query_hashes(local: np.ndarray, seq: np.ndarray) -> list[int]:
        return seq.tolist()

    def new_index(self) -> None:
        self.idx = core.Index()

    def drop_index(self) -> None:
        self.idx = None

    def apply(self, inputs: list) -> None:
        store = self.idx.store
        for w, eng, seq in inputs:
            store(w, 0, eng, seq)

    def scores(self, hashes) -> dict:
        return self.idx.query(hashes, self.out).scores()

    def hash_and_scores(self, tokens: list[int]) -> dict:
        return self.idx.query(core.seq_hashes(tokens, BS), self.out).scores()

    @property
    def hash(self):
        """The library's hashing call itself, ``(tokens, block_size)`` (no wrapper of ours: the
        timers call both sides' the same way)."""
        return core.seq_hashes

    @staticmethod
    def worker_scores(scores: dict) -> dict[int, int]:
        return scores  # endpoint id == worker id here


class KvplugPresizedSide(KvplugSide):
    """kvplug as the router runs it: the index pre-sized for the fleet's capacity (here the
    stored blocks) by the first thing ``apply`` does, so the reservation is timed with it."""

    name = "kvplug_presized"

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def apply(self, inputs: list) -> None:
        self.idx.reserve(self.capacity, 0)
        super().apply(inputs)


class DynamoSide:
    """Dynamo's RadixTree (ai-dynamo-runtime) through its Python binding."""

    name = "dynamo"

    def __init__(self, dynamo) -> None:
        self.dyn = dynamo
        self.tree = None

    @staticmethod
    def apply_inputs(wl: Workload) -> list:
        return [(ev.worker, dynamo_event_json(i, ev)) for i, ev in enumerate(wl.events)]

    @staticmethod
    def query_hashes(local: np.ndarray, seq: np.ndarray) -> list[int]:
        return local.tolist()

    def new_index(self) -> None:
        self.tree = self.dyn.RadixTree()

    def drop_index(self) -> None:
        self.tree = None

    def apply(self, inputs: list) -> None:
        apply_event = self.tree.apply_event
        for w, body in inputs:
            apply_event(w, body)

    def scores(self, hashes) -> dict:
        return self.tree.find_matches(hashes).scores

    def hash_and_scores(self, tokens: list[int]) -> dict:
        return self.tree.find_matches(self.dyn.compute_block_hash_for_seq(tokens, BS)).scores

    @property
    def hash(self):
        """The library's hashing call itself, ``(tokens, block_size)``."""
        return self.dyn.compute_block_hash_for_seq

    @staticmethod
    def worker_scores(scores: dict) -> dict[int, int]:
        return {w: n for (w, _rank), n in scores.items()}


def both_hashes(toks: np.ndarray, dynamo) -> tuple[np.ndarray, np.ndarray]:
    """(Dynamo's local block hashes, kvplug's sequence hashes) of a prompt."""
    local, seq = core.hash_blocks(toks, BS)
    if dynamo is not None:
        local = np.array(dynamo.compute_block_hash_for_seq(toks.tolist(), BS), np.uint64)
    return local, seq


def probe_for_last_event(wl: Workload, dynamo) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The last event's session, cut where that event ends: only an index that has applied
    the last event credits its worker with all `end` blocks."""
    ev = wl.events[-1]
    toks = wl.content[wl.sessions[ev.session][: ev.end]].ravel()
    local, seq = both_hashes(toks, dynamo)
    return local, seq, ev.worker, ev.end


def apply_and_confirm(side, inputs, probe) -> tuple[float, float]:
    """(wall s, process CPU s) from the first apply call until the index confirms the last."""
    local, seq, worker, end = probe
    hashes = side.query_hashes(local, seq)
    side.new_index()
    gc.collect()
    gc.disable()
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        side.apply(inputs)
        got = side.worker_scores(side.scores(hashes)).get(worker)
        t1, c1 = time.perf_counter(), time.process_time()
    finally:
        gc.enable()
    if got != end:
        raise AssertionError(f"{side.name}: probe scored {got} for worker {worker}, want {end}")
    return t1 - t0, c1 - c0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def time_calls(fn, inputs: list) -> list[float]:
    """Latency of each call in µs (one perf_counter_ns pair per call on both sides)."""
    lat = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for x in inputs:
            t0 = clock()
            fn(x)
            lat.append((clock() - t0) / 1000)
    finally:
        gc.enable()
    return lat


def time_passes(fns: dict, inputs: list, repeat: int) -> dict[str, tuple[float, float]]:
    """Best total (wall s, process CPU s) of `repeat` passes over inputs per hashing function
    (called ``fn(tokens, BS)``), the functions taking turns pass by pass (order flipped every
    pass), so a burst of load from the neighbours hits both sides alike; a pass is short
    (~1 ms), hence many."""
    best = {name: (float("inf"), float("inf")) for name in fns}
    names = list(fns)
    gc.disable()
    try:
        for i in range(repeat):
            for name in names if i % 2 == 0 else names[::-1]:
                fn = fns[name]
                c0, t0 = time.process_time(), time.perf_counter()
                for x in inputs:
                    fn(x, BS)
                t1, c1 = time.perf_counter(), time.process_time()
                best[name] = (min(best[name][0], t1 - t0), min(best[name][1], c1 - c0))
    finally:
        gc.enable()
    return best


def time_decoded_passes(
    fns: dict, encoded: list[bytes], repeat: int, chunk: int = 8, decode=None
) -> dict[str, float]:
    """Best total wall time of `repeat` passes per function over msgpack-encoded token lists,
    each function hashing lists it has just decoded itself, as an event subscriber hashes the
    token ids of the batch it has just decoded: `chunk` events at a time (~3 k tokens, in the
    cache as they would be). Decoding, and freeing the lists decoded for the turn before, are
    outside the clock; the functions take turns chunk by chunk, the order flipping every
    chunk. Each chunk is one clock reading (~0.1 µs against a few µs of kvplug's hashing: a
    bias against kvplug, left in); each side's results are freed inside its own clock, as its
    caller would free them. ``decode``: bytes -> token list (default: msgspec's)."""
    decode = decode or msgspec.msgpack.Decoder(list[int]).decode
    chunks = [encoded[i : i + chunk] for i in range(0, len(encoded), chunk)]
    names = list(fns)
    best = dict.fromkeys(names, float("inf"))
    gc.disable()
    try:
        for i in range(repeat):
            total = dict.fromkeys(names, 0.0)
            for j, ch in enumerate(chunks):
                for name in names if (i + j) % 2 == 0 else names[::-1]:
                    fn = fns[name]
                    # the loop variable still holds the last list of the turn before: dropped
                    # inside the clock, its ~500 int objects were freed on the next side's time
                    # (+0.6 ns a token, whichever side ran next; issue 14's twenty-first pass)
                    lists = x = None
                    lists = [decode(b) for b in ch]  # fresh int objects, as decoded
                    t0 = time.perf_counter()
                    for x in lists:
                        fn(x, BS)
                    total[name] += time.perf_counter() - t0
            for name in names:
                best[name] = min(best[name], total[name])
    finally:
        gc.enable()
    return best


# ---- one worker count, all rounds --------------------------------------------------------------
def bench_workers(workers: int, args, sides: list) -> dict:
    t_start = time.perf_counter()
    dynamo = sides[1].dyn if len(sides) == 2 else None
    wl = make_workload(workers, args.blocks, seed=1000 + workers, dynamo=dynamo)
    res: dict = {
        "workers": workers,
        "stored_blocks": wl.blocks,
        "events": len(wl.events),
        "blocks_per_event": wl.blocks / len(wl.events),
    }
    log(
        f"[{workers} workers] workload: {wl.blocks:,} blocks in {len(wl.events):,} events"
        f" ({time.perf_counter() - t_start:.1f} s)"
    )
    probe = probe_for_last_event(wl, dynamo)
    apply_in = {s.name: s.apply_inputs(wl) for s in sides}
    apply_in[KvplugPresizedSide.name] = apply_in[KvplugSide.name]  # the same lists

    # queries: the same prompts on both sides; each side gets the hashes its index keys on
    q_in: dict[int, dict] = {}
    q_np: dict[int, list] = {}
    pipe_in: dict[int, list] = {}
    for n_tok in PROMPT_LENGTHS:
        toks = prompt_tokens(wl, n_tok, args.queries, seed=n_tok + workers)
        hashed = [both_hashes(t, dynamo) for t in toks]
        q_in[n_tok] = {s.name: [s.query_hashes(lo, sq) for lo, sq in hashed] for s in sides}
        q_np[n_tok] = [sq for _, sq in hashed]
        pipe_in[n_tok] = [t.tolist() for t in toks[: args.pipeline_prompts]]
    # hashing: the token lists of store events (what a decoded vLLM event carries)
    stride = max(1, len(wl.events) // args.hash_events)
    hash_events = [ev.tokens.tolist() for ev in wl.events[::stride][: args.hash_events]]
    hash_events_np = [ev.tokens for ev in wl.events[::stride][: args.hash_events]]
    hash_event_tokens = sum(len(t) for t in hash_events)
    hash_event_bytes = [msgspec.msgpack.encode(t) for t in hash_events]  # as vLLM sends them
    res["hash_event_tokens_mean"] = hash_event_tokens / len(hash_events)

    rounds: list[dict] = []
    mismatches = 0
    compared = 0
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        rd: dict = {"order": [s.name for s in order], "loadavg": os.getloadavg()}
        # apply (fresh index each), then queries against the index just built; both sides'
        # indexes are alive together so every measurement of the round sees the same state
        presized = KvplugPresizedSide(wl.blocks)
        apply_order = [order[0], presized, *order[1:]]  # kvplug's two applies between
        for s in apply_order if r % 2 == 0 else apply_order[::-1]:
            wall, cpu = apply_and_confirm(s, apply_in[s.name], probe)
            rd[f"{s.name}_apply_blocks_per_s"] = wl.blocks / wall
            rd[f"{s.name}_apply_blocks_per_cpu_s"] = wl.blocks / cpu
        presized.drop_index()
        release_freed_heap()
        for n_tok in PROMPT_LENGTHS:
            for s in order:
                lat = time_calls(s.scores, q_in[n_tok][s.name])
                rd[f"{s.name}_query_{n_tok}_median_us"] = statistics.median(lat)
                rd[f"{s.name}_query_{n_tok}_p99_us"] = pct(lat, 99)
            for s in order:
                lat = time_calls(s.hash_and_scores, pipe_in[n_tok])
                rd[f"{s.name}_hash_query_{n_tok}_median_us"] = statistics.median(lat)
            if r == 0 and len(sides) == 2:  # every answer, both sides
                for i in range(len(q_np[n_tok])):
                    a = [s.worker_scores(s.scores(q_in[n_tok][s.name][i])) for s in sides]
                    compared += 1
                    mismatches += a[0] != a[1]
                for toks in pipe_in[n_tok]:
                    a = [s.worker_scores(s.hash_and_scores(toks)) for s in sides]
                    compared += 1
                    mismatches += a[0] != a[1]
        # numpy hashes into kvplug (labelled; Dynamo takes lists only)
        lat = time_calls(sides[0].scores, q_np[PROMPT_LENGTHS[-1]])
        rd[f"kvplug_numpy_query_{PROMPT_LENGTHS[-1]}_median_us"] = statistics.median(lat)
        for s in sides:
            s.drop_index()
        release_freed_heap()
        # hashing: event token lists, then prompt lists (8,192 tokens)
        best = time_passes({s.name: s.hash for s in order}, hash_events, args.hash_repeat)
        for name, (wall, cpu) in best.items():
            rd[f"{name}_hash_event_list_tokens_per_s"] = hash_event_tokens / wall
            rd[f"{name}_hash_event_list_tokens_per_cpu_s"] = hash_event_tokens / cpu
        # ... and the same lists as a subscriber has them: just decoded, in the cache
        best_decoded = time_decoded_passes(
            {s.name: s.hash for s in order}, hash_event_bytes, args.hash_repeat
        )
        for name, wall in best_decoded.items():
            rd[f"{name}_hash_event_decoded_tokens_per_s"] = hash_event_tokens / wall
        long_prompts = pipe_in[PROMPT_LENGTHS[-1]]
        n_long = sum(len(t) for t in long_prompts)
        best = time_passes({s.name: s.hash for s in order}, long_prompts, args.hash_repeat)
        for name, (wall, cpu) in best.items():
            rd[f"{name}_hash_prompt_list_tokens_per_s"] = n_long / wall
            rd[f"{name}_hash_prompt_list_tokens_per_cpu_s"] = n_long / cpu
        best = time_passes(
            {"np": core.seq_hashes},
            hash_events_np,
            args.hash_repeat,
        )
        rd["kvplug_numpy_hash_event_tokens_per_s"] = hash_event_tokens / best["np"][0]
        # kvplug only: 64 k-block batches into a pre-sized index
        rd["kvplug_only_batched_presized_blocks_per_s"] = kvplug_batched(wl, workers)
        rounds.append(rd)
        log(f"[{workers} workers] round {r + 1}/{args.rounds}: " + round_line(rd, sides))
    res["rounds"] = rounds
    if len(sides) == 2:
        res["correctness"] = {"compared": compared, "mismatches": mismatches}
        log(f"[{workers} workers] answers compared: {compared}, mismatches: {mismatches}")
    if args.memory_rounds:
        names = [s.name for s in sides]
        res["memory"] = bench_memory(workers, args, [names[0], "kvplug_presized", *names[1:]])
    res["seconds"] = time.perf_counter() - t_start
    return res


def kvplug_batched(wl: Workload, workers: int, max_blocks: int = 65536) -> float:
    per: dict[int, list[Event]] = {}
    for ev in wl.events:
        per.setdefault(ev.worker, []).append(ev)
    batches = []
    for w, evs in per.items():
        eng = np.concatenate([e.engine for e in evs])
        seq = np.concatenate([e.seq for e in evs])
        for a in range(0, len(eng), max_blocks):
            batches.append((w, eng[a : a + max_blocks], seq[a : a + max_blocks]))
    idx = core.Index()
    idx.reserve(wl.blocks, wl.blocks, workers)
    t0 = time.perf_counter()
    for w, eng, seq in batches:
        idx.store(w, 0, eng, seq)
    return wl.blocks / (time.perf_counter() - t0)


def round_line(rd: dict, sides: list) -> str:
    parts = []
    if len(sides) == 2:
        parts.append(
            f"apply {ratio(rd, 'apply_blocks_per_s', True):.1f}x"
            f" (cpu {ratio(rd, 'apply_blocks_per_cpu_s', True):.1f}x,"
            f" pre-sized {ratio(rd, 'apply_blocks_per_cpu_s', True, 'kvplug_presized'):.1f}x)"
        )
        parts.append(
            "query "
            + "/".join(f"{ratio(rd, f'query_{n}_median_us'):.1f}" for n in PROMPT_LENGTHS)
            + "x"
        )
        parts.append(
            "hash+query "
            + "/".join(f"{ratio(rd, f'hash_query_{n}_median_us'):.1f}" for n in PROMPT_LENGTHS)
            + "x"
        )
        parts.append(
            f"hash events {ratio(rd, 'hash_event_list_tokens_per_s', True):.1f}x"
            f" (cpu {ratio(rd, 'hash_event_list_tokens_per_cpu_s', True):.1f}x),"
            f" prompts {ratio(rd, 'hash_prompt_list_tokens_per_s', True):.1f}x"
        )
    else:
        parts.append(f"apply {rd['kvplug_apply_blocks_per_s'] / 1e6:.2f} M blocks/s")
    parts.append(f"load {rd['loadavg'][0]:.1f}")
    return ", ".join(parts)


def ratio(rd: dict, key: str, higher_is_better: bool = False, mine: str = "kvplug") -> float:
    """kvplug's advantage: >1 means kvplug is better (``mine``: which kvplug figure)."""
    k, d = rd[f"{mine}_{key}"], rd[f"dynamo_{key}"]
    return k / d if higher_is_better else d / k


# ---- memory: a fresh subprocess per side and round ---------------------------------------------
def bench_memory(workers: int, args, side_names: list[str]) -> dict:
    out: dict = {name: [] for name in side_names}
    for r in range(args.memory_rounds):
        order = side_names if r % 2 == 0 else side_names[::-1]
        for name in order:
            cmd = [
                sys.executable,
                __file__,
                "--memory-child",
                name,
                "--workers",
                str(workers),
                "--blocks",
                str(args.blocks),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {name} failed:\n{proc.stderr}")
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            out[name].append(got)
        line = ", ".join(
            f"{n} {out[n][-1]['rss_mib_per_million_blocks']:.1f} MiB/M" for n in side_names
        )
        log(f"[{workers} workers] memory round {r + 1}/{args.memory_rounds}: {line}")
    return out


def memory_child(side_name: str, workers: int, blocks: int) -> int:
    dynamo, note = load_dynamo()  # both children load both libraries: the same baseline
    if side_name == "dynamo" and dynamo is None:
        raise SystemExit(note)
    wl = make_workload(workers, blocks, seed=1000 + workers, dynamo=dynamo)
    side = {
        "kvplug": KvplugSide,
        "kvplug_presized": lambda: KvplugPresizedSide(wl.blocks),
        "dynamo": lambda: DynamoSide(dynamo),
    }[side_name]()
    inputs = side.apply_inputs(wl)
    probe = probe_for_last_event(wl, dynamo)
    hashes = side.query_hashes(probe[0], probe[1])
    release_freed_heap()
    rss0 = rss_bytes()
    side.new_index()
    side.apply(inputs)
    got = side.worker_scores(side.scores(hashes)).get(probe[2])
    if got != probe[3]:
        raise SystemExit(f"{side_name}: probe scored {got}, want {probe[3]}")
    release_freed_heap()
    rss1 = rss_bytes()
    result = {
        "rss_delta_bytes": rss1 - rss0,
        "rss_mib_per_million_blocks": (rss1 - rss0) / 2**20 / (wl.blocks / 1e6),
        "stored_blocks": wl.blocks,
    }
    if side_name != "dynamo":
        result["own_accounting_mib_per_million_blocks"] = (
            side.idx.memory_bytes() / 2**20 / (wl.blocks / 1e6)
        )
    print(json.dumps(result))
    return 0


# ---- summary and report ------------------------------------------------------------------------
def span(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


RATIOS = (
    # (summary key, round key, higher is better[, kvplug's side if not "kvplug"])
    ("apply (wall)", "apply_blocks_per_s", True),
    ("apply (CPU)", "apply_blocks_per_cpu_s", True),
    (
        "apply, pre-sized as the router does (CPU)",
        "apply_blocks_per_cpu_s",
        True,
        "kvplug_presized",
    ),
    *((f"query {n} tok", f"query_{n}_median_us", False) for n in PROMPT_LENGTHS),
    *((f"hash+query {n} tok", f"hash_query_{n}_median_us", False) for n in PROMPT_LENGTHS),
    ("hashing, event token lists (wall)", "hash_event_list_tokens_per_s", True),
    ("hashing, event token lists (CPU)", "hash_event_list_tokens_per_cpu_s", True),
    ("hashing, event token lists as decoded (wall)", "hash_event_decoded_tokens_per_s", True),
    ("hashing, 8192-token prompt lists (wall)", "hash_prompt_list_tokens_per_s", True),
    ("hashing, 8192-token prompt lists (CPU)", "hash_prompt_list_tokens_per_cpu_s", True),
)


def summarise(res: dict, with_dynamo: bool) -> dict:
    rounds = res["rounds"]
    summ: dict = {}
    keys = {k for rd in rounds for k in rd if k not in ("order", "loadavg")}
    for k in sorted(keys):
        summ[k] = span([rd[k] for rd in rounds])
    if with_dynamo:
        summ["ratios"] = {
            label: span([ratio(rd, key, hib, *mine) for rd in rounds])
            for label, key, hib, *mine in RATIOS
        }
        # the most conservative reading: kvplug's worst round against Dynamo's best round
        for label, key, hib, *mine in RATIOS:
            k = [rd[f"{(mine or ['kvplug'])[0]}_{key}"] for rd in rounds]
            d = [rd[f"dynamo_{key}"] for rd in rounds]
            summ["ratios"][label]["worst_vs_best"] = min(k) / max(d) if hib else min(d) / max(k)
        kv8 = [rd["kvplug_numpy_query_8192_median_us"] for rd in rounds]
        dy8 = [rd["dynamo_query_8192_median_us"] for rd in rounds]
        summ["ratios"]["numpy into kvplug: query 8192 tok"] = span(
            [d / k for d, k in zip(dy8, kv8, strict=True)]
        )
        summ["ratios"]["numpy into kvplug: hashing event tokens"] = span(
            [
                rd["kvplug_numpy_hash_event_tokens_per_s"]
                / rd["dynamo_hash_event_list_tokens_per_s"]
                for rd in rounds
            ]
        )
        mem = res.get("memory")
        if mem:
            k = [m["rss_mib_per_million_blocks"] for m in mem["kvplug"]]
            d = [m["rss_mib_per_million_blocks"] for m in mem["dynamo"]]
            summ["ratios"]["memory (kvplug / Dynamo RSS)"] = span(
                [a / b for a, b in zip(k, d, strict=True)]
            )
            if "kvplug_presized" in mem:
                p = [m["rss_mib_per_million_blocks"] for m in mem["kvplug_presized"]]
                summ["ratios"]["memory, pre-sized (kvplug / Dynamo RSS)"] = span(
                    [a / b for a, b in zip(p, d, strict=True)]
                )
    return summ


# issue 14's aims, as plotted: (RATIOS label, axis label, aim: kvplug at least this many times
# Dynamo in every round)
AIMS = (
    ("query 8192 tok", "query, 8,192 tokens", 3.0),
    ("query 1024 tok", "query, 1,024 tokens", 3.0),
    ("query 128 tok", "query, 128 tokens", 3.0),
    ("apply (CPU)", "apply, growing index", 5.0),
    ("apply, pre-sized as the router does (CPU)", "apply, pre-sized", 5.0),
    ("hashing, event token lists (wall)", "hashing an event's list", 10.0),
    ("hashing, event token lists as decoded (wall)", "hashing a list just decoded", 10.0),
)


def plot_ratios(results: dict, path: Path) -> None:
    """Every round's kvplug / Dynamo ratio per aimed-at operation and worker count, each
    operation's aim drawn beside its points: how many rounds meet it, at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [w for w in results["workers"] if "ratios" in w["summary"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 4.6))
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for j, w in enumerate(rows):
        xs, ys = [], []
        for i, (label, _axis, _aim) in enumerate(AIMS):
            key = next(r for r in RATIOS if r[0] == label)
            per_round = [ratio(rd, key[1], key[2], *key[3:]) for rd in w["rounds"]]
            offset = (j - (len(rows) - 1) / 2) * 0.18
            xs += [i + offset] * len(per_round)
            ys += per_round
        ax.scatter(xs, ys, s=14, color=colours[j % len(colours)], label=f"{w['workers']} workers")
    for i, (_label, _axis, aim) in enumerate(AIMS):
        ax.hlines(aim, i - 0.42, i + 0.42, color="black", linewidth=1.2)
    ax.set_xticks(range(len(AIMS)), [a[1] for a in AIMS], rotation=20, ha="right")
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ticks = [t for t in (1, 2, 3, 5, 10, 20, 50) if t <= 1.2 * max(ax.get_ylim())]
    ax.set_yticks(ticks, [f"{t}×" for t in ticks])
    ax.set_ylabel("kvplug / Dynamo, per round (log)")
    ax.set_title("kvplug's C core against Dynamo's indexer, every round (bar: the aim)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def fmt_range(s: dict, fmt: str = "{:.1f}") -> str:
    lo, hi = fmt.format(s["min"]), fmt.format(s["max"])
    return lo if lo == hi else f"{lo}–{hi}"


def table(results: dict) -> str:
    lines = []
    with_dynamo = results["dynamo"].startswith("ai-dynamo-runtime ")
    for res in results["workers"]:
        s = res["summary"]
        lines.append(
            f"\n{res['workers']} workers: {res['stored_blocks']:,} stored blocks,"
            f" {res['events']:,} events ({res['blocks_per_event']:.1f} blocks/event),"
            f" {len(res['rounds'])} rounds, load average"
            f" {min(rd['loadavg'][0] for rd in res['rounds']):.1f}"
            f"–{max(rd['loadavg'][0] for rd in res['rounds']):.1f}"
        )
        head = f"  {'operation':34} {'kvplug':>16} {'Dynamo':>16}  kvplug advantage (range)"
        lines.append(head)
        rows = [
            ("apply, M blocks/s wall", "apply_blocks_per_s", 1e-6, "apply (wall)"),
            ("apply, M blocks per CPU-s", "apply_blocks_per_cpu_s", 1e-6, "apply (CPU)"),
            (
                "  pre-sized as the router does",
                "presized_apply_blocks_per_cpu_s",
                1e-6,
                "apply, pre-sized as the router does (CPU)",
            ),
            *(
                (f"query {n} tok, median µs", f"query_{n}_median_us", 1, f"query {n} tok")
                for n in PROMPT_LENGTHS
            ),
            *(
                (
                    f"hash+query {n} tok, median µs",
                    f"hash_query_{n}_median_us",
                    1,
                    f"hash+query {n} tok",
                )
                for n in PROMPT_LENGTHS
            ),
            (
                "hash event lists, M tok/s wall",
                "hash_event_list_tokens_per_s",
                1e-6,
                "hashing, event token lists (wall)",
            ),
            (
                "hash event lists, M tok per CPU-s",
                "hash_event_list_tokens_per_cpu_s",
                1e-6,
                "hashing, event token lists (CPU)",
            ),
            (
                "hash event lists as decoded, M tok/s",
                "hash_event_decoded_tokens_per_s",
                1e-6,
                "hashing, event token lists as decoded (wall)",
            ),
            (
                "hash 8192-tok lists, M tok/s wall",
                "hash_prompt_list_tokens_per_s",
                1e-6,
                "hashing, 8192-token prompt lists (wall)",
            ),
            (
                "hash 8192-tok lists, M tok per CPU-s",
                "hash_prompt_list_tokens_per_cpu_s",
                1e-6,
                "hashing, 8192-token prompt lists (CPU)",
            ),
        ]
        for label, key, scale, rkey in rows:
            k = {x: v * scale for x, v in s[f"kvplug_{key}"].items()}
            line = f"  {label:34} {fmt_range(k, '{:.2f}'):>16}"
            if with_dynamo:
                dkey = key.removeprefix("presized_")  # Dynamo's one apply figure
                d = {x: v * scale for x, v in s[f"dynamo_{dkey}"].items()}
                rr = s["ratios"][rkey]
                line += (
                    f" {fmt_range(d, '{:.2f}'):>16}  {fmt_range(rr)}x"
                    f" (worst vs best {rr['worst_vs_best']:.1f}x)"
                )
            lines.append(line)
        if with_dynamo:
            for label in (
                "numpy into kvplug: query 8192 tok",
                "numpy into kvplug: hashing event tokens",
            ):
                lines.append(f"  {label:68} {fmt_range(s['ratios'][label])}x")
        mem = res.get("memory")
        if mem:
            k = span([m["rss_mib_per_million_blocks"] for m in mem["kvplug"]])
            own = span([m["own_accounting_mib_per_million_blocks"] for m in mem["kvplug"]])
            line = f"  {'memory, RSS MiB per M blocks':34} {fmt_range(k):>16}"
            if "dynamo" in mem:
                d = span([m["rss_mib_per_million_blocks"] for m in mem["dynamo"]])
                line += (
                    f" {fmt_range(d):>16}  kvplug/Dynamo"
                    f" {fmt_range(s['ratios']['memory (kvplug / Dynamo RSS)'], '{:.2f}')}"
                )
            lines.append(line)
            lines.append(f"  {'  (kvplug own accounting)':34} {fmt_range(own):>16}")
            if "kvplug_presized" in mem:
                p = span([m["rss_mib_per_million_blocks"] for m in mem["kvplug_presized"]])
                line = f"  {'  pre-sized as the router does':34} {fmt_range(p):>16}"
                if "dynamo" in mem:
                    rr = s["ratios"]["memory, pre-sized (kvplug / Dynamo RSS)"]
                    line += f" {'':>16}  kvplug/Dynamo {fmt_range(rr, '{:.2f}')}"
                lines.append(line)
        b = s["kvplug_only_batched_presized_blocks_per_s"]
        lines.append(
            f"  {'kvplug only: 64k batches, presized':34}"
            f" {fmt_range({x: v * 1e-6 for x, v in b.items()}, '{:.2f}'):>16} M blocks/s"
        )
        if "correctness" in res:
            c = res["correctness"]
            lines.append(f"  answers compared {c['compared']}, mismatches {c['mismatches']}")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The README / docs table: kvplug's advantage over Dynamo, ranges over rounds."""
    ws = results["workers"]
    out = [
        "| kvplug's advantage over Dynamo: range over rounds"
        " (kvplug's worst round against Dynamo's best) | "
        + " | ".join(f"{r['workers']} workers" for r in ws)
        + " |"
    ]
    out.append("|---" * (len(ws) + 1) + "|")
    labels = [label for label, *_ in RATIOS] + [
        "numpy into kvplug: query 8192 tok",
        "numpy into kvplug: hashing event tokens",
    ]
    for label in labels:
        cells = []
        for r in ws:
            rr = r["summary"]["ratios"][label]
            worst = f" ({rr['worst_vs_best']:.1f}×)" if "worst_vs_best" in rr else ""
            cells.append(f"{fmt_range(rr)}×{worst}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    if all("memory" in r for r in ws):
        cells = []
        for r in ws:
            k = span([m["rss_mib_per_million_blocks"] for m in r["memory"]["kvplug"]])
            d = span([m["rss_mib_per_million_blocks"] for m in r["memory"]["dynamo"]])
            rr = r["summary"]["ratios"]["memory (kvplug / Dynamo RSS)"]
            cells.append(f"{fmt_range(k)} vs {fmt_range(d)} MiB/M ({fmt_range(rr, '{:.2f}')}×)")
        label = "memory, RSS delta per M blocks (kvplug vs Dynamo)"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
        if all("kvplug_presized" in r["memory"] for r in ws):
            cells = []
            for r in ws:
                p = span([m["rss_mib_per_million_blocks"] for m in r["memory"]["kvplug_presized"]])
                rr = r["summary"]["ratios"]["memory, pre-sized (kvplug / Dynamo RSS)"]
                cells.append(f"{fmt_range(p)} MiB/M ({fmt_range(rr, '{:.2f}')}×)")
            label = "memory, pre-sized as the router does (kvplug vs Dynamo)"
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="100k blocks, 3 rounds, fewer queries")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--memory-rounds", type=int, default=None, help="0 skips memory")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--no-dynamo", action="store_true", help="kvplug only (no ratios)")
    ap.add_argument(
        "--no-keep-awake",
        dest="keep_awake",
        action="store_false",
        help="do not run the lowest-priority spinner that keeps the other cores awake",
    )
    ap.add_argument(
        "--memory-child", choices=["kvplug", "kvplug_presized", "dynamo"], help=argparse.SUPPRESS
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_core.json"))
    ap.add_argument(
        "--plot",
        default=str(Path(__file__).resolve().parents[1] / "docs" / "img" / "bench_core_ratios.png"),
        help="per-round ratios against the aims ('' = none)",
    )
    ap.add_argument(
        "--plot-from", metavar="JSON", help="only draw --plot from a results file this wrote"
    )
    args = ap.parse_args(argv)
    if args.plot_from:
        plot_ratios(json.loads(Path(args.plot_from).read_text()), Path(args.plot))
        return 0
    if args.blocks is None:
        args.blocks = 100_000 if args.small else 1_000_000
    if args.memory_child:
        return memory_child(args.memory_child, args.workers[0], args.blocks)
    if args.rounds is None:
        args.rounds = 3 if args.small else 5
    if args.memory_rounds is None:
        args.memory_rounds = 2 if args.small else 3
    args.queries = 200 if args.small else 500
    args.pipeline_prompts = 50 if args.small else 100
    args.hash_events = 128 if args.small else 256
    args.hash_repeat = 10

    dynamo, note = (None, "not requested (--no-dynamo)") if args.no_dynamo else load_dynamo()
    if dynamo is None and not args.no_dynamo:
        log(f"{note}\ninstall it with: pip install -e '.[bench]' (or run with --no-dynamo)")
        return 2
    sides: list = [KvplugSide()] + ([DynamoSide(dynamo)] if dynamo is not None else [])
    spinners = keep_cores_awake() if args.keep_awake and dynamo is not None else []
    try:
        return run(args, sides, dynamo, note, argv, len(spinners))
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def keep_cores_awake() -> list[subprocess.Popen]:
    """One busy loop at the lowest priority (nice 19) per core but this one. Dynamo's binding
    hands every call to its background thread and waits: a hop to a core that went idle costs
    a wake-up, ~100 µs on a VM (its vCPU halts), so an idle machine would time Dynamo's
    wake-ups, not its index (0.28-0.42 M blocks/s and ~100 µs per query on this host, against
    1.5-2.9 M and 6-21 µs with the cores kept awake: docs/core.md). The spinners yield to
    anything else; kvplug runs on one thread and makes no such hop."""
    n = max(0, (os.cpu_count() or 1) - 1)
    spin = "import os; os.nice(19)\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def run(args, sides: list, dynamo, note: str, argv, spinners: int) -> int:
    results: dict = {
        "command": " ".join(
            ["python benchmarks/bench_core.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "cpu_model": cpu_model(),
            "loadavg_at_start": os.getloadavg(),
        },
        "block_size": BS,
        "target_stored_blocks": args.blocks,
        "rounds": args.rounds,
        "dynamo": note,
        "keep_awake_spinners": spinners,
    }
    log(
        f"bench_core: {args.blocks:,} blocks, workers {args.workers}, {args.rounds} rounds, "
        f"{note}, on {results['machine']['cpu_model']}, {spinners} keep-awake spinner(s)"
    )
    results["workers"] = []
    for w in args.workers:
        res = bench_workers(w, args, sides)
        res["summary"] = summarise(res, dynamo is not None)
        results["workers"].append(res)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    if dynamo is not None:
        md = Path(args.out).with_suffix(".md")
        md.write_text(markdown(results) + "\n")
        if args.plot:
            plot_ratios(results, Path(args.plot))
        print(f"\nwrote {args.out} and {md}" + (f", plot {args.plot}" if args.plot else ""))
    else:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

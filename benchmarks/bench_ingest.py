"""vLLM KV-event ingestion: bytes in -> kvplug index updated, in blocks per second on one core.

Workload (seeded): engines serving multi-turn sessions over shared system prompts. Each vLLM
0.32 batch (msgpack, map-form events, uint64 hashes) is one scheduler step: a few
``BlockStored`` events (a new prompt's blocks chained to its cached prefix via
``parent_block_hash``, 16-token blocks) and the ``BlockRemoved`` events of the blocks evicted to
make room — one event per evicted hash, as vLLM sends them. Payloads are encoded up front; the
clock covers decoding and applying to ``KvIndex``.

Measured in the same run:
* ``kvplug``: ``BatchDecoder.decode`` (typed msgspec structs, tokens validated into u32
  buffers, consecutive removes coalesced) + ``KvIndex.apply_many``;
* ``zmq``: the same through real loopback ZMQ sockets from a publisher process (the engines'
  side) into the ``VllmSubscriber`` thread (the consumer uses one core, the publisher the other);
* ``naive``: ``msgpack.unpackb`` (or untyped msgspec) + per-event dict handling into the same
  normalised events + ``KvIndex.apply`` one event at a time.

    python benchmarks/bench_ingest.py [--batches 3000] [--block-size 16]

Prints a table and writes ``benchmarks/results/bench_ingest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from integrations.vllm.wire import BatchDecoder, encode_batch, fold_hash  # noqa: E402
from kvplug.events import AllCleared, BlockRemoved, BlockStored, Tier  # noqa: E402
from kvplug.index import KvIndex  # noqa: E402

try:
    import msgpack

    def naive_unpack(b: bytes):
        return msgpack.unpackb(b, raw=False)

    NAIVE_LIB = "msgpack"
except ImportError:  # msgpack is not a kvplug dependency
    import msgspec

    def naive_unpack(b: bytes):
        return msgspec.msgpack.decode(b)

    NAIVE_LIB = "msgspec (untyped)"


class EngineModel:
    """One simulated engine: a block cache of fixed capacity with LRU eviction."""

    def __init__(
        self,
        rng: random.Random,
        worker: str,
        capacity: int,
        block_size: int,
        systems: list[list[int]],
    ) -> None:
        self.rng = rng
        self.worker = worker
        self.capacity = capacity
        self.bs = block_size
        self.systems = systems
        self.next_hash = rng.getrandbits(63) | (1 << 63)  # exercises uint64 >= 2**63
        self.cache: dict[tuple, int] = {}  # token-prefix key -> engine hash (LRU order)
        self.sessions: list[list[int]] = []

    def _hash(self) -> int:
        self.next_hash = (self.next_hash * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return self.next_hash

    def step(self, n_requests: int) -> list:
        events: list = []
        for _ in range(n_requests):
            r = self.rng.random()
            if r < 0.5 and self.sessions:  # a session's next turn grows its context
                s = self.rng.choice(self.sessions)
                s.extend(self.rng.randrange(32000) for _ in range(self.rng.randrange(64, 256)))
            else:  # a new session on one of the system prompts
                s = list(self.rng.choice(self.systems)) + [
                    self.rng.randrange(32000) for _ in range(self.rng.randrange(64, 512))
                ]
                self.sessions.append(s)
                if len(self.sessions) > 64:
                    self.sessions.pop(0)
            events.extend(self._prefill(s))
        return events

    def _prefill(self, tokens: list[int]) -> list:
        bs = self.bs
        n = len(tokens) // bs
        parent = None
        first_new = n
        for i in range(n):
            key = (i, hash(tuple(tokens[: (i + 1) * bs])))
            h = self.cache.get(key)
            if h is None:
                first_new = i
                break
            self.cache.pop(key)
            self.cache[key] = h  # touch (LRU)
            parent = h
        if first_new >= n:
            return []
        new_keys, new_hashes = [], []
        for i in range(first_new, n):
            new_keys.append((i, hash(tuple(tokens[: (i + 1) * bs]))))
            new_hashes.append(self._hash())
        events: list = []
        overflow = len(self.cache) + len(new_hashes) - self.capacity
        for _ in range(max(0, overflow)):
            k = next(iter(self.cache))
            events.append(
                BlockRemoved(
                    worker_id=self.worker, tier=Tier.DEVICE, engine_hashes=[self.cache.pop(k)]
                )
            )
        for k, h in zip(new_keys, new_hashes, strict=True):
            self.cache[k] = h
        events.append(
            BlockStored(
                worker_id=self.worker,
                parent_engine_hash=parent,
                engine_hashes=new_hashes,
                token_ids=tokens[first_new * bs : n * bs],
                block_size=bs,
            )
        )
        return events


def make_workload(n_batches: int, block_size: int, n_engines: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    systems = [
        [rng.randrange(32000) for _ in range(rng.choice((256, 512, 1024)))] for _ in range(8)
    ]
    engines = [EngineModel(rng, f"w{i}", 4096, block_size, systems) for i in range(n_engines)]
    out = []  # (worker, payload, blocks in it)
    seqs = [0] * n_engines
    for _ in range(n_batches):
        i = rng.randrange(n_engines)
        evs = engines[i].step(rng.randrange(1, 5))
        if not evs:
            continue
        blocks = sum(len(e.engine_hashes) for e in evs)
        out.append((f"w{i}", seqs[i], encode_batch(evs, "0.32.0", ts=1.0), blocks))
        seqs[i] += 1
    return out


def fresh_index(block_size: int, n_engines: int) -> KvIndex:
    idx = KvIndex(block_size)
    for i in range(n_engines):
        idx.add_endpoint(f"w{i}", 0)
    return idx


def run_kvplug(work, block_size, n_engines) -> tuple[float, KvIndex]:
    idx = fresh_index(block_size, n_engines)
    decoders = {f"w{i}": BatchDecoder(f"w{i}", block_size=block_size) for i in range(n_engines)}
    t0 = time.perf_counter()
    for worker, _seq, payload, _blocks in work:
        b = decoders[worker].decode(payload)
        idx.apply_many(b.events)
    return time.perf_counter() - t0, idx


def run_split(work, block_size, n_engines) -> tuple[float, float]:
    """The two halves of the kvplug path timed apart: decode only, then apply only."""
    decoders = {f"w{i}": BatchDecoder(f"w{i}", block_size=block_size) for i in range(n_engines)}
    t0 = time.perf_counter()
    batches = [decoders[w].decode(p).events for w, _s, p, _b in work]
    t1 = time.perf_counter()
    idx = fresh_index(block_size, n_engines)
    t2 = time.perf_counter()
    for evs in batches:
        idx.apply_many(evs)
    return t1 - t0, time.perf_counter() - t2


def naive_events(worker: str, payload: bytes) -> list:
    """What a straightforward consumer does: untyped unpack, a dict per event, Python lists."""
    batch = naive_unpack(payload)
    rank = batch[2] if len(batch) > 2 else 0
    out = []
    for ev in batch[1]:
        kind = ev["type"] if isinstance(ev, dict) else ev[0]
        if kind == "BlockStored":
            out.append(
                BlockStored(
                    worker_id=worker,
                    dp_rank=rank,
                    tier=Tier.DEVICE if ev.get("medium") in (None, "GPU") else Tier.HOST,
                    parent_engine_hash=None
                    if ev["parent_block_hash"] is None
                    else fold_hash(ev["parent_block_hash"]),
                    engine_hashes=[fold_hash(h) for h in ev["block_hashes"]],
                    token_ids=[int(t) for t in ev["token_ids"]],
                    block_size=ev["block_size"],
                )
            )
        elif kind == "BlockRemoved":
            out.append(
                BlockRemoved(
                    worker_id=worker,
                    dp_rank=rank,
                    engine_hashes=[fold_hash(h) for h in ev["block_hashes"]],
                )
            )
        elif kind == "AllBlocksCleared":
            out.append(AllCleared(worker_id=worker, dp_rank=rank))
    return out


def run_naive(work, block_size, n_engines) -> tuple[float, KvIndex]:
    idx = fresh_index(block_size, n_engines)
    t0 = time.perf_counter()
    for worker, _seq, payload, _blocks in work:
        for e in naive_events(worker, payload):
            try:
                idx.apply(e)
            except Exception:  # noqa: BLE001 - count-and-continue like the real path
                pass
    return time.perf_counter() - t0, idx


def _publisher_process(work, n_engines, conn, go) -> None:
    """The engines' side, in its own process: PUB sockets, then every batch as fast as ZMQ
    takes it once told to go."""
    import zmq

    ctx = zmq.Context()
    pubs = {}
    for i in range(n_engines):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the benchmark counts every block
        pubs[f"w{i}"] = (sock, sock.bind_to_random_port("tcp://127.0.0.1"))
    conn.send({w: port for w, (_s, port) in pubs.items()})
    go.wait()
    for worker, seq, payload, _blocks in work:
        pubs[worker][0].send_multipart([b"", seq.to_bytes(8, "big"), payload])
    conn.recv()  # the consumer is done: now the sockets may go
    for sock, _port in pubs.values():
        sock.close(0)
    ctx.term()


def run_zmq(work, block_size, n_engines) -> tuple[float, KvIndex, dict]:
    """Through loopback ZMQ from a publisher *process* (as an engine is) into the real
    subscriber thread, whose sink applies to the index: one core consumes."""
    import multiprocessing as mp

    import zmq

    from integrations.vllm.subscriber import EventSource, VllmSubscriber

    idx = fresh_index(block_size, n_engines)
    total = sum(w[3] for w in work)
    applied = [0]
    done = threading.Event()

    def sink(events):
        applied[0] += idx.apply_many(events).blocks
        if applied[0] >= total:
            done.set()

    mpc = mp.get_context("fork")
    conn, child_conn = mpc.Pipe()
    go = mpc.Event()
    child = mpc.Process(target=_publisher_process, args=(work, n_engines, child_conn, go))
    child.start()
    ports = conn.recv()
    ctx = zmq.Context()
    sub = VllmSubscriber(context=ctx, catch_up=False)
    for worker, port in ports.items():
        sub.add(
            EventSource(
                worker, f"tcp://*:{port}", sink, engine_host="127.0.0.1", block_size=block_size
            )
        )
    sub.start()
    time.sleep(0.5)  # SUB connections up before the first batch
    t0 = time.perf_counter()
    go.set()
    done.wait(120)
    dt = time.perf_counter() - t0
    conn.send("done")
    child.join(30)
    stats = sub.stats()
    sub.stop()
    ctx.term()
    gaps = sum(s["gaps"] for s in stats["streams"].values())
    return dt, idx, {"gaps": gaps, "complete": applied[0] >= total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="best of N for each path")
    ap.add_argument("--no-zmq", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_ingest.json"))
    args = ap.parse_args()

    t = time.perf_counter()
    work = make_workload(args.batches, args.block_size, args.engines, args.seed)
    gen_s = time.perf_counter() - t
    blocks = sum(w[3] for w in work)
    nbytes = sum(len(w[2]) for w in work)
    print(
        f"workload: {len(work)} batches, {blocks} blocks, {nbytes / 1e6:.1f} MB "
        f"(generated in {gen_s:.1f}s), block size {args.block_size}, {args.engines} engines"
    )

    results = {}
    ref_stats = None
    for name, fn in (("kvplug", run_kvplug), ("naive", run_naive)):
        best = None
        for _ in range(args.repeat):
            dt, idx = fn(work, args.block_size, args.engines)
            best = dt if best is None else min(best, dt)
        st = idx.stats()
        if ref_stats is None:
            ref_stats = st
        results[name] = {
            "seconds": best,
            "blocks_per_s": blocks / best,
            "mb_per_s": nbytes / best / 1e6,
            "index_blocks": st.get("blocks"),
            "index_entries": st.get("entries"),
        }
    dec_s = app_s = None
    for _ in range(args.repeat):
        d, a = run_split(work, args.block_size, args.engines)
        dec_s = d if dec_s is None else min(dec_s, d)
        app_s = a if app_s is None else min(app_s, a)
    split = {"decode_only_blocks_per_s": blocks / dec_s, "apply_only_blocks_per_s": blocks / app_s}
    if not args.no_zmq:
        dt, idx, extra = run_zmq(work, args.block_size, args.engines)
        st = idx.stats()
        results["zmq"] = {
            "seconds": dt,
            "blocks_per_s": blocks / dt,
            "mb_per_s": nbytes / dt / 1e6,
            "index_blocks": st.get("blocks"),
            "index_entries": st.get("entries"),
            **extra,
        }
    same = all(r["index_entries"] == results["kvplug"]["index_entries"] for r in results.values())

    base = results["naive"]["blocks_per_s"]
    print(f"\n{'path':<8} {'blocks/s':>12} {'MB/s':>8} {'vs naive':>9} {'index entries':>14}")
    for name, r in results.items():
        print(
            f"{name:<8} {r['blocks_per_s']:>12,.0f} {r['mb_per_s']:>8.1f} "
            f"{r['blocks_per_s'] / base:>8.2f}x {r['index_entries']:>14,}"
        )
    print(
        f"\nkvplug halves: decode {split['decode_only_blocks_per_s']:,.0f} blocks/s, "
        f"apply {split['apply_only_blocks_per_s']:,.0f} blocks/s"
    )
    print(f"all paths built the same index: {same}")

    import kvplug

    out = {
        "benchmark": "bench_ingest",
        "command": "python benchmarks/bench_ingest.py " + " ".join(sys.argv[1:]),
        "params": vars(args) | {"out": None},
        "workload": {
            "batches": len(work),
            "blocks": blocks,
            "bytes": nbytes,
            "vllm_version": "0.32.0",
            "encoding": "map, uint64 hashes",
        },
        "core_backend": kvplug.backend,
        "naive_decoder": NAIVE_LIB,
        "results": results,
        "ratio_vs_naive": {k: v["blocks_per_s"] / base for k, v in results.items()},
        "kvplug_split": split,
        "same_index": same,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

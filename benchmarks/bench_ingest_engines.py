"""KV-event ingestion from each engine kvplug follows, on the same workload: bytes in → index
updated, in blocks per second on one core, vLLM, SGLang and TensorRT-LLM side by side.

Workload: ``bench_ingest.py``'s (seeded engines serving multi-turn sessions over shared system
prompts, LRU eviction, one scheduler step a message), its events encoded as each engine sends
them: vLLM 0.32 msgpack batches (one ``BlockRemoved`` per evicted block, as vLLM sends them),
SGLang 0.5.23 map-form msgpack batches (the same events grouped as SGLang's event recorder
queues them, ``recorder_queue``: a run of removals is one event, and so is a run of stores each
chaining onto the one before), TRT-LLM drained ``/kv_cache_events`` answers (JSON, compact, one
envelope per event, consecutive removals joined as TRT-LLM's event manager joins them, each
engine's event ids counting from 0). Payloads are encoded before the clock; the clock covers
what kvplug does with them: the engine's decoder (vLLM's compiled decoder, SGLang's typed
decode with the compiled token and hash readers, TRT-LLM's ``parse_answer`` and typed reader)
and ``KvIndex.apply_many`` on an index pre-sized for the fleet, as ``kvplug serve`` does. The
decoders as they were before issue 14's thirty-eighth to fortieth passes run beside them
(SGLang's token ids and hashes by msgspec and its removes one event each, TRT-LLM's plain JSON
decode and checked reader). ``--block-size 1`` is SGLang's default page size (a block per
token).

Every path runs once a round after a ``gc.collect()``, the paths taking turns in an order that
rotates each round; a path's figure is its best round, ratios against vLLM are per round. All
paths must build the same index (its block and entry counts).

    python benchmarks/bench_ingest_engines.py [--batches 3000] [--rounds 5] [--vocab 32000]

Prints a table and writes ``benchmarks/results/bench_ingest_engines.json``.
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
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

from bench_ingest import ENGINE_BLOCKS, add_workload_args, fresh_index, make_events  # noqa: E402
from hostinfo import cpu_model  # noqa: E402
from kvplug.integrations.sglang.wire import SglangDecoder, recorder_queue  # noqa: E402
from kvplug.integrations.sglang.wire import encode_batch as sglang_batch  # noqa: E402
from kvplug.integrations.trtllm.events import TrtllmDecoder  # noqa: E402
from kvplug.integrations.trtllm.events import encode_answer as trtllm_encode_answer  # noqa: E402
from kvplug.integrations.trtllm.poller import parse_answer  # noqa: E402
from kvplug.integrations.vllm.wire import BatchDecoder  # noqa: E402
from kvplug.integrations.vllm.wire import encode_batch as vllm_batch  # noqa: E402

VLLM = "vllm 0.32 (compiled decoder)"
SGLANG = "sglang 0.5.23 (typed, compiled ids and hashes, removes joined)"
SGLANG_BEFORE = "sglang 0.5.23 (msgspec ids and hashes, removes apart: before)"
TRT = "trt-llm (parse_answer, typed reader)"
TRT_BEFORE = "trt-llm (plain JSON, checked reader: before)"


def encode(steps: list, block_size: int) -> dict[str, list[tuple[str, bytes]]]:
    """Each engine's payloads for the same steps: (worker, payload)."""
    next_id: dict[str, int] = {}
    out: dict[str, list[tuple[str, bytes]]] = {"vllm": [], "sglang": [], "trtllm": []}
    for worker, _seq, evs, _blocks in steps:
        out["vllm"].append((worker, vllm_batch(evs, "0.32.0", ts=1.0)))
        # grouped as SGLang's event recorder queues them: a run of removals is one event, and
        # so is a run of stores each chaining onto the one before
        out["sglang"].append((worker, sglang_batch(recorder_queue(evs), "0.5.23", ts=1.0)))
        first = next_id.get(worker, 0)
        answer, n = trtllm_encode_answer(evs, first, block_size)
        out["trtllm"].append((worker, answer))
        next_id[worker] = first + n
    return out


def paths(payloads: dict, block_size: int, n_engines: int) -> dict:
    """name → (engine, its payloads, a function making a fresh ``decode(worker, payload)``)."""
    workers = [f"w{i}" for i in range(n_engines)]

    def vllm():
        decoders = {w: BatchDecoder(w, block_size=block_size) for w in workers}
        return lambda w, p: decoders[w].decode(p).events

    def sglang(compiled_ids: bool):
        def make():
            decoders = {w: SglangDecoder(w, block_size) for w in workers}
            if not compiled_ids:
                for d in decoders.values():  # the path before issue 14's 38th-40th passes:
                    d._ids = None  # token ids and hashes read by msgspec,
                    d._join_removes = False  # one event per removal
            return lambda w, p: decoders[w].decode(p)

        return make

    def trtllm(typed: bool):
        def make():
            decoders = {w: TrtllmDecoder(w, block_size) for w in workers}
            if typed:  # what the poller does with an answer
                return lambda w, p: decoders[w].decode(parse_answer(p)[0])
            plain = msgspec.json.Decoder()
            return lambda w, p: decoders[w].decode(plain.decode(p))

        return make

    return {
        VLLM: ("vllm", payloads["vllm"], vllm),
        SGLANG: ("sglang", payloads["sglang"], sglang(True)),
        SGLANG_BEFORE: ("sglang", payloads["sglang"], sglang(False)),
        TRT: ("trtllm", payloads["trtllm"], trtllm(True)),
        TRT_BEFORE: ("trtllm", payloads["trtllm"], trtllm(False)),
    }


def run(path, block_size: int, n_engines: int) -> tuple[float, float, dict]:
    """One timed pass: (wall s, thread CPU s, the index's stats)."""
    _engine, payloads, make = path
    index = fresh_index(block_size, n_engines)
    decode = make()
    apply_many = index.apply_many
    gc.collect()  # each path pays for the collections its own garbage causes
    t0, c0 = time.perf_counter(), time.thread_time()
    for worker, payload in payloads:
        apply_many(decode(worker, payload))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return wall, cpu, index.stats()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "bench_ingest_engines.json"))
    args = ap.parse_args()

    steps = make_events(args.batches, args.block_size, args.engines, args.seed, args.vocab)
    blocks = sum(s[3] for s in steps)
    payloads = encode(steps, args.block_size)
    nbytes = {k: sum(len(p) for _, p in v) for k, v in payloads.items()}
    print(
        f"workload: {len(steps)} steps, {blocks:,} blocks (stored and removed) of "
        f"{args.block_size} tokens, {args.engines} engines, token ids below {args.vocab:,}; "
        f"bytes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items())
    )
    table = paths(payloads, args.block_size, args.engines)
    names = list(table)
    walls: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    indexes: dict[str, dict] = {}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wall, cpu, stats = run(table[name], args.block_size, args.engines)
            walls[name].append(wall)
            cpus[name].append(cpu)
            indexes[name] = {key: stats.get(key) for key in ("blocks", "entries")}
        print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr)
    same = all(v == indexes[VLLM] for v in indexes.values())

    results = {}
    for name in names:
        engine = table[name][0]
        per_round = [v / w for v, w in zip(walls[VLLM], walls[name], strict=True)]
        results[name] = {
            "engine": engine,
            "blocks_per_s": blocks / min(walls[name]),
            "blocks_per_cpu_s": blocks / min(cpus[name]),
            "mb_per_s": nbytes[engine] / min(walls[name]) / 1e6,
            "bytes_per_block": nbytes[engine] / blocks,
            "vs_vllm_per_round": per_round,
            "index": indexes[name],
        }
    befores = {}
    for what, (before, after) in {
        "sglang": (SGLANG_BEFORE, SGLANG),
        "trtllm": (TRT_BEFORE, TRT),
    }.items():
        per_round = [b / a for b, a in zip(walls[before], walls[after], strict=True)]
        befores[what] = {
            "min": min(per_round),
            "median": statistics.median(per_round),
            "max": max(per_round),
            "per_round": per_round,
        }

    print(
        f"\n{'path':52s} {'blocks/s':>12s} {'blocks/CPU-s':>13s} {'B/block':>8s} {'vs vLLM':>12s}"
    )
    for name, r in results.items():
        v = r["vs_vllm_per_round"]
        print(
            f"{name:52s} {r['blocks_per_s']:12,.0f} {r['blocks_per_cpu_s']:13,.0f} "
            f"{r['bytes_per_block']:8.0f} {min(v):5.2f}-{max(v):.2f}x"
        )
    for what, b in befores.items():
        print(
            f"{what}, after over before: {b['min']:.2f}-{b['max']:.2f}x by round "
            f"(median {b['median']:.2f}x)"
        )
    print(f"every path built the same index: {same} ({indexes[VLLM]})")

    import kvplug

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "bench_ingest_engines",
                "command": "python benchmarks/bench_ingest_engines.py " + " ".join(sys.argv[1:]),
                "params": vars(args) | {"out": None},
                "workload": {"steps": len(steps), "blocks": blocks, "bytes": nbytes},
                "index": f"pre-sized to {args.engines} x {ENGINE_BLOCKS} blocks",
                "core_backend": kvplug.backend,
                "results": results,
                "after_over_before": befores,
                "same_index": same,
                "machine": {
                    "cpu": cpu_model(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "loadavg_1m": os.getloadavg()[0],
                },
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Two builds of the compiled vLLM event decoder (``_fastwire``) side by side on token ids.

Both builds' ``_fastwire`` extension modules are loaded into one process from their source
trees (``--base``, ``--new``: each built in place, holding
``integrations/vllm/_fastwire*.so``). Both decode the same vLLM 0.32 ``KVEventBatch`` payloads
(map-form ``BlockStored`` events, uint64 hashes, 8 events of 26 16-token blocks a batch), round
by round, the order flipping every round, for token ids drawn three ways:

* ``uniform-32k``: uniform below 32,000 (Llama 2's vocabulary; ``bench_ingest.py``'s default):
  msgpack writes nearly every id as a 3-byte uint16;
* ``zipf-128k``: ranks of a Zipf law (s = 1) over 128,256 ids (Llama 3's vocabulary; BPE numbers
  its merges roughly by frequency), so 1-, 3- and 5-byte forms mix (~44 / 51 / 5.5 %);
* ``uniform-128k``: uniform below 128,256: 3- and 5-byte forms about half and half.

Each round times the C parse alone (``parse_only``) and the whole decode (events built) as the
best of ``--passes`` passes over every payload, in ns per token id. The first round checks that
both builds decode every payload to the same events.

    python benchmarks/ab_fastwire_builds.py --base /tmp/base --new .

Prints base/new per round; writes ``benchmarks/results/ab_fastwire_builds.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from build_loader import load_extension  # noqa: E402
from kvplug.integrations.vllm.wire import (  # noqa: E402
    DEFAULT_MAX_EVENT_TOKENS,
    _fast_extra_keys,
    encode_batch,
)

from kvplug.events import BlockStored  # noqa: E402

BS = 16
EVENTS_PER_BATCH = 8
BLOCKS_PER_EVENT = 26
LLAMA3_VOCAB = 128_256
KINDS = ("uniform-32k", "zipf-128k", "uniform-128k")


def load_fastwire(tree: str) -> ModuleType:
    return load_extension(
        tree, "integrations/vllm", "_fastwire", "kvplug.integrations.vllm._fastwire"
    )


def token_ids(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "uniform-32k":
        return rng.integers(0, 32_000, n)
    if kind == "uniform-128k":
        return rng.integers(0, LLAMA3_VOCAB, n)
    return rng.choice(LLAMA3_VOCAB, n, p=zipf_weights())


@functools.cache
def zipf_weights() -> np.ndarray:
    """P(id) proportional to 1 / (id + 1) over Llama 3's ids (computed once, not per event)."""
    p = 1.0 / np.arange(1, LLAMA3_VOCAB + 1)
    return p / p.sum()


def payloads(kind: str, batches: int, seed: int) -> tuple[list[bytes], int]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        events = [
            BlockStored(
                worker_id="w",
                engine_hashes=rng.integers(0, 2**63, BLOCKS_PER_EVENT).tolist(),
                token_ids=token_ids(rng, kind, BLOCKS_PER_EVENT * BS).tolist(),
                block_size=BS,
            )
            for _ in range(EVENTS_PER_BATCH)
        ]
        out.append(encode_batch(events, "0.32"))
    return out, batches * EVENTS_PER_BATCH * BLOCKS_PER_EVENT * BS


def decode_all(dec, work: list[bytes]) -> list:
    return [dec.decode(p, DEFAULT_MAX_EVENT_TOKENS, BS, "w", 0, _fast_extra_keys) for p in work]


def best_pass(fn, passes: int) -> float:
    best = float("inf")
    gc.disable()
    try:
        for _ in range(passes):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    finally:
        gc.enable()
    return best


def same_events(a: list, b: list) -> bool:
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if x[:2] != y[:2] or len(x[2]) != len(y[2]):
            return False
        for ea, eb in zip(x[2], y[2], strict=True):
            if type(ea) is not type(eb) or list(ea.engine_hashes) != list(eb.engine_hashes):
                return False
            if not np.array_equal(np.asarray(ea.token_ids), np.asarray(eb.token_ids)):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="source tree of the base build")
    ap.add_argument("--new", required=True, help="source tree of the new build")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--passes", type=int, default=5, help="best of N passes per round")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ab_fastwire_builds.json"))
    args = ap.parse_args(argv)
    builds = {"base": load_fastwire(args.base), "new": load_fastwire(args.new)}
    result: dict = {"command": " ".join(sys.argv if argv is None else argv), "kinds": {}}
    print(
        "| token ids | round | parse ns/id base / new | base/new | decode ns/id base / new |"
        " base/new |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind in args.kinds:
        work, n_ids = payloads(kind, args.batches, seed=KINDS.index(kind) + 1)
        # one decoder per stream, and a stream is one model's: a decoder may adapt to the
        # token ids it has seen (the wide-vocabulary pair step), so each mix starts fresh
        decoders = {name: m.FastDecoder() for name, m in builds.items()}
        decoded = {name: decode_all(dec, work) for name, dec in decoders.items()}
        if any(d is None for got in decoded.values() for d in got):
            raise SystemExit(f"{kind}: a build declined a batch (the fast path must accept all)")
        if not same_events(decoded["base"], decoded["new"]):
            raise SystemExit(f"{kind}: the two builds decode the payloads differently")
        del decoded
        rounds = []
        for r in range(args.rounds):
            order = list(decoders) if r % 2 == 0 else list(decoders)[::-1]
            row: dict = {"order": order}
            for name in order:
                dec = decoders[name]
                parse = best_pass(
                    lambda dec=dec, work=work: [
                        dec.parse_only(p, DEFAULT_MAX_EVENT_TOKENS, BS) for p in work
                    ],
                    args.passes,
                )
                full = best_pass(lambda dec=dec, work=work: decode_all(dec, work), args.passes)
                row[f"{name}_parse_ns_per_id"] = parse / n_ids * 1e9
                row[f"{name}_decode_ns_per_id"] = full / n_ids * 1e9
            rounds.append(row)
            print(
                f"| {kind} | {r} | {row['base_parse_ns_per_id']:.2f} / "
                f"{row['new_parse_ns_per_id']:.2f} | "
                f"{row['base_parse_ns_per_id'] / row['new_parse_ns_per_id']:.2f} | "
                f"{row['base_decode_ns_per_id']:.2f} / {row['new_decode_ns_per_id']:.2f} | "
                f"{row['base_decode_ns_per_id'] / row['new_decode_ns_per_id']:.2f} |",
                flush=True,
            )
        summary = {}
        for what in ("parse", "decode"):
            ratios = [x[f"base_{what}_ns_per_id"] / x[f"new_{what}_ns_per_id"] for x in rounds]
            summary[f"{what}_base_over_new"] = {
                "min": min(ratios),
                "median": statistics.median(ratios),
                "max": max(ratios),
            }
            for name in decoders:
                vals = [x[f"{name}_{what}_ns_per_id"] for x in rounds]
                summary[f"{name}_{what}_ns_per_id"] = {"min": min(vals), "max": max(vals)}
        result["kinds"][kind] = {"ids": n_ids, "rounds": rounds, "summary": summary}
    for kind, got in result["kinds"].items():
        s = got["summary"]
        print(
            f"{kind}: parse base/new {s['parse_base_over_new']['min']:.2f}-"
            f"{s['parse_base_over_new']['max']:.2f} (median "
            f"{s['parse_base_over_new']['median']:.2f}), decode "
            f"{s['decode_base_over_new']['min']:.2f}-{s['decode_base_over_new']['max']:.2f}"
        )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

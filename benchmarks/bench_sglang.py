"""Decode throughput of the SGLang and TRT-LLM event decoders (bytes in → normalised events,
and → KvIndex applied), against the checked per-event path measured in the same run.

Workload (seeded): batches of 200 BlockStored events of 8 pages × 16 tokens each (SGLang
0.5.23 map form; the same stores as TRT-LLM JSON envelopes), token ids below ``--vocab``
(default 32,000; 128,256 is Llama 3's, whose ids over 65,535 take 5 bytes in msgpack).

The SGLang typed path reads a store's token ids with the vLLM decoder's compiled loop
(``_fastwire``) into a uint32 array; the same path with msgspec reading them into a list of
Python ints (what it did before) runs beside it. The TRT-LLM rows time the poller's
``parse_answer`` and the decoder's typed reader against a plain JSON decode and the checked
reader (what it did before), on the same stores and on a mixed answer: after each store a
removal, and every other store's blocks under a LoRA adapter (the typed reader's per-block
step). Every path is timed once per round, the paths taking turns in an order that rotates
every round; a path's figure is its best round, and the before/after ratios are per round.

    python benchmarks/bench_sglang.py           # default sizes (a few seconds)
    python benchmarks/bench_sglang.py --rounds 5 --vocab 128256

Writes benchmarks/results/bench_sglang.json (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvplug.integrations.sglang.wire import SglangDecoder  # noqa: E402
from kvplug.integrations.trtllm.events import TrtllmDecoder, stored_event_data  # noqa: E402
from kvplug.integrations.trtllm.poller import parse_answer  # noqa: E402

BLOCK = 16
PAGES = 8
EVENTS = 200


def trt_mixed(trt: bytes) -> bytes:
    """The TRT-LLM answer with a removal after each store and every other store's blocks
    under a LoRA adapter; event ids stay consecutive."""
    envelopes = []
    for i, env in enumerate(json.loads(trt)):
        blocks = env["data"]["blocks"]
        if i % 2:
            blocks = [{**b, "lora_id": 3} for b in blocks]
        envelopes.append({**env, "event_id": 2 * i, "data": {**env["data"], "blocks": blocks}})
        removed = {"type": "removed", "block_hashes": [b["block_hash"] for b in blocks[-2:]]}
        envelopes.append({"event_id": 2 * i + 1, "window_size": 4096, "data": removed})
    return json.dumps(envelopes, separators=(",", ":")).encode()


def workload(seed: int, vocab: int = 32000) -> tuple[bytes, bytes, int]:
    rng = random.Random(seed)
    events, envelopes, h = [], [], 1
    for i in range(EVENTS):
        hashes = list(range(h, h + PAGES))
        h += PAGES
        tokens = [rng.randrange(vocab) for _ in range(BLOCK * PAGES)]
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": BLOCK,
                "lora_id": None,
                "medium": "GPU",
            }
        )
        envelopes.append(
            {
                "event_id": i,
                "window_size": 4096,
                "data": stored_event_data(
                    None, [(h, tokens[j * BLOCK : (j + 1) * BLOCK]) for j, h in enumerate(hashes)]
                ),
            }
        )
    sg = msgspec.msgpack.encode([1.0, events, 0])
    trt = json.dumps(envelopes, separators=(",", ":")).encode()
    return sg, trt, EVENTS * PAGES


# the rows: compiled token ids against msgspec's, decode alone and with the index applied
DECODE = "sglang decode (typed, compiled token ids)"
DECODE_BEFORE = "sglang decode (typed, msgspec token ids: before)"
BASELINE = "sglang decode (checked path, baseline)"
APPLY = "sglang decode + KvIndex.apply_many (compiled token ids)"
APPLY_BEFORE = "sglang decode + KvIndex.apply_many (msgspec token ids: before)"
TRT = "trtllm parse_answer + decode (typed reader)"
TRT_BEFORE = "trtllm JSON decode + decode (checked reader: before)"
TRT_MIXED = "trtllm, mixed answer: parse_answer + decode (typed)"
TRT_MIXED_BEFORE = "trtllm, mixed answer: JSON + decode (checked: before)"


def timed(path) -> float:
    """One timed run of ``path``: ``(setup, run)``, ``run(setup())`` timed (setup: None)."""
    setup, run = path
    state = setup() if setup is not None else None
    gc.collect()  # each path pays for the collections its own garbage causes, not another's
    t = time.perf_counter()
    run(state)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "bench_sglang.json")
    )
    args = ap.parse_args()
    sg, trt, blocks = workload(args.seed, args.vocab)

    fast = SglangDecoder("w", BLOCK)
    msgspec_ids = SglangDecoder("w", BLOCK)
    msgspec_ids._ids = None  # token ids read by msgspec into Python ints: the path before
    slow = SglangDecoder("w", BLOCK)
    slow._fast_order = ()  # the checked, per-event path: the baseline

    mixed = trt_mixed(trt)

    def trt_typed(body):  # what the poller does with an answer
        return lambda _: TrtllmDecoder("w", BLOCK).decode(parse_answer(body)[0])

    def trt_checked(body):
        return lambda _: TrtllmDecoder("w", BLOCK).decode(msgspec.json.decode(body))

    assert trt_typed(mixed)(None) == trt_checked(mixed)(None)  # the same events
    paths = {
        DECODE: (None, lambda _: fast.decode(sg)),
        DECODE_BEFORE: (None, lambda _: msgspec_ids.decode(sg)),
        BASELINE: (None, lambda _: slow.decode(sg)),
        TRT: (None, trt_typed(trt)),
        TRT_BEFORE: (None, trt_checked(trt)),
        TRT_MIXED: (None, trt_typed(mixed)),
        TRT_MIXED_BEFORE: (None, trt_checked(mixed)),
    }
    try:
        from kvplug.index import KvIndex

        def fresh_index():  # made before the clock: the rows time decode and apply alone
            index = KvIndex(block_size=BLOCK)
            index.add_endpoint("w", 0)
            return index

        def applied(dec):
            return fresh_index, lambda index: index.apply_many(dec.decode(sg))

        paths[APPLY] = applied(fast)
        paths[APPLY_BEFORE] = applied(msgspec_ids)
    except ImportError as exc:  # no compiled core built
        print(f"(KvIndex unavailable: {exc})")
    names = list(paths)
    for path in paths.values():
        timed(path)  # warm-up
    secs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            secs[name].append(timed(paths[name]))
    best = {n: blocks / min(v) for n, v in secs.items()}
    base = best[BASELINE]
    print(
        f"workload: {blocks} blocks of {BLOCK} tokens, ids below {args.vocab:,}; "
        f"{args.rounds} rounds"
    )
    print(f"{'path':62s} {'blocks/s':>12s} {'tokens/s':>14s} {'vs baseline':>12s}")
    for name in names:
        print(
            f"{name:62s} {best[name]:12,.0f} {best[name] * BLOCK:14,.0f} {best[name] / base:11.2f}x"
        )
    ratios = {}
    for what, (before, after) in {
        "decode": (DECODE_BEFORE, DECODE),
        "decode_apply": (APPLY_BEFORE, APPLY),
        "trtllm_typed_over_checked": (TRT_BEFORE, TRT),
        "trtllm_mixed_typed_over_checked": (TRT_MIXED_BEFORE, TRT_MIXED),
    }.items():
        if before not in secs:
            continue
        per_round = [b / a for b, a in zip(secs[before], secs[after], strict=True)]
        median = statistics.median(per_round)
        ratios[what] = {
            "min": min(per_round),
            "median": median,
            "max": max(per_round),
            "per_round": per_round,
        }
        print(
            f"after over before, {what}: {min(per_round):.2f}-{max(per_round):.2f}x by round "
            f"(median {median:.2f}x)"
        )
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "workload": {
                    "events": EVENTS,
                    "pages_per_event": PAGES,
                    "block_size": BLOCK,
                    "seed": args.seed,
                    "rounds": args.rounds,
                    "vocab": args.vocab,
                },
                "machine": platform.platform(),
                "python": platform.python_version(),
                "results": [
                    {"path": n, "blocks_per_s": best[n], "vs_baseline": best[n] / base}
                    for n in names
                ],
                "after_over_before": ratios,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

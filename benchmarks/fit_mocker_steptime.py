"""The step timing of NVIDIA Dynamo's mocker engine, measured, against kvplug's ``mocker`` preset.

Dynamo's offline trace replay (``run_mocker_trace_replay``, ai-dynamo-runtime 1.6.1) runs mocker
engines whose step time comes from a built-in model. kvplug's simulator can decide with the same
timing (``--steptime mocker``, :data:`kvplug.sim.steptime.MOCKER`), so that a policy judged by
Dynamo's simulator (benchmarks/bench_dynamo_replay.py) has decided knowing the engines it is
judged on. This measures the mocker with the same engine settings as that benchmark (512-token
blocks, 1,640 of them, 8,192 batched tokens) and prints, per probe, the mocker's time beside the
preset's:

* prefill: one cold prompt of n tokens on an idle engine, its time to first token (one step
  per 8,192-token chunk);
* prefill over a cached prefix: the same new tokens after a prompt that left the prefix cached
  (the mocker charges no attention over the context: the same time as cold);
* decode: B prompts of ctx tokens arriving together, 200 output tokens each; the mean step of
  the request that starts decoding last (all its steps are decode-only, all B decoding).

    python benchmarks/fit_mocker_steptime.py   # under a second; JSON in benchmarks/results/

Needs ai-dynamo-runtime (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # bench_dynamo_replay

from bench_dynamo_replay import mocker_run  # noqa: E402

from kvplug.sim.bench import BenchSpec  # noqa: E402
from kvplug.sim.steptime import MOCKER, StepTimeModel  # noqa: E402

SPEC = BenchSpec(policies=[])  # bench_dynamo_replay's engines: the same mocker settings
BLOCK = SPEC.block_tokens
PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192, 24576)
CACHED_PROBES = ((4096, 4096), (16384, 4096), (32768, 4096))  # (cached prefix, new tokens)
DECODE_PROBES = ((1, 512), (1, 8192), (16, 2048), (32, 8192), (64, 2048), (64, 8192), (128, 512))
OUTPUT = 200


class Mocker:
    """One-engine replays of small hand-made traces through Dynamo's mocker."""

    def __init__(self, dynamo, tmp: Path) -> None:
        self.dynamo, self.tmp, self.next_block = dynamo, tmp, 0

    def blocks(self, tokens: int) -> list[int]:
        n = -(-tokens // BLOCK)
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def run(self, rows: list[dict]) -> list[dict]:
        path = self.tmp / "probe.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return mocker_run(self.dynamo, path, SPEC, 1, "round_robin")

    def prefill_ms(self, tokens: int) -> float:
        row = {"timestamp": 0, "input_length": tokens, "output_length": 1}
        return self.run([{**row, "hash_ids": self.blocks(tokens)}])[0]["ttft_ms"]

    def cached_prefill_ms(self, cached: int, new: int) -> float:
        prefix = self.blocks(cached)
        rows = [
            {"timestamp": 0, "input_length": cached, "output_length": 1, "hash_ids": prefix},
            {
                "timestamp": 100_000,
                "input_length": cached + new,
                "output_length": 1,
                "hash_ids": prefix + self.blocks(new),
            },
        ]
        return [r for r in self.run(rows) if r["arrival_time_ms"] > 0][0]["ttft_ms"]

    def decode_step_ms(self, batch: int, ctx: int) -> float:
        rows = [
            {
                "timestamp": 0,
                "input_length": ctx,
                "output_length": OUTPUT,
                "hash_ids": self.blocks(ctx),
            }
            for _ in range(batch)
        ]
        last = max(self.run(rows), key=lambda r: r["first_token_ms"])
        return (last["last_token_ms"] - last["first_token_ms"]) / (OUTPUT - 1)


def preset_prefill_ms(
    model: StepTimeModel, tokens: int, cached: int = 0, chunk: int = SPEC.max_batched_tokens
) -> float:
    """The preset's time to first token of one prompt alone on an idle engine."""
    total, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        total += model.step_ms(model.prefill_ms(n, cached + done), 0, 0)
        done += n
    return total


def preset_decode_step_ms(model: StepTimeModel, batch: int, ctx: int) -> float:
    """The preset's decode-only step with ``batch`` sequences of about ``ctx + OUTPUT/2`` tokens."""
    return model.decode_only_ms(batch) + model.decode_kv_ms(int(batch * (ctx + OUTPUT / 2)))


def measure(dynamo, model: StepTimeModel = MOCKER) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        mocker = Mocker(dynamo, Path(tmp))
        for n in PREFILL_TOKENS:
            m, p = mocker.prefill_ms(n), preset_prefill_ms(model, n)
            rows.append({"probe": f"prefill {n:,} cold", "mocker_ms": m, "preset_ms": p})
        for cached, new in CACHED_PROBES:
            m, p = mocker.cached_prefill_ms(cached, new), preset_prefill_ms(model, new, cached)
            rows.append(
                {"probe": f"prefill {new:,} on {cached:,} cached", "mocker_ms": m, "preset_ms": p}
            )
        for batch, ctx in DECODE_PROBES:
            m, p = mocker.decode_step_ms(batch, ctx), preset_decode_step_ms(model, batch, ctx)
            rows.append(
                {"probe": f"decode step, {batch} x {ctx:,} tokens", "mocker_ms": m, "preset_ms": p}
            )
    for r in rows:
        r["ratio"] = r["preset_ms"] / r["mocker_ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/mocker_steptime.json")
    args = ap.parse_args()
    os.environ.setdefault("DYN_LOG", "warn")
    from importlib.metadata import version

    import dynamo._core as dynamo

    rows = measure(dynamo)
    print("| probe | Dynamo's mocker (ms) | kvplug `--steptime mocker` (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['probe']} | {r['mocker_ms']:.2f} | {r['preset_ms']:.2f} | {r['ratio']:.3f} |")
    out = {
        "command": "python benchmarks/fit_mocker_steptime.py",
        "dynamo": version("ai-dynamo-runtime"),
        "preset": {k: getattr(MOCKER, k) for k in MOCKER.__dataclass_fields__},
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

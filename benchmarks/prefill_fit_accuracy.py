"""How well the TTFT guard's prefill model predicts the prefills it is taught, by prompt size.

One replay of the conversation trace under ``affinity-fitted`` per fleet: every first token
the router teaches the fit (a request that prefilled alone, its time less the decode reads the
predictions add themselves) is recorded as the fit gets it. The same samples, in the same order,
are then fitted again offline two ways, and each model's predictions are compared with them:

* **prior**: the shipped H200 coefficients (what the default routing predicts with);
* **in full**: every prompt weighed alike in relative errors (the fit as issue 14's twenty-second
  pass first shipped it);
* **fitted**: prompts under a chunk weighed down by their share of one, squared (the fit now;
  the same model the replay ended with).

Per prompt-size group: measured / predicted at the 10th, 50th and 90th percentile. Long prompts
are what the guard turns on (the queued cold prompts a follow-up would wait behind, the latency
tail); short ones mostly wait for the step they join, which no prefill model prices. The
simulated engines' own context cost is printed beside the fitted one.

    python benchmarks/prefill_fit_accuracy.py                  # 8 and 4 engines, both ends, ~3 min
    python benchmarks/prefill_fit_accuracy.py --engines 8 --steptime causal

Prints a Markdown table; writes ``benchmarks/results/prefill_fit_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import kvplug.prefill_fit as prefill_fit  # noqa: E402
from kvplug.affinity import chunked_prefill_seconds  # noqa: E402
from kvplug.prefill_model import H200_LLAMA8B  # noqa: E402
from kvplug.sim.bench import BenchSpec, run_bench  # noqa: E402
from kvplug.sim.steptime import PRESETS as CTX_MS  # noqa: E402
from kvplug.sim.transport import PRESETS  # noqa: E402

# (label, lowest new tokens, highest): the prompt-size groups reported
GROUPS = [
    (">40k new tokens", 40_000, float("inf")),
    ("10k-40k", 10_000, 40_000),
    ("2k-10k", 2_000, 10_000),
    ("<2k", 0, 2_000),
]


def taught_samples(steptime: str, engines: int, view: str) -> list[tuple]:
    """(new, cached, chunk, seconds) of every first token the fit was given in one replay."""
    samples: list[tuple] = []
    add = prefill_fit.OnlinePrefillFit.add

    def recording_add(self, new, cached, chunk, seconds):
        samples.append((float(new), float(cached), float(chunk), float(seconds)))
        return add(self, new, cached, chunk, seconds)

    prefill_fit.OnlinePrefillFit.add = recording_add  # this process only (jobs=1)
    try:
        spec = BenchSpec(
            policies=["affinity-fitted"], link=PRESETS[view], steptime=steptime, n_engines=engines
        )
        run_bench(spec, jobs=1, progress=False)
    finally:
        prefill_fit.OnlinePrefillFit.add = add
    return samples


def refit(samples: list[tuple], weigh_short: bool) -> tuple[float, float, float]:
    fit = prefill_fit.OnlinePrefillFit(H200_LLAMA8B, weigh_short=weigh_short)
    for s in samples:
        fit.add(*s)
    return fit.model


def accuracy(samples: list[tuple], model) -> list[dict]:
    out = []
    for label, lo, hi in GROUPS:
        ratios = [
            s / chunked_prefill_seconds(n, c, ch, model)
            for n, c, ch, s in samples
            if lo < n <= hi and s > 0
        ]
        if ratios:
            p10, p50, p90 = np.quantile(ratios, [0.1, 0.5, 0.9]).tolist()
            out.append({"group": label, "n": len(ratios), "p10": p10, "p50": p50, "p90": p90})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steptime", nargs="+", default=["causal", "cached"], choices=list(CTX_MS))
    ap.add_argument("--engines", nargs="+", type=int, default=[8, 4])
    ap.add_argument("--view", default="realistic", choices=list(PRESETS))
    ap.add_argument("--json", default="benchmarks/results/prefill_fit_accuracy.json")
    args = ap.parse_args()
    t0 = time.time()
    runs = []
    for steptime in args.steptime:
        for engines in args.engines:
            print(f"replaying {engines} engines, {steptime} end ...", file=sys.stderr, flush=True)
            samples = taught_samples(steptime, engines, args.view)
            models = {
                "prior": H200_LLAMA8B,
                "in full": refit(samples, weigh_short=False),
                "fitted": refit(samples, weigh_short=True),
            }
            runs.append(
                {
                    "steptime": steptime,
                    "engines": engines,
                    "view": args.view,
                    "samples": len(samples),
                    "engines_ctx_ms": CTX_MS[steptime],
                    "models": {
                        name: {"coefficients": list(m), "accuracy": accuracy(samples, m)}
                        for name, m in models.items()
                    },
                }
            )
    groups = " · ".join(g[0] for g in GROUPS)
    print(f"\n| fleet | model | a, b, c (ms) | measured / predicted, median (p10–p90): {groups} |")
    print("|---|---|---|---|")
    for r in runs:
        for name, m in r["models"].items():
            coef = ", ".join(f"{x:.3g}" for x in m["coefficients"])
            cells = " · ".join(
                f"{a['p50']:.3f} ({a['p10']:.2f}–{a['p90']:.2f})" for a in m["accuracy"]
            )
            fleet = (
                f"{r['engines']} engines, `{r['steptime']}` (engines' c {r['engines_ctx_ms']:.3g}; "
                f"{r['samples']} samples)"
            )
            print(f"| {fleet} | {name} | {coef} | {cells} |")
    out = {"command": " ".join(["python", *sys.argv]), "runs": runs, "wall_s": time.time() - t0}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nJSON: {args.json}; wall {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

"""benchmarks/prefill_fit_accuracy.py on one fleet: the samples it records are the ones the
fit was taught (its offline refit ends at the replay's own model), and the claim it backs holds:
the fit now predicts long prefills within 2 %, where the fit in full is further off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import prefill_fit_accuracy as bench  # noqa: E402

import kvplug.affinity as affinity  # noqa: E402


def test_the_taught_samples_and_the_long_prompts_accuracy(tmp_path, monkeypatch):
    models = []  # the model each replay's fit ended with
    init = affinity.Affinity.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        models.append(self)

    monkeypatch.setattr(affinity.Affinity, "__init__", keep)
    out = tmp_path / "acc.json"
    argv = ["x", "--engines", "4", "--steptime", "cached", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    run = json.loads(out.read_text())["runs"][0]
    assert run["samples"] > 1000
    fitted = run["models"]["fitted"]
    # the offline refit of the recorded samples is the model the replay's router ended with
    assert tuple(fitted["coefficients"]) == models[-1]._prefill_model
    long = {m: run["models"][m]["accuracy"][0] for m in run["models"]}
    assert all(a["group"] == ">40k new tokens" and a["n"] > 100 for a in long.values())
    assert abs(long["fitted"]["p50"] - 1) < 0.02
    assert abs(long["in full"]["p50"] - 1) > abs(long["fitted"]["p50"] - 1)

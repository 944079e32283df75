"""Prefill-duration predictors for ``--router-prefill-load-model``.

A predictor maps (uncached prompt tokens, cached prefix tokens) to seconds. The load tracker
uses it to decay the oldest active prefill on each worker linearly over its predicted duration
(PROTOCOLS.md §4.3), so a worker whose head-of-line prefill is nearly done looks less loaded.

Plug in your own with any object that has ``predict(new_tokens, cached_tokens) -> float``.

``CalibratedPrefillModel`` is the shipped one: least squares over
``/work/shared/calibration/prefill_calib_h200.json`` (Llama-3-8B shape, bf16, one H200) of

    t(ms) = a*N + b*N^2 + c*N*P        N = new (uncached) tokens, P = cached prefix tokens

using the points where the forward pass dominates (cold prompts >= 2048 tokens; cached runs
with N >= 2048). The terms are per-token work, self-attention among the new tokens, and
attention of the new tokens over the cached prefix. Below ~2k tokens the measurement is
dominated by per-call framework overhead that a serving engine does not pay, so those points
are left out; scale the model to other GPUs/models with ``scale``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvplug.errors import ConfigError

# Least-squares fit of the H200 calibration file (see fit_from_calibration; a test refits it).
H200_LLAMA8B = (2.856258e-02, 4.243810e-07, 2.421176e-06)  # a (ms/tok), b, c (ms/tok^2)


class PrefillPredictor(Protocol):
    def predict(self, new_tokens: int, cached_tokens: int) -> float: ...


@dataclass(frozen=True)
class CalibratedPrefillModel:
    a: float = H200_LLAMA8B[0]
    b: float = H200_LLAMA8B[1]
    c: float = H200_LLAMA8B[2]
    scale: float = 1.0  # multiply predictions (another GPU / model size)

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        n = max(int(new_tokens), 0)
        p = max(int(cached_tokens), 0)
        ms = self.a * n + self.b * n * n + self.c * n * p
        return self.scale * ms / 1000.0


def calibration_points(data: dict) -> list[tuple[int, int, float]]:
    """(new tokens N, cached tokens P, milliseconds) usable for the fit."""
    pts: list[tuple[int, int, float]] = []
    for key, ms in data.get("prefill_cold_ms", {}).items():
        n = int(key)
        if n >= 2048:
            pts.append((n, 0, float(ms)))
    for key, ms in data.get("prefill_cached_ms", {}).items():
        try:
            p_part, n_part = key.split("_")
            p, n = int(p_part.lstrip("P")), int(n_part.lstrip("N"))
        except ValueError:
            raise ConfigError(f"calibration key {key!r} is not P<cached>_N<new>") from None
        if n >= 2048:
            pts.append((n, p, float(ms)))
    return pts


def fit_from_calibration(source: str | os.PathLike[str] | dict) -> CalibratedPrefillModel:
    data = source if isinstance(source, dict) else json.loads(open(source).read())
    pts = calibration_points(data)
    if len(pts) < 3:
        raise ConfigError(f"need >= 3 calibration points with >= 2048 new tokens, got {len(pts)}")
    n = np.array([p[0] for p in pts], dtype=float)
    p = np.array([p[1] for p in pts], dtype=float)
    t = np.array([p[2] for p in pts], dtype=float)
    x = np.stack([n, n * n, n * p], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(x, t, rcond=None)
    return CalibratedPrefillModel(float(a), float(b), float(c))


def make_predictor(name: str) -> PrefillPredictor | None:
    if name == "none":
        return None
    if name == "calibrated":
        return CalibratedPrefillModel()
    raise ConfigError(f"unknown prefill load model {name!r}")

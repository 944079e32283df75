"""Fit the step-time model's prefill terms from the H200 calibration file.

``data/prefill_calib_h200.json`` holds forward-pass times of a Llama-3-8B-shaped model (bf16,
batch 1, transformers + PyTorch SDPA) for cold prompts of ``L`` tokens and for ``N`` new tokens on
top of ``P`` cached ones. Two fits come out of it:

* **cold**: ``t(L) = linear·L + quad·L²`` by least squares over ``L >= 2048`` (below that a
  ~30–45 ms per-call framework overhead dominates, which a serving engine does not pay). A causal
  prompt of ``L`` tokens computes ``L²/2`` (query, key) pairs, so ``quad`` is a per-pair rate of
  ``2·quad`` ms.
* **cached**: the excess of each ``P{p}_N2048`` point over the cold cost of 2,048 tokens, fit
  as ``ctx·N·P`` (least squares through the origin). The short ``N`` points are overhead-bound
  and not used.

The cached-path per-pair rate comes out ~2.9× the causal one. Both do the same attention work per
(query, key) pair; the difference is the kernel: with ``q_len == kv_len`` SDPA runs the causal
flash kernel, with a KV cache (``q_len != kv_len``) transformers passes an explicit mask and SDPA
falls back to a slower kernel. A serving engine (vLLM's FlashAttention over the paged cache) runs
one kernel over cached and new keys, so its rate is close to the causal one. The two rates bound
what the data allows: ``causal`` (low end, the default) and ``cached`` (high end).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

COLD_MIN_TOKENS = 2048  # below: framework-overhead bound
CACHED_NEW_TOKENS = 2048  # the cached points used (the shorter ones are overhead-bound)


@dataclass(frozen=True)
class PrefillFit:
    linear_ms: float  # per new token
    quad_ms: float  # per new token squared (causal attention within the prompt)
    ctx_causal_ms: float  # per (new, cached) token pair at the causal kernel's rate = 2·quad
    ctx_cached_ms: float  # per pair, least-squares fit of the measured cached-prefill points
    cold_max_rel_err: float  # worst relative error of the cold fit over the points used
    cached_points: tuple[tuple[int, int, float, float], ...]  # (P, N, measured ms, excess ms)

    @property
    def cached_over_causal(self) -> float:
        return self.ctx_cached_ms / self.ctx_causal_ms


def bundled_calibration_path() -> Path:
    return Path(str(resources.files("kvplug.sim") / "data" / "prefill_calib_h200.json"))


def load_calibration(path: str | Path | None = None) -> dict:
    return json.loads(Path(path or bundled_calibration_path()).read_text())


def fit_prefill(calib: dict | None = None) -> PrefillFit:
    """Least-squares fit of the prefill terms (see the module docstring)."""
    calib = calib if calib is not None else load_calibration()
    cold = {int(k): float(v) for k, v in calib["prefill_cold_ms"].items()}
    lengths = np.array(sorted(L for L in cold if L >= COLD_MIN_TOKENS), dtype=np.float64)
    if len(lengths) < 2:
        raise ValueError(f"need >= 2 cold points of >= {COLD_MIN_TOKENS} tokens")
    times = np.array([cold[int(L)] for L in lengths])
    # relative least squares (each point weighted by 1/t): the 2k and 32k points count alike
    a = np.stack([lengths, lengths**2], axis=1) / times[:, None]
    (linear, quad), *_ = np.linalg.lstsq(a, np.ones_like(times), rcond=None)
    pred = linear * lengths + quad * lengths**2
    cold_err = float(np.max(np.abs(pred - times) / times))

    def cold_ms(n: int) -> float:
        return float(linear * n + quad * n * n)

    points = []
    for key, ms in calib["prefill_cached_ms"].items():
        p_txt, n_txt = key.split("_")
        p, n = int(p_txt[1:]), int(n_txt[1:])
        if n >= CACHED_NEW_TOKENS:
            points.append((p, n, float(ms), float(ms) - cold_ms(n)))
    if not points:
        raise ValueError(f"need cached points with >= {CACHED_NEW_TOKENS} new tokens")
    x = np.array([p * n for p, n, _, _ in points], dtype=np.float64)
    y = np.array([e for *_, e in points])
    ctx_cached = float(x @ y / (x @ x))
    return PrefillFit(
        linear_ms=float(linear),
        quad_ms=float(quad),
        ctx_causal_ms=2.0 * float(quad),
        ctx_cached_ms=ctx_cached,
        cold_max_rel_err=cold_err,
        cached_points=tuple(sorted(points)),
    )

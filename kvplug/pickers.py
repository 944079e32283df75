"""Pickers: turn a vector of costs, scores or loads into one candidate index.

Every picker draws its randomness from the caller's ``random.Random`` so seeded runs repeat.
Cost selection (argmin / softmax over normalised cost logits) is the core's ``select``.
"""

from __future__ import annotations

import random

import numpy as np


def softmax_cost_probs(cost: np.ndarray, temperature: float) -> np.ndarray:
    """The core's selection distribution: p_i ∝ exp(-((c_i - min)/(max - min)) / T)."""
    lo, hi = float(cost.min()), float(cost.max())
    if hi == lo or temperature <= 0:
        if temperature <= 0:
            p = (cost == lo).astype(float)
            return p / p.sum()
        return np.full(len(cost), 1.0 / len(cost))
    z = np.exp(-((cost - lo) / (hi - lo)) / temperature)
    return z / z.sum()


def softmax_score_probs(score: np.ndarray, temperature: float) -> np.ndarray:
    """p_i ∝ exp(s_i / T) (scores already in a bounded range)."""
    z = np.exp((score - score.max()) / temperature)
    return z / z.sum()


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    acc = 0.0
    for i, p in enumerate(probs.tolist()):
        acc += p
        if u < acc:
            return i
    return len(probs) - 1


def argmax_random_tie(score: np.ndarray, rng: random.Random) -> int:
    best = np.flatnonzero(score == score.max())
    return int(best[0]) if len(best) == 1 else int(best[int(rng.random() * len(best))])


def argmin_random_tie(load: np.ndarray, rng: random.Random) -> int:
    best = np.flatnonzero(load == load.min())
    return int(best[0]) if len(best) == 1 else int(best[int(rng.random() * len(best))])


def weighted_random(score: np.ndarray, rng: random.Random) -> tuple[int, np.ndarray]:
    """Probability proportional to score (llm-d's weighted-random picker draws key U^(1/s),
    whose maximum has exactly this distribution). All-zero scores: uniform."""
    s = np.clip(score, 0.0, None)
    total = float(s.sum())
    probs = s / total if total > 0 else np.full(len(s), 1.0 / len(s))
    return inverse_cdf(probs, rng.random()), probs


def power_of_two(load: np.ndarray, rng: random.Random) -> int:
    n = len(load)
    if n == 1:
        return 0
    a = rng.randrange(n)
    b = rng.randrange(n - 1)
    if b >= a:
        b += 1
    if load[a] == load[b]:
        return min(a, b) if rng.random() < 0.5 else max(a, b)
    return a if load[a] < load[b] else b


def device_aware_weighted(
    inflight: np.ndarray, is_cpu: np.ndarray, accelerator_weight: float, rng: random.Random
) -> tuple[int, dict[str, float]]:
    """Dynamo's device-aware-weighted: compare total_inflight(group)/(instances(group)*weight)
    between the CPU and accelerator groups (weight 1 for CPU), then least-loaded inside the
    winner. One class present: plain least-loaded."""
    cpu = is_cpu.astype(bool)
    n_cpu = int(cpu.sum())
    if n_cpu == 0 or n_cpu == len(cpu):
        return argmin_random_tie(inflight, rng), {}
    load_cpu = float(inflight[cpu].sum()) / (n_cpu * 1.0)
    load_acc = float(inflight[~cpu].sum()) / ((len(cpu) - n_cpu) * accelerator_weight)
    if load_cpu < load_acc:
        group = cpu
    elif load_acc < load_cpu:
        group = ~cpu
    else:  # tie: the faster class
        group = ~cpu
    idx = np.flatnonzero(group)
    pick = idx[argmin_random_tie(inflight[idx], rng)]
    return int(pick), {"cpu_group_load": load_cpu, "accelerator_group_load": load_acc}

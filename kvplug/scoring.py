"""Scoring: the routing seed's KV cost (via the core) and the llm-d style scorers.

Scorers return values in [0, 1] (higher is better); the profile clamps, weights and sums them.
A missing or stale attribute scores 0 (never "idle") and is left out of adaptive ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvplug.decision import AgeRecord
from kvplug.errors import ConfigError
from kvplug.workers import AttributeTable


@dataclass
class ScoringContext:
    """What scorers may read for one decision (vectors over the candidates)."""

    endpoints: np.ndarray
    attrs: AttributeTable
    ep_worker: tuple[str | None, ...]
    now: float
    max_age: float
    request_blocks: float
    device: np.ndarray
    host: np.ndarray
    disk: np.ndarray
    shared_beyond: np.ndarray
    inflight: np.ndarray
    kv_cost: Callable[[], np.ndarray]  # lazily computed seed cost
    ages: list[AgeRecord] = field(default_factory=list)

    def attribute(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, present mask); stale = missing. Records ages for the decision."""
        vals, fresh, ages = self.attrs.read(name, self.endpoints, self.now, self.max_age)
        self.ages.append(AgeRecord(name, self.endpoints, ages, self.ep_worker))
        return np.where(fresh, vals, 0.0), fresh


def _minmax_lower_better(v: np.ndarray, present: np.ndarray) -> np.ndarray:
    out = np.zeros(len(v))
    if not present.any():
        return out
    lo, hi = float(v[present].min()), float(v[present].max())
    if hi == lo:
        out[present] = 1.0
    else:
        out[present] = (hi - v[present]) / (hi - lo)
    return out


class Scorer:
    type_name = ""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def score(self, ctx: ScoringContext) -> np.ndarray:
        raise NotImplementedError


class PrefixCacheScorer(Scorer):
    """Fraction of the prompt's blocks cached on the candidate, tiers weighted (llm-d per-medium
    weights: gpu 1.0, cpu 0.8; disk 0.5 here)."""

    type_name = "prefix-cache-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        if ctx.request_blocks <= 0:
            return np.zeros(len(ctx.endpoints))
        w = self.params.get("tierWeights", {})
        hit = (
            ctx.device * float(w.get("device", 1.0))
            + ctx.host * float(w.get("host", 0.8))
            + ctx.disk * float(w.get("disk", 0.5))
        )
        return hit / ctx.request_blocks


class KvCostScorer(Scorer):
    """The routing seed's cost, mapped to [0, 1]: 1 - (c - min)/(max - min); all equal -> 1."""

    type_name = "kv-cost-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        return _minmax_lower_better(ctx.kv_cost(), np.ones(len(ctx.endpoints), dtype=bool))


class QueueScorer(Scorer):
    """Waiting requests (attribute ``queue_depth``), min-max lower-is-better; missing -> 0."""

    type_name = "queue-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        v, present = ctx.attribute(self.params.get("attribute", "queue_depth"))
        return _minmax_lower_better(v, present)


class LoadAwareScorer(Scorer):
    """llm-d's load-aware scorer on ``queue_depth``: empty queue 0.5, then linear down to 0 at
    ``threshold`` (128) waiting requests; missing -> 0."""

    type_name = "load-aware-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        v, present = ctx.attribute(self.params.get("attribute", "queue_depth"))
        threshold = float(self.params.get("threshold", 128))
        return np.where(present, 0.5 * np.clip(1.0 - v / threshold, 0.0, 1.0), 0.0)


class RunningRequestsScorer(Scorer):
    """Requests the router has in flight on the candidate, min-max lower-is-better."""

    type_name = "running-requests-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        return _minmax_lower_better(
            ctx.inflight.astype(float), np.ones(len(ctx.endpoints), dtype=bool)
        )


class KvCacheUtilizationScorer(Scorer):
    """1 - kv_usage (attribute ``kv_usage`` in [0, 1]); missing -> 0."""

    type_name = "kv-cache-utilization-scorer"

    def score(self, ctx: ScoringContext) -> np.ndarray:
        v, present = ctx.attribute(self.params.get("attribute", "kv_usage"))
        return np.where(present, 1.0 - v, 0.0)


class AttributeScorer(Scorer):
    """Generic numeric attribute: ``linear_lower_is_better`` / ``linear_higher_is_better`` with
    ``adaptiveRange`` (min/max over this decision's candidates that have it; all equal -> 1) or
    ``fixedRange: {min, max}`` (clamped). Missing -> 0, left out of the range."""

    type_name = "endpoint-attribute-scorer"

    def __init__(self, params: dict[str, Any]) -> None:
        super().__init__(params)
        attribute = params.get("attributeKey") or params.get("attribute")
        if not attribute:
            raise ConfigError(f"{self.type_name} needs attributeKey")
        self.attribute = str(attribute)
        algo = params.get("algorithm", {})
        if isinstance(algo, str):
            algo = {"type": algo}
        self.higher = algo.get("type", "linear_lower_is_better") == "linear_higher_is_better"
        if algo.get("type", "linear_lower_is_better") not in (
            "linear_lower_is_better",
            "linear_higher_is_better",
        ):
            raise ConfigError(f"{self.type_name}: unknown algorithm type {algo.get('type')!r}")
        norm = algo.get("normalization", params.get("normalization", "adaptiveRange"))
        self.fixed: tuple[float, float] | None = None
        if isinstance(norm, dict) and "fixedRange" in norm:
            fr = norm["fixedRange"]
            self.fixed = (float(fr["min"]), float(fr["max"]))
            if self.fixed[1] <= self.fixed[0]:
                raise ConfigError(f"{self.type_name}: fixedRange max must exceed min")
        elif norm not in ("adaptiveRange", {"adaptiveRange": {}}, None) and not (
            isinstance(norm, dict) and "adaptiveRange" in norm
        ):
            raise ConfigError(
                f"{self.type_name}: normalization {norm!r} is not "
                "adaptiveRange or fixedRange{min,max}"
            )

    def score(self, ctx: ScoringContext) -> np.ndarray:
        v, present = ctx.attribute(self.attribute)
        out = np.zeros(len(v))
        if not present.any():
            return out
        if self.fixed is not None:
            lo, hi = self.fixed
        else:
            lo, hi = float(v[present].min()), float(v[present].max())
            if hi == lo:
                out[present] = 1.0
                return out
        x = np.clip((v[present] - lo) / (hi - lo), 0.0, 1.0)
        out[present] = x if self.higher else 1.0 - x
        return out


SCORERS: dict[str, type[Scorer]] = {
    cls.type_name: cls
    for cls in (
        PrefixCacheScorer,
        KvCostScorer,
        QueueScorer,
        LoadAwareScorer,
        RunningRequestsScorer,
        KvCacheUtilizationScorer,
        AttributeScorer,
    )
}
SCORERS["precise-prefix-cache-scorer"] = PrefixCacheScorer
SCORERS["attribute-scorer"] = AttributeScorer

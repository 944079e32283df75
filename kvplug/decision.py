"""A routing decision and everything needed to explain it.

The hot path stores numpy vectors (candidates, overlaps, loads, costs or scores); the
per-candidate view, the JSON form and the formula text are built only when asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvplug.pipeline import RouteContext


@dataclass(frozen=True)
class Exclusion:
    """A worker (``dp_rank`` None: every rank) a filter left out of a decision, and why."""

    worker_id: str
    dp_rank: int | None  # None: every rank of the worker
    filter: str
    reason: str


class ExclusionGroup:
    """Endpoints one filter excluded, expanded into Exclusions (with reasons) only on demand."""

    __slots__ = ("filter", "endpoints", "reason", "ep_worker", "ep_rank")

    def __init__(
        self,
        filter: str,
        endpoints: np.ndarray,
        reason: Callable[[int], str],
        ep_worker: tuple[str | None, ...],
        ep_rank: tuple[int, ...],
    ) -> None:
        self.filter = filter
        self.endpoints = endpoints
        self.reason = reason
        self.ep_worker = ep_worker
        self.ep_rank = ep_rank

    def expand(self) -> list[Exclusion]:
        return [
            Exclusion(self.ep_worker[ep] or "?", self.ep_rank[ep], self.filter, self.reason(ep))
            for ep in self.endpoints.tolist()
        ]


def expand_exclusions(items: Sequence[Exclusion | ExclusionGroup]) -> list[Exclusion]:
    out: list[Exclusion] = []
    for item in items:
        if isinstance(item, ExclusionGroup):
            out.extend(item.expand())
        else:
            out.append(item)
    return out


class AgeRecord:
    """Ages of one attribute over the endpoints a filter or scorer read (vectors; NaN =
    never observed); turned into a per-worker dict only when asked for."""

    __slots__ = ("attribute", "endpoints", "ages", "ep_worker")

    def __init__(
        self,
        attribute: str,
        endpoints: np.ndarray,
        ages: np.ndarray,
        ep_worker: tuple[str | None, ...],
    ) -> None:
        self.attribute = attribute
        self.endpoints = endpoints
        self.ages = ages
        self.ep_worker = ep_worker


class CandidateTrace:
    """Vectors over the scored candidates, kept as computed; names resolved on demand."""

    __slots__ = (
        "_ep_worker",
        "_ep_rank",
        "endpoints",
        "kind",
        "values",
        "inputs",
        "params",
        "probabilities",
        "penalised",
        "score_parts",
        "_names",
    )

    def __init__(
        self,
        ep_worker: tuple[str | None, ...],
        ep_rank: tuple[int, ...],
        endpoints: np.ndarray,
        kind: str,  # "cost" (lower wins), "score" (higher wins) or "load" (lower wins)
        values: np.ndarray,
        inputs: dict[str, np.ndarray] | None = None,
        params: dict[str, float] | None = None,
        probabilities: np.ndarray | None = None,
        penalised: np.ndarray | None = None,
        score_parts: dict[str, np.ndarray] | None = None,
    ) -> None:
        self._ep_worker = ep_worker  # immutable snapshots shared with the router
        self._ep_rank = ep_rank
        self.endpoints = endpoints
        self.kind = kind
        self.values = values
        self.inputs = inputs or {}
        self.params = params or {}
        self.probabilities = probabilities
        self.penalised = penalised
        self.score_parts = score_parts
        self._names: list[tuple[str, int]] | None = None

    @property
    def names(self) -> list[tuple[str, int]]:
        """(worker_id, dp_rank) per candidate."""
        if self._names is None:
            self._names = [
                (self._ep_worker[e] or "?", self._ep_rank[e]) for e in self.endpoints.tolist()
            ]
        return self._names


class Decision:
    """Where one request goes and why: ``worker_id`` and ``dp_rank`` of the pick,
    ``overlap_blocks`` / ``cached_tokens`` it holds of the prompt, ``mode``, ``stage``,
    ``fallback`` (a threshold filter kept the least-bad), ``excluded`` (every worker left
    out, with the filter and the reason), ``candidates`` (each scored candidate's inputs,
    value and formula), ``explain()`` (one line) and ``to_dict()`` / ``to_json()``.
    ``decision_id`` counts booked decisions (0 for a preview). Built by the router's explain
    stage from what the other stages reported; its vectors are its own (they never change
    after the fact)."""

    __slots__ = (
        "worker_id",
        "dp_rank",
        "endpoint_id",
        "decision_id",
        "request_id",
        "mode",
        "stage",
        "fallback",
        "fallback_filters",
        "_excluded",
        "_static_excluded",
        "elapsed_us",
        "_age_records",
        "overlap_blocks",
        "cached_tokens",
        "prompt_tokens",
        "request_blocks",
        "chosen_index",
        "_trace",
        "conditional_disagg",
    )

    def __init__(
        self,
        *,
        worker_id: str,
        dp_rank: int,
        endpoint_id: int,
        decision_id: int,
        request_id: str,
        mode: str,
        stage: str,
        fallback: bool,
        fallback_filters: list[str],
        excluded: list[Exclusion | ExclusionGroup],
        static_excluded: tuple[Exclusion, ...] = (),
        elapsed_us: float,
        attribute_ages: list[AgeRecord],
        overlap_blocks: int,
        cached_tokens: int,
        prompt_tokens: int,
        request_blocks: int = 0,
        chosen_index: int,
        trace: CandidateTrace,
    ) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.endpoint_id = endpoint_id
        self.decision_id = decision_id
        self.request_id = request_id
        self.mode = mode
        self.stage = stage
        self.fallback = fallback
        self.fallback_filters = fallback_filters
        self._excluded = excluded
        self._static_excluded = static_excluded  # draining / wrong role: shared, precomputed
        self.elapsed_us = elapsed_us
        self._age_records = attribute_ages
        self.overlap_blocks = overlap_blocks
        self.cached_tokens = cached_tokens
        self.prompt_tokens = prompt_tokens
        self.request_blocks = request_blocks  # a trailing partial block counts
        self.chosen_index = chosen_index
        self._trace = trace
        # set by the two-stage dispatch: why the remote prefill stage was used or skipped
        # (kvplug.disagg.BypassVerdict.to_dict())
        self.conditional_disagg: dict[str, Any] | None = None

    @classmethod
    def assemble(
        cls,
        ctx: RouteContext,
        worker_id: str,
        dp_rank: int,
        endpoint_id: int,
        mode: str,
        elapsed_us: float,
    ) -> Decision:
        """The decision, from what each routing stage reported in ``ctx`` (kvplug.pipeline):
        candidates (static exclusions, prompt size), filters (exclusions, fallbacks, attribute
        ages), score and pick (the trace, the chosen index), book (cached blocks, id).
        Keeps no reference to ``ctx`` or the request (a stored decision must not hold the
        prompt)."""
        d = cls.__new__(cls)
        d.worker_id = worker_id
        d.dp_rank = dp_rank
        d.endpoint_id = endpoint_id
        d.decision_id = ctx.decision_id
        d.request_id = ctx.req.request_id
        d.mode = mode
        d.stage = ctx.stage
        report = ctx.report
        if report is None:
            d.fallback = False
            d.fallback_filters = []
            d._excluded = []
            d._age_records = []
        else:
            d.fallback_filters = report.fallback_filters
            d.fallback = bool(report.fallback_filters)
            d._excluded = report.excluded
            d._age_records = report.attribute_ages
        d._static_excluded = ctx.static_excluded
        d.elapsed_us = elapsed_us
        cached = ctx.cached_blocks
        d.overlap_blocks = cached
        d.cached_tokens = ctx.cached_tokens
        d.prompt_tokens = ctx.n_tokens
        d.request_blocks = ctx.full_blocks
        d.chosen_index = ctx.chosen
        d._trace = ctx.trace  # type: ignore[assignment]
        d.conditional_disagg = None
        return d

    # ---------------------------------------------------------------- views
    @property
    def attribute_ages(self) -> dict[str, dict[str, float | None]]:
        """``{worker_id: {attribute: age in seconds, None = never observed}}`` for every
        attribute a filter or scorer read in this decision."""
        out: dict[str, dict[str, float | None]] = {}
        for rec in self._age_records:
            for ep, age in zip(rec.endpoints.tolist(), rec.ages.tolist(), strict=True):
                wid = rec.ep_worker[ep] or "?"
                out.setdefault(wid, {})[rec.attribute] = None if age != age else round(age, 6)
        return out

    @property
    def excluded(self) -> list[Exclusion]:
        """Every worker not picked from, with the filter and the reason: draining or wrong role
        for the stage first, then the request's filters in order."""
        return [*self._static_excluded, *expand_exclusions(self._excluded)]

    @property
    def trace(self) -> CandidateTrace:
        return self._trace

    def chosen_input(self, name: str) -> float | None:
        """One input of the pick's score (e.g. ``device``, ``decode_blocks``), if recorded."""
        vec = self._trace.inputs.get(name)
        return None if vec is None else float(vec[self.chosen_index])

    @property
    def candidates(self) -> list[dict[str, Any]]:
        """One dict per scored candidate: ids, inputs, value, formula, probability."""
        t = self._trace
        out = []
        for i, (wid, rank) in enumerate(t.names):
            row: dict[str, Any] = {"worker_id": wid, "dp_rank": rank, t.kind: _num(t.values[i])}
            for name, vec in t.inputs.items():
                row[name] = _num(vec[i])
            if t.score_parts:
                row["scores"] = {k: _num(v[i]) for k, v in t.score_parts.items()}
            if t.probabilities is not None:
                row["probability"] = float(t.probabilities[i])
            if t.penalised is not None and t.penalised[i]:
                row["missing_attribute_penalty"] = True
            row["formula"] = self._formula(i)
            row["chosen"] = i == self.chosen_index
            out.append(row)
        return out

    @property
    def scores(self) -> dict[str, float]:
        """``worker_id[/rank]`` -> cost, score or load."""
        t = self._trace
        return {_label(w, r, t.names): float(t.values[i]) for i, (w, r) in enumerate(t.names)}

    def _formula(self, i: int) -> str:
        t = self._trace
        wid, rank = t.names[i]
        label = _label(wid, rank, t.names)
        if t.kind == "cost":
            x = {k: float(v[i]) for k, v in t.inputs.items()}
            p = t.params
            credit = p["overlap_score_credit"] * x.get("credit_factor", 1.0)
            adjusted = max(
                x["prefill_blocks"]
                - credit * x["device"]
                - p["host_cache_hit_weight"] * x["host"]
                - p["disk_cache_hit_weight"] * x["disk"]
                - p["shared_cache_multiplier"] * x["shared_beyond"],
                0.0,
            )
            tiers = f"device {_g(x['device'])}/{_g(self.request_blocks)}"
            for name in ("host", "disk", "shared_beyond"):
                if x.get(name):
                    tiers += f", {name} {_g(x[name])}"
            if x.get("active_prefix"):  # blocks of this prompt already in flight there
                tiers += f", {_g(x['active_prefix'])} already active"
            # lmetric multiplies the scaled adjusted prefill by (decode + 1); linear adds decode
            combine = (
                f" x ({_g(x['decode_blocks'])} + 1)"
                if p.get("lmetric")
                else f" + {_g(x['decode_blocks'])}"
            )
            text = (
                f"cost({label})={float(t.values[i]):.1f} = {_g1(p['prefill_load_scale'])}*"
                f"{_g(adjusted)}{combine} ({tiers}; "
                f"prefill {_g(x['prefill_blocks'])} - {_g1(credit)}*"
                f"{_g(x['device'])}"
            )
            if x.get("host"):
                text += f" - {_g(p['host_cache_hit_weight'])}*{_g(x['host'])}"
            if x.get("disk"):
                text += f" - {_g(p['disk_cache_hit_weight'])}*{_g(x['disk'])}"
            if x.get("shared_beyond"):
                text += f" - {_g(p['shared_cache_multiplier'])}*{_g(x['shared_beyond'])}"
            text += ")"
            if t.penalised is not None and t.penalised[i]:
                text += f" x (1+{_g(p['missing_penalty'])}) missing attribute"
            return text
        if t.kind == "score":
            parts = " + ".join(f"{k}={_g(v[i])}" for k, v in (t.score_parts or {}).items())
            return f"score({label})={_g(t.values[i])} = {parts}" if parts else f"score({label})="
        inputs = ", ".join(f"{k}={_g(v[i])}" for k, v in t.inputs.items())
        return f"load({label})={_g(t.values[i])} ({inputs})"

    def explain(self) -> str:
        """One line: the pick and its formula, plus fallbacks and exclusion count."""
        text = f"{self.mode}: {_label(self.worker_id, self.dp_rank, self._trace.names)} <- "
        text += self._formula(self.chosen_index)
        if self._trace.probabilities is not None:
            text += f" p={float(self._trace.probabilities[self.chosen_index]):.3f}"
        if self.fallback:
            text += f" [fallback: {', '.join(self.fallback_filters)}]"
        if self.excluded:
            text += f" [{len(self.excluded)} excluded]"
        if self.conditional_disagg is not None:
            text += f" [conditional disagg: {self.conditional_disagg['reason']}]"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "request_id": self.request_id,
            "worker_id": self.worker_id,
            "dp_rank": self.dp_rank,
            "mode": self.mode,
            "stage": self.stage,
            "fallback": self.fallback,
            "fallback_filters": list(self.fallback_filters),
            "overlap_blocks": self.overlap_blocks,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "request_blocks": self.request_blocks,
            "elapsed_us": round(self.elapsed_us, 3),
            "explain": self.explain(),
            "params": dict(self._trace.params),
            "candidates": self.candidates,
            "excluded": [asdict(e) for e in self.excluded],
            "attribute_ages": self.attribute_ages,
            "conditional_disagg": self.conditional_disagg,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __repr__(self) -> str:
        return f"Decision({self.explain()})"


def _label(wid: str, rank: int, names: list[tuple[str, int]]) -> str:
    return wid if rank == 0 else f"{wid}/{rank}"


def _num(v: Any) -> float | int:
    f = float(v)
    return int(f) if f.is_integer() and abs(f) < 2**53 else f


def _g1(v: Any) -> str:
    """A weight: at least one decimal (1.0, 0.75)."""
    f = float(v)
    return f"{f:.1f}" if f.is_integer() else f"{f:.4g}"


def _g(v: Any) -> str:
    """Compact number: 5 for 5.0, 0.75, 12.33."""
    f = float(v)
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return f"{f:.4g}"

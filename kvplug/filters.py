"""Candidate filters, applied before any scoring, each exclusion recorded with its reason.

Order (PROTOCOLS.md §4.2 plus the llm-d filters): allow-list -> exact pin -> DP-rank bounds ->
required taints -> busy thresholds -> label selector -> attribute thresholds.

Hard filters (allow-list, pin, DP bounds, taints, labels) that leave nothing raise
``NoCompatibleWorker``. Threshold filters (busy, attributes) that would leave nothing either
keep the least-bad candidates (fallback-on-empty; the decision is marked) or raise
``AllWorkersOverloaded``; a pinned worker over a busy threshold raises
``PinnedWorkerOverloaded`` (never rerouted).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvplug.config import AttributeThreshold
from kvplug.decision import AgeRecord, Exclusion, ExclusionGroup, expand_exclusions
from kvplug.errors import AllWorkersOverloaded, NoCompatibleWorker, PinnedWorkerOverloaded
from kvplug.request import RoutingHints
from kvplug.workers import AttributeTable, WorkerState

_VOPS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
    "==": operator.eq,
    "!=": operator.ne,
}


@dataclass
class FilterResult:
    candidates: np.ndarray
    excluded: list[Exclusion | ExclusionGroup] = field(default_factory=list)
    fallback_filters: list[str] = field(default_factory=list)
    penalised: set[int] = field(default_factory=set)  # endpoint ids with a missing attribute
    attribute_ages: list[AgeRecord] = field(default_factory=list)


@dataclass(frozen=True)
class BusyThresholds:
    decode_frac: float | None = None  # x kv capacity blocks
    prefill_tokens: float | None = None
    prefill_frac: float | None = None  # x max batched tokens
    fallback: bool = False

    @property
    def active(self) -> bool:
        return (
            self.decode_frac is not None
            or self.prefill_tokens is not None
            or self.prefill_frac is not None
        )


class EndpointView(Protocol):
    """What the filters read about endpoints (the router, which owns and updates it)."""

    @property
    def ep_worker(self) -> tuple[str | None, ...]: ...
    @property
    def ep_rank(self) -> tuple[int, ...]: ...
    @property
    def ep_state(self) -> tuple[WorkerState | None, ...]: ...

    ep_rank_arr: np.ndarray
    kv_capacity: np.ndarray
    max_batched: np.ndarray
    decode_limit: np.ndarray  # see busy_limits
    prefill_limit: np.ndarray
    attrs: AttributeTable


def hard_filters(
    view: EndpointView,
    cands: np.ndarray,
    hints: RoutingHints,
    exclude_workers: frozenset[str],
    known_workers: dict[str, WorkerState],
    res: FilterResult,
    exclusion_reasons: Mapping[str, str] | None = None,
) -> np.ndarray:
    """allow-list, explicit exclusions (retries, unhealthy workers: ``exclusion_reasons``
    says why, per worker), pin, DP-rank bounds, required taints."""
    ex = res.excluded

    def eps_of(worker_ids: Iterable[str]) -> list[int]:
        return [
            ep for w in worker_ids if w in known_workers for ep in known_workers[w].endpoint_ids
        ]

    if hints.allowed_worker_ids is not None:
        allowed = hints.allowed_worker_ids
        if hints.pinned_worker_id is not None and hints.pinned_worker_id not in allowed:
            raise NoCompatibleWorker(
                f"pinned worker {hints.pinned_worker_id} is not in the allowed set "
                f"{sorted(allowed)}"
            )
        cands = _keep(
            view,
            cands,
            _member(cands, eps_of(allowed)),
            ex,
            "allow-list",
            lambda ep: "not in the request's allowed worker ids",
        )
    if exclude_workers:
        reasons = exclusion_reasons or {}

        def why_excluded(ep: int) -> str:
            return reasons.get(view.ep_worker[ep] or "", "excluded by the caller (retry)")

        cands = _keep(
            view,
            cands,
            ~_member(cands, eps_of(exclude_workers)),
            ex,
            "exclude-workers",
            why_excluded,
        )
    if hints.pinned_worker_id is not None:
        wid = hints.pinned_worker_id
        st = known_workers.get(wid)
        if st is None:
            raise NoCompatibleWorker(f"pinned worker {wid} is not registered")
        if st.draining:
            raise NoCompatibleWorker(f"pinned worker {wid} is draining")
        cands = _keep(
            view,
            cands,
            _member(cands, st.endpoint_ids),
            ex,
            "pin",
            lambda ep: f"request pinned to worker {wid}",
        )
        if hints.pinned_dp_rank is not None and hints.pinned_dp_rank not in st.worker.dp_ranks:
            r = st.worker.dp_ranks
            raise NoCompatibleWorker(
                f"pinned dp rank {hints.pinned_dp_rank} of worker {wid} is outside "
                f"[{r.start}, {r.stop})"
            )
    if hints.pinned_dp_rank is not None:
        rank = hints.pinned_dp_rank
        cands = _keep(
            view,
            cands,
            view.ep_rank_arr[cands] == rank,
            ex,
            "dp-rank",
            lambda ep: f"dp rank {view.ep_rank[ep]} != pinned rank {rank}",
        )
    if hints.required_taints:
        need = hints.required_taints
        tainted = [w for w, st in known_workers.items() if need <= st.worker.taints]

        def missing_taints(ep: int) -> str:
            st = view.ep_state[ep]
            return f"missing taints {sorted(need - (st.worker.taints if st else frozenset()))}"

        cands = _keep(
            view, cands, _member(cands, eps_of(tainted)), ex, "required-taints", missing_taints
        )
    if len(cands) == 0:
        raise NoCompatibleWorker(_empty_message("no compatible worker", ex))
    return cands


def _member(cands: np.ndarray, eps: Sequence[int]) -> np.ndarray:
    """Bool mask: which candidates are in ``eps`` (a few ids: compare; many: isin)."""
    if len(eps) <= 8:
        mask = np.zeros(len(cands), dtype=bool)
        for e in eps:
            mask |= cands == e
        return mask
    return np.isin(cands, np.asarray(eps, dtype=np.int64))


def busy_limits(
    busy: BusyThresholds, kv_capacity: np.ndarray, max_batched: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per endpoint: (decode-block limit, prefill-token limit); inf = no limit. Recomputed only
    when thresholds or workers change, so a decision compares two gathers."""
    decode = np.full(len(kv_capacity), np.inf)
    if busy.decode_frac is not None:
        decode = np.where(kv_capacity > 0, busy.decode_frac * kv_capacity, np.inf)
    prefill = np.full(len(max_batched), np.inf)
    if busy.prefill_tokens is not None:
        prefill = np.minimum(prefill, float(busy.prefill_tokens))
    if busy.prefill_frac is not None:
        prefill = np.minimum(
            prefill, np.where(max_batched > 0, busy.prefill_frac * max_batched, np.inf)
        )
    return decode, prefill


def busy_mask(
    view: EndpointView, cands: np.ndarray, prefill_tokens: np.ndarray, decode_blocks: np.ndarray
) -> np.ndarray:
    """Busy flag per candidate (the thresholds are OR-ed)."""
    return (decode_blocks[cands] > view.decode_limit[cands]) | (
        prefill_tokens[cands] > view.prefill_limit[cands]
    )


def busy_badness(
    view: EndpointView, cands: np.ndarray, prefill_tokens: np.ndarray, decode_blocks: np.ndarray
) -> np.ndarray:
    """Worst load/limit ratio per candidate (> 1 = busy); ranks candidates for the fallback."""

    def ratio(load: np.ndarray, limit: np.ndarray) -> np.ndarray:
        out = np.zeros(len(load))
        finite = np.isfinite(limit)
        pos = finite & (limit > 0)
        out[pos] = load[pos] / limit[pos]
        zero = finite & (limit <= 0) & (load > 0)
        out[zero] = np.inf
        return out

    return np.maximum(
        ratio(decode_blocks[cands], view.decode_limit[cands]),
        ratio(prefill_tokens[cands], view.prefill_limit[cands]),
    )


def busy_reason(
    view: EndpointView,
    ep: int,
    busy: BusyThresholds,
    prefill_tokens: np.ndarray,
    decode_blocks: np.ndarray,
) -> str:
    parts = []
    cap, mbt = view.kv_capacity[ep], view.max_batched[ep]
    if busy.decode_frac is not None and cap > 0 and decode_blocks[ep] > busy.decode_frac * cap:
        parts.append(
            f"active decode blocks {decode_blocks[ep]:g} > {busy.decode_frac:g} x capacity {cap:g}"
        )
    if busy.prefill_tokens is not None and prefill_tokens[ep] > busy.prefill_tokens:
        parts.append(f"active prefill tokens {prefill_tokens[ep]:g} > {busy.prefill_tokens:g}")
    if busy.prefill_frac is not None and mbt > 0 and prefill_tokens[ep] > busy.prefill_frac * mbt:
        parts.append(
            f"active prefill tokens {prefill_tokens[ep]:g} > {busy.prefill_frac:g} x "
            f"max_batched_tokens {mbt:g}"
        )
    return "; ".join(parts) or "busy"


def label_filter(
    view: EndpointView, cands: np.ndarray, selector: dict[str, str], res: FilterResult
) -> np.ndarray:
    def matches(ep: int) -> bool:
        st = view.ep_state[ep]
        labels = st.worker.labels if st is not None else {}
        return all(labels.get(k) == v for k, v in selector.items())

    def why(ep: int) -> str:
        st = view.ep_state[ep]
        labels = st.worker.labels if st is not None else {}
        bad = {k: labels.get(k) for k, v in selector.items() if labels.get(k) != v}
        return f"labels {bad} do not match selector {selector}"

    mask = np.fromiter((matches(ep) for ep in cands.tolist()), dtype=bool, count=len(cands))
    return _keep(view, cands, mask, res.excluded, "label-selector", why)


def attribute_filter(
    view: EndpointView,
    cands: np.ndarray,
    th: AttributeThreshold,
    now: float,
    max_age: float,
    res: FilterResult,
) -> np.ndarray:
    """One attribute threshold; returns the survivors (fallback: least-bad) or raises."""
    vals, fresh, ages = view.attrs.read(th.attribute, cands, now, max_age)
    res.attribute_ages.append(AgeRecord(th.attribute, cands, ages, view.ep_worker))
    keep = _VOPS[th.op](vals, th.value) & fresh  # comparisons never warn, NaN or not
    missing = ~fresh
    if th.on_missing == "penalise":
        keep |= missing
        res.penalised.update(cands[missing].tolist())
    if _all(keep):
        return cands
    # badness of the failing ones: distance past the threshold; a missing one is inf ("worst")
    # or not eligible at all ("exclude": nan)
    if th.op in ("<=", "<"):
        bad = vals - th.value
    elif th.op in (">=", ">"):
        bad = th.value - vals
    else:
        bad = np.ones(len(cands))
    bad = np.where(missing, np.inf if th.on_missing == "worst" else np.nan, bad)
    name = f"attribute:{th.attribute}"

    def reason(i: int) -> str:
        if missing[i]:
            age = ages[i]
            state = "missing" if age != age else f"stale ({age:.3g}s > {max_age:g}s)"
            tail = ": treated as worst" if th.on_missing == "worst" else ""
            return f"{th.attribute} {state}{tail}"
        return f"{th.attribute}={vals[i]:g} fails {th.op} {th.value:g}"

    eligible = ~keep & ~np.isnan(bad)
    fallback = not _any(keep) and th.fallback_on_empty and _any(eligible)
    if fallback:  # keep the least-bad
        keep = eligible & (bad == bad[eligible].min())
        res.fallback_filters.append(name)
    for i in np.flatnonzero(~keep).tolist():
        ep = int(cands[i])
        res.excluded.append(Exclusion(view.ep_worker[ep] or "?", view.ep_rank[ep], name, reason(i)))
    if not _any(keep):
        raise AllWorkersOverloaded(
            _empty_message(
                f"every eligible worker fails {th.attribute} {th.op} {th.value:g}", res.excluded
            )
        )
    return cands[keep]


def apply_busy_and_labels(
    view: EndpointView,
    cands: np.ndarray,
    busy: BusyThresholds,
    selector: dict[str, str],
    prefill_tokens: np.ndarray,
    decode_blocks: np.ndarray,
    pinned: bool,
    res: FilterResult,
) -> np.ndarray:
    """Busy thresholds then the label selector, with the error classes decided correctly:
    nothing matching the labels is NoCompatibleWorker even if busy ones were removed first."""
    is_busy = busy_mask(view, cands, prefill_tokens, decode_blocks) if busy.active else None

    def busy_exclusion(ep: int) -> Exclusion:
        reason = busy_reason(view, ep, busy, prefill_tokens, decode_blocks)
        return Exclusion(view.ep_worker[ep] or "?", view.ep_rank[ep], "busy", reason)

    if selector:
        # labels are evaluated on everyone first so the error class is right (nothing matching
        # is NoCompatibleWorker even if the busy ones were removed first); the busy ones'
        # exclusions are recorded under "busy", the earlier filter
        ok_set = set(label_filter(view, cands, selector, FilterResult(cands)).tolist())
        if not ok_set:
            label_filter(view, cands, selector, res)
            raise NoCompatibleWorker(
                _empty_message("no worker matches the label selector", res.excluded)
            )
    else:
        ok_set = None
    if is_busy is not None and _any(is_busy):
        idle = cands[~is_busy]
        if ok_set is not None:
            idle = np.asarray([ep for ep in idle.tolist() if ep in ok_set], dtype=np.int64)
        if len(idle) == 0:
            if pinned:
                ep = int(cands[0])
                raise PinnedWorkerOverloaded(
                    f"pinned worker {view.ep_worker[ep]} is over a busy threshold: "
                    + busy_reason(view, ep, busy, prefill_tokens, decode_blocks)
                )
            if not busy.fallback:
                res.excluded.extend(busy_exclusion(ep) for ep in cands.tolist())
                raise AllWorkersOverloaded(
                    _empty_message("all eligible workers are overloaded", res.excluded)
                )
            # fallback: among label-compatible candidates keep the least-busy
            badness = busy_badness(view, cands, prefill_tokens, decode_blocks)
            pool = [i for i, ep in enumerate(cands.tolist()) if ok_set is None or ep in ok_set]
            best = min(float(badness[i]) for i in pool)
            keep_idx = [i for i in pool if float(badness[i]) == best]
            keep_mask = np.zeros(len(cands), dtype=bool)
            keep_mask[keep_idx] = True
            res.fallback_filters.append("busy")
        else:
            keep_mask = ~is_busy
        res.excluded.extend(
            busy_exclusion(ep)
            for i, ep in enumerate(cands.tolist())
            if not keep_mask[i] and is_busy[i]
        )
        cands = cands[keep_mask]
    if selector:
        cands = label_filter(view, cands, selector, res)
    return cands


def _any(mask: np.ndarray) -> bool:
    """``mask.any()`` for the short masks of a decision, without the ufunc reduction's
    overhead (several times slower at these sizes)."""
    return int(np.count_nonzero(mask)) > 0


def _all(mask: np.ndarray) -> bool:
    return np.count_nonzero(mask) == len(mask)


def _keep(
    view: EndpointView,
    cands: np.ndarray,
    mask: np.ndarray,
    excluded: list[Exclusion | ExclusionGroup],
    filter_name: str,
    reason: Callable[[int], str],
) -> np.ndarray:
    """Candidates where ``mask``; the rest recorded as one lazily expanded group."""
    if _all(mask):
        return cands
    excluded.append(ExclusionGroup(filter_name, cands[~mask], reason, view.ep_worker, view.ep_rank))
    return cands[mask]


def _empty_message(head: str, excluded: Sequence[Exclusion | ExclusionGroup]) -> str:
    excluded = expand_exclusions(excluded)
    if not excluded:
        return f"{head}: no workers registered for this stage"
    shown = "; ".join(f"{e.worker_id}/{e.dp_rank} [{e.filter}] {e.reason}" for e in excluded[:8])
    more = f" (+{len(excluded) - 8} more)" if len(excluded) > 8 else ""
    return f"{head}: {shown}{more}"

"""Cache affinity with a work guard, on top of kv routing (policy ``affinity`` in the simulator).

kv routing (Dynamo's cost: ``prefill_scale * max(prefill - credit * overlap, 0) + decode``) moves a
follow-up request away from the engine holding its prefix whenever that engine's queue or active
KV is somewhat longer. Each move recomputes the prefix elsewhere (fleet work, a duplicate copy
that pushes other prefixes out), so kv stays short of what one shared LRU of the fleet's memory
would hit. Raising the credit does not fix it: past 1 the clamp at 0 makes every engine holding
most of the prompt cost the same prefill, and the decode term (active KV blocks, often hundreds)
decides.

This policy keeps kv's pick ``b`` unless another engine holds a longer prefix. Let ``a`` be the
engine with the longest cached prefix (ties: least work), and per engine

    wait = queued uncached prefill blocks + this prompt's uncached blocks
    work = wait + memory * active KV blocks

(the inputs kv's own cost uses, read from the router's preview). The request goes to ``a`` when
``a`` holds at least ``min_share`` of the prompt and

    work[a] - work[b] <= guard * (overlap[a] - overlap[b])   and   wait[a] - wait[b] <= cap

i.e. staying may cost up to ``guard`` times the prefill it saves the fleet, and never more than
``cap`` blocks of extra prefill ahead of the request (its TTFT); otherwise kv's pick stands (a hot
engine still sheds load). The saving
is counted more than once (``guard`` > 1) because a move also costs every later turn of the
conversation: the new engine starts with one copy, the old one keeps a stale one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvplug.request import RouteRequest


@dataclass(frozen=True)
class AffinityParams:
    guard: float = 8.0  # extra work affinity may cost a request, x the prefix blocks it saves
    cap: float = 128.0  # ... and at most this many blocks of extra prefill wait
    memory: float = 0.25  # weight of active KV blocks (kv's decode term) in the work
    min_share: float = 0.1  # the longest cached prefix must cover this share of the prompt

    def __post_init__(self) -> None:
        if not (self.guard >= 0 and self.cap >= 0 and self.memory >= 0):
            raise ValueError("affinity: guard, cap and memory must be >= 0")
        if not 0 <= self.min_share <= 1:
            raise ValueError("affinity: min_share must be in [0, 1]")


class AffinityRouter:
    """Wraps a kv-mode :class:`kvplug.router.Router`: same interface, affinity-guarded picks.
    A pick that differs from kv's is booked through the router as a pinned route, so load
    tracking, dedup and decisions stay the router's."""

    def __init__(self, router, params: AffinityParams | None = None) -> None:
        if router.config.router_mode != "kv":
            raise ValueError("the affinity policy wraps a kv-mode router")
        self._router = router
        self.params = params or AffinityParams()
        self.affinity_counters = {"kept_kv": 0, "affinity": 0, "guarded": 0}

    def __getattr__(self, name: str) -> Any:  # everything else is the router's
        return getattr(self._router, name)

    def route(self, req: RouteRequest):
        router = self._router
        if not req.hints.is_empty() or req.exclude_workers:
            return router.route(req)  # the caller constrains placement: kv as is
        pick = self._affinity_pick(router.preview(req))
        if pick is None:
            self.affinity_counters["kept_kv"] += 1
            return router.route(req)
        self.affinity_counters["affinity"] += 1
        hints = replace(req.hints, pinned_worker_id=pick[0], pinned_dp_rank=pick[1])
        return router.route(replace(req, hints=hints))

    def _affinity_pick(self, preview) -> tuple[str, int] | None:
        trace = preview.trace
        inputs = trace.inputs if trace is not None else None
        if not inputs or "device" not in inputs or "prefill_blocks" not in inputs:
            return None
        overlap = np.asarray(inputs["device"], dtype=np.float64)
        if len(overlap) < 2:
            return None
        b = int(preview.chosen_index)
        best = float(overlap.max())
        if best <= overlap[b] or best < self.params.min_share * max(preview.request_blocks, 1):
            return None
        wait = np.asarray(inputs["prefill_blocks"], dtype=np.float64) - overlap
        work = wait
        if self.params.memory:
            work = wait + self.params.memory * np.asarray(inputs["decode_blocks"], np.float64)
        holders = np.flatnonzero(overlap == best)
        a = int(holders[np.argmin(work[holders])])
        if (
            work[a] - work[b] > self.params.guard * (overlap[a] - overlap[b])
            or wait[a] - wait[b] > self.params.cap
        ):
            self.affinity_counters["guarded"] += 1
            return None
        ep = int(trace.endpoints[a])
        wid = self._router.ep_worker[ep]
        if wid is None:
            return None
        return wid, int(self._router.ep_rank[ep])

    def stats(self) -> dict[str, Any]:
        return {**self._router.stats(), "affinity": dict(self.affinity_counters)}

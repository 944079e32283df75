"""Cache affinity with a prefill-work guard, on top of kv routing.

kv routing (Dynamo's cost: ``prefill_scale * max(prefill - credit * overlap, 0) + decode``) moves a
follow-up request away from the engine holding its prefix whenever that engine's queue or active
KV is somewhat longer. Each move recomputes the prefix elsewhere (fleet work, a duplicate copy
that pushes other prefixes out), so kv stays well short of what one shared LRU of the fleet's
memory would hit. With ``credit > 1`` the clamp at 0 makes every engine holding most of the
prompt cost the same prefill and the decode term decides, so raising the credit does not help.

This policy keeps kv's decision except when an engine holds a larger share of the prompt than
kv's pick does. Let ``a`` be the engine with the longest cached prefix (ties: least queued
prefill) and ``b`` kv's pick; ``W`` an engine's prefill work ahead of the request in blocks (its
queued uncached prompt tokens plus this prompt's uncached part). The request goes to ``a`` when
``a`` holds at least ``min_share`` of the prompt and

    W[a] - W[b] <= guard * (overlap[a] - overlap[b])

i.e. staying costs the request at most ``guard`` times the prefill it saves the fleet, and to
``b`` otherwise (a balance guard in units of work: a hot engine still sheds load). ``guard = 1``
is a pure greedy TTFT comparison; above 1 the recomputation's cost to later requests counts too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvplug.request import RouteRequest


@dataclass(frozen=True)
class AffinityParams:
    guard: float = 2.0  # how much extra queued prefill (x the blocks saved) affinity may cost
    min_share: float = 0.1  # the longest cached prefix must cover this share of the prompt

    def __post_init__(self) -> None:
        if not self.guard >= 0 or not 0 <= self.min_share <= 1:
            raise ValueError("affinity: guard must be >= 0 and min_share in [0, 1]")


class AffinityRouter:
    """Wraps a kv-mode :class:`kvplug.router.Router`: same interface, affinity-guarded picks."""

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
        preview = router.preview(req)
        pick = self._affinity_pick(preview)
        if pick is None:
            self.affinity_counters["kept_kv"] += 1
            return router.route(req)
        self.affinity_counters["affinity"] += 1
        hints = replace(req.hints, pinned_worker_id=pick[0], pinned_dp_rank=pick[1])
        return router.route(replace(req, hints=hints))

    def _affinity_pick(self, preview) -> tuple[str, int] | None:
        trace = preview.trace
        if trace is None or trace.inputs is None or "device" not in trace.inputs:
            return None
        inputs = trace.inputs
        overlap = np.asarray(inputs["device"], dtype=np.float64)
        if len(overlap) < 2:
            return None
        b = int(preview.chosen_index)
        best = float(overlap.max())
        blocks = max(preview.request_blocks, 1)
        if best <= overlap[b] or best < self.params.min_share * blocks:
            return None
        work = np.asarray(inputs["prefill_blocks"], dtype=np.float64) - overlap
        holders = np.flatnonzero(overlap == best)
        a = int(holders[np.argmin(work[holders])])
        if work[a] - work[b] > self.params.guard * (overlap[a] - overlap[b]):
            self.affinity_counters["guarded"] += 1
            return None
        ep = int(trace.endpoints[a])
        wid = self._router.ep_worker[ep]
        if wid is None:
            return None
        return wid, int(self._router.ep_rank[ep])

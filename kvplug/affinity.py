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

With ``tail`` > 0 the block ``cap`` gives way to a guard in seconds of predicted time to first
token. Per engine, ``ttft = queued prefill seconds + this prompt's prefill seconds`` from the
shipped prefill model (:class:`kvplug.prefill_model.CalibratedPrefillModel`), applied chunk by
chunk at the engine's token budget, because a long prompt's later chunks attend over its earlier
ones. The request goes to ``a`` only if

    ttft[a] <= max(ttft[b] + slack, tau)

where ``tau`` is the ``tail`` quantile of ``ttft[b]`` (kv's pick) over the last ``window``
decisions that had a choice: a request may wait for its cache as long as it stays out of the
latency tail kv would have, and never more than ``slack`` seconds beyond kv's pick otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvplug.prefill_model import H200_LLAMA8B
from kvplug.request import RouteRequest


@dataclass(frozen=True)
class AffinityParams:
    guard: float = 8.0  # extra work affinity may cost a request, x the prefix blocks it saves
    cap: float = 128.0  # ... and at most this many blocks of extra prefill wait
    memory: float = 0.25  # weight of active KV blocks (kv's decode term) in the work
    min_share: float = 0.1  # the longest cached prefix must cover this share of the prompt
    tail: float = 0.0  # > 0: the TTFT guard (quantile of kv's predicted TTFT) replaces the cap
    slack: float = 0.5  # seconds of predicted TTFT above kv's pick always allowed (tail mode)
    window: int = 2000  # decisions the tail quantile is taken over

    def __post_init__(self) -> None:
        if not (self.guard >= 0 and self.cap >= 0 and self.memory >= 0 and self.slack >= 0):
            raise ValueError("affinity: guard, cap, memory and slack must be >= 0")
        if not 0 <= self.min_share <= 1:
            raise ValueError("affinity: min_share must be in [0, 1]")
        if not 0 <= self.tail < 1:
            raise ValueError("affinity: tail must be in [0, 1)")
        if self.window < 1:
            raise ValueError("affinity: window must be >= 1")


def chunked_prefill_seconds(new: float, cached: float, chunk: float) -> float:
    """Predicted prefill time of ``new`` tokens over ``cached`` ones, computed in chunks of
    ``chunk`` tokens (0 = one pass): the shipped H200 fit ``a*n + b*n^2 + c*n*context`` per
    chunk, each chunk's context being the cached prefix plus the earlier chunks."""
    a, b, c = H200_LLAMA8B
    n, p = max(float(new), 0.0), max(float(cached), 0.0)
    if n <= 0:
        return 0.0
    if chunk <= 0 or chunk >= n:
        return (a * n + b * n * n + c * n * p) / 1000.0
    full, rem = divmod(n, chunk)
    quad = full * chunk * chunk + rem * rem
    ctx = n * p + chunk * chunk * full * (full - 1) / 2 + rem * full * chunk
    return (a * n + b * quad + c * ctx) / 1000.0


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
        self._kv_ttft: list[float] = []  # tail mode: predicted TTFT at kv's pick, recent first

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
        params = self.params
        if work[a] - work[b] > params.guard * (overlap[a] - overlap[b]) or (
            not params.tail and wait[a] - wait[b] > params.cap
        ):
            self.affinity_counters["guarded"] += 1
            return None
        if params.tail and not self._within_tail(trace, overlap, preview.request_blocks, a, b):
            self.affinity_counters["guarded"] += 1
            return None
        ep = int(trace.endpoints[a])
        wid = self._router.ep_worker[ep]
        if wid is None:
            return None
        return wid, int(self._router.ep_rank[ep])

    def _within_tail(self, trace, overlap: np.ndarray, blocks: int, a: int, b: int) -> bool:
        """Tail mode: is ``a``'s predicted TTFT within ``max(kv's + slack, tau)``?"""
        router = self._router
        bs = router.block_size
        ep_a, ep_b = int(trace.endpoints[a]), int(trace.endpoints[b])
        queued = self._queued_prefill_seconds((ep_a, ep_b))
        n = blocks * bs

        def ttft(ep: int, i: int) -> float:
            cached = float(overlap[i]) * bs
            chunk = float(router.max_batched[ep]) if ep < len(router.max_batched) else 0.0
            return queued[ep] + chunked_prefill_seconds(n - cached, cached, chunk)

        t_a, t_b = ttft(ep_a, a), ttft(ep_b, b)
        history = self._kv_ttft
        history.append(t_b)
        window = self.params.window
        if len(history) > 2 * window:
            del history[:-window]
        tau = float(np.quantile(history[-window:], self.params.tail))
        return t_a <= max(t_b + self.params.slack, tau)

    def _queued_prefill_seconds(self, endpoints: tuple[int, ...]) -> dict[int, float]:
        """Predicted seconds of prefill still queued per endpoint (requests routed there
        without a first token yet), the oldest one's elapsed time taken off."""
        router = self._router
        now = router._clock()
        total = dict.fromkeys(endpoints, 0.0)
        oldest: dict[int, tuple[float, float]] = {}
        for r in router.load.requests.values():
            ep = r.endpoint
            if ep not in total or r.prefill_done or r.prefill_tokens <= 0:
                continue
            chunk = float(router.max_batched[ep]) if ep < len(router.max_batched) else 0.0
            cached = r.prompt_tokens - r.prefill_tokens
            seconds = chunked_prefill_seconds(r.prefill_tokens, cached, chunk)
            total[ep] += seconds
            if ep not in oldest or r.routed_at < oldest[ep][0]:
                oldest[ep] = (r.routed_at, seconds)
        for ep, (routed_at, seconds) in oldest.items():
            total[ep] = max(total[ep] - min(max(now - routed_at, 0.0), seconds), 0.0)
        return total

    def stats(self) -> dict[str, Any]:
        return {**self._router.stats(), "affinity": dict(self.affinity_counters)}

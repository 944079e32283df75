"""``affinity``: kv's cost, then cache affinity with a guard (:mod:`kvplug.affinity`).

The score stage is kv's (the same trace, the same explanation); the pick stage takes kv's pick
and lets :class:`kvplug.affinity.Affinity` move it to the engine holding the longest prefix when
the guards allow, or rescue it from the latency tail. ``--router-affinity NAME[:key=value,...]``
chooses the setting (``affinity``, ``affinity-rescue``, ``affinity-soonest``; docs/sim.md has
what each is worth on which trace).

Affinity chooses among the candidates the filters left, so a pin, an allow-list (the
frontend's per-model one included), exclusions and label selectors hold as in every mode. A
preview (``Router.preview``) shows kv's pick: it must not change what the policy remembers (the
TTFT window, the follow-up rates), so the booked route may differ from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.affinity import Affinity, parse_affinity
from kvplug.decision import CandidateTrace
from kvplug.pipeline import RouteContext
from kvplug.policies.base import register_policy
from kvplug.policies.kv_cost import KvCostPolicy

if TYPE_CHECKING:
    from kvplug.router import Router


@register_policy
class AffinityPolicy(KvCostPolicy):
    name = "affinity"

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        # RouterConfig.validate has parsed it already (a bad setting is a ConfigError there)
        self.affinity = Affinity(router, parse_affinity(router.config.router_affinity))
        self.hears_first_tokens = self.affinity.params.fit_prefill
        self.holds_inflight = self.affinity.params.hold_inflight
        # read_ms weighs the decode reads of the requests in flight, outputs included, but as
        # a sum of thousands of context tokens per engine: the native lane's reports 4 KiB
        # (tens of tokens) apart move it by under one percent, so its streams stay on the lane

    def score(self, ctx: RouteContext) -> CandidateTrace:
        if self.holds_inflight:  # while the fleet is saturated, queued turns count as cached
            held = self.affinity.inflight_as_held(ctx.device, ctx.shared, ctx.active_depth)
            if held is not None:
                ctx.device, ctx.shared = held
        return super().score(ctx)

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        b = super().pick(ctx, trace)
        if not ctx.booking:
            return b
        moved = self.affinity.choose(trace, b, ctx.full_blocks, ctx.hashes)
        if moved is None:
            return b
        trace.params["affinity_moved_from"] = int(trace.endpoints[b])
        return moved

    def heard_first_token(self, request, now: float) -> None:
        self.affinity.heard_first_token(request, now)

    def stats(self) -> dict[str, int]:
        return dict(self.affinity.affinity_counters)

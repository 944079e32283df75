"""Modes that pick by the router's in-flight request count alone (no KV index):
``random``, ``round-robin``, ``direct``, ``least-loaded``, ``power-of-two`` and Dynamo's
``device-aware-weighted``. Each scores a candidate by its in-flight requests (lower is less
loaded) and differs only in how it picks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvplug import pickers
from kvplug.decision import CandidateTrace
from kvplug.errors import InvalidRequest
from kvplug.pipeline import RouteContext
from kvplug.policies.base import RoutingPolicy, register_policy

if TYPE_CHECKING:
    from kvplug.router import Router


class _ByLoad(RoutingPolicy):
    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self.rng = router.rng

    def score(self, ctx: RouteContext) -> CandidateTrace:
        router = self.router
        inflight = router.load.inflight[ctx.cands].astype(np.float64)
        return CandidateTrace(
            router.ep_worker, router.ep_rank, ctx.cands, "load", inflight, {"inflight": inflight}
        )


@register_policy
class RandomPolicy(_ByLoad):
    name = "random"

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        return self.rng.randrange(len(ctx.cands))


@register_policy
class RoundRobinPolicy(_ByLoad):
    name = "round-robin"

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self.turn = 0

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        idx = self.turn % len(ctx.cands)
        self.turn += 1
        return idx


@register_policy
class DirectPolicy(_ByLoad):
    """The caller pins the worker; the least-loaded of its ranks."""

    name = "direct"

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        if ctx.hints.pinned_worker_id is None:
            raise InvalidRequest(
                f"request {ctx.req.request_id}: --router-mode direct needs a pinned worker id"
            )
        return pickers.argmin_random_tie(trace.values, self.rng)


@register_policy
class LeastLoadedPolicy(_ByLoad):
    name = "least-loaded"

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        return pickers.argmin_random_tie(trace.values, self.rng)


@register_policy
class PowerOfTwoPolicy(_ByLoad):
    name = "power-of-two"

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        return pickers.power_of_two(trace.values, self.rng)


@register_policy
class DeviceAwareWeightedPolicy(_ByLoad):
    """CPU and accelerator groups compared by in-flight per instance (accelerators weighted by
    ``--router-accelerator-weight``), then least-loaded inside the winning group."""

    name = "device-aware-weighted"

    def score(self, ctx: RouteContext) -> CandidateTrace:
        trace = super().score(ctx)
        trace.inputs["cpu"] = self.router.is_cpu[ctx.cands].astype(np.float64)
        return trace

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        idx, trace.params = pickers.device_aware_weighted(
            trace.values,
            self.router.is_cpu[ctx.cands],
            self.router.config.router_accelerator_weight,
            self.rng,
        )
        return idx

"""``profile``: an llm-d style scheduling profile (kvplug.profiles): its filters, its
weighted scorers summed, its picker; highest score wins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvplug.decision import CandidateTrace
from kvplug.errors import ConfigError
from kvplug.filters import FilterResult
from kvplug.pipeline import RouteContext
from kvplug.policies.base import PolicyFilters, RoutingPolicy, register_policy
from kvplug.policies.kv_cost import SeedCost
from kvplug.scoring import ScoringContext
from kvplug.workers import Stage

if TYPE_CHECKING:
    from kvplug.router import Router


@register_policy
class ProfilePolicy(RoutingPolicy):
    name = "profile"
    uses_overlap = True

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        if router.profile is None:
            raise ConfigError("--router-mode profile needs --router-profile FILE (or profile=)")
        self.profiles: Any = router.profile
        self.cost = SeedCost(router)
        self.rng = router.rng
        cfg = router.config
        self.max_age = cfg.router_attribute_max_age
        self.missing_penalty = cfg.router_missing_attribute_penalty
        self._filters: dict[Stage, PolicyFilters] = {}

    def filters(self, stage: Stage) -> PolicyFilters:
        f = self._filters.get(stage)
        if f is None:
            p = self.profiles.get(stage)
            f = self._filters[stage] = PolicyFilters(p.label_selector, list(p.attribute_filters))
        return f

    def score(self, ctx: RouteContext) -> CandidateTrace:
        dev, host, disk, shared = ctx.device, ctx.host, ctx.disk, ctx.shared
        assert dev is not None and host is not None and disk is not None and shared is not None
        router = self.router
        cands = ctx.cands
        cache: list[np.ndarray] = []

        def kv_cost() -> np.ndarray:  # computed only if a scorer asks for it
            if not cache:
                cache.append(self.cost(ctx))
            return cache[0]

        inflight = router.load.inflight[cands]
        sctx = ScoringContext(
            endpoints=cands,
            attrs=router.attrs,
            ep_worker=router.ep_worker,
            now=ctx.now,
            max_age=self.max_age,
            request_blocks=float(ctx.full_blocks),
            device=dev,
            host=host,
            disk=disk,
            shared_beyond=shared,
            inflight=inflight,
            kv_cost=kv_cost,
        )
        total, parts = self.profiles.get(ctx.stage).score(sctx)
        if ctx.penalised is not None:
            total = np.where(ctx.penalised, total - self.missing_penalty, total)
        if sctx.ages:  # the attributes the scorers read, with their ages
            if ctx.report is None:
                ctx.report = FilterResult(cands)
            ctx.report.attribute_ages.extend(sctx.ages)
        inputs = {
            "device": dev,
            "host": host,
            "disk": disk,
            "shared_beyond": shared,
            "inflight": inflight.astype(np.float64),
        }
        return CandidateTrace(
            router.ep_worker,
            router.ep_rank,
            cands,
            "score",
            total,
            inputs,
            {},
            None,
            ctx.penalised,
            parts,
        )

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        idx, trace.probabilities = self.profiles.get(ctx.stage).pick(trace.values, self.rng)
        return int(idx)

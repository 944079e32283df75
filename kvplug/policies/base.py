"""The routing-policy interface and the registry of policies by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

from kvplug.config import AttributeThreshold
from kvplug.decision import CandidateTrace
from kvplug.errors import ConfigError
from kvplug.pipeline import RouteContext
from kvplug.workers import Stage

if TYPE_CHECKING:
    from kvplug.load import ActiveRequest
    from kvplug.router import Router


@dataclass(frozen=True)
class PolicyFilters:
    """Filters a policy adds for one stage, run after the configured ones (a scheduling
    profile's label selector and attribute thresholds)."""

    label_selector: dict[str, str] = field(default_factory=dict)
    attribute_thresholds: list[AttributeThreshold] = field(default_factory=list)


class RoutingPolicy:
    """One routing mode. The router calls, per request and in this order:

    1. :meth:`filters` (the filters stage), for the policy's own filters, if any;
    2. :meth:`score` (the score stage): a :class:`~kvplug.CandidateTrace` over
       ``ctx.cands`` (kind "cost" or "load": lower wins; "score": higher wins), whose
       inputs and parameters become the decision's explanation;
    3. :meth:`pick` (the pick stage): the index of the chosen candidate; it may add
       ``trace.probabilities`` (a random pick) or ``trace.params``.

    A policy reads the router's public state (``config``, ``load``, ``attrs``, ``rng``,
    ``ep_worker``, ``ep_rank``) and what the earlier stages put in the
    :class:`~kvplug.pipeline.RouteContext` (overlaps, active-prefix depths, load at ``now``).
    It draws all randomness from ``router.rng`` so seeded runs repeat.
    """

    name: ClassVar[str] = ""
    uses_overlap: ClassVar[bool] = False  # the overlap stage queries the KV index for it
    # it reads the output tokens of requests in flight as streams report them, chunk by chunk
    # (the native data path reports them 4 KiB apart, so it leaves such streams to Python)
    reads_output_progress: bool = False

    def __init__(self, router: Router) -> None:
        self.router = router

    def filters(self, stage: Stage) -> PolicyFilters | None:
        return None

    def score(self, ctx: RouteContext) -> CandidateTrace:
        raise NotImplementedError

    def pick(self, ctx: RouteContext, trace: CandidateTrace) -> int:
        raise NotImplementedError

    # it learns from first tokens as they come (``heard_first_token``)
    hears_first_tokens: bool = False

    def heard_first_token(self, request: ActiveRequest, now: float) -> None:
        """A first token of a request this router routed, seen as it came (a stream's first
        event, not a whole answer's end), before its prefill load is released."""

    def stats(self) -> dict[str, int] | None:
        """The policy's own counters, reported under its name in ``Router.stats()`` (and so
        in ``kvplug serve``'s ``/metrics``); None when it keeps none."""
        return None


_POLICIES: dict[str, type[RoutingPolicy]] = {}
P = TypeVar("P", bound=type[RoutingPolicy])


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` selectable as ``--router-mode cls.name``."""
    if not cls.name:
        raise ConfigError(f"policy {cls.__qualname__} has no name")
    known = _POLICIES.get(cls.name)
    if known is not None and known is not cls:
        raise ConfigError(f"router mode {cls.name!r} is already registered by {known.__qualname__}")
    _POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[RoutingPolicy]:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ConfigError(f"--router-mode {name!r} is not one of {policy_names()}") from None


def policy_names() -> tuple[str, ...]:
    """Registered router modes, in registration order (the built-ins first)."""
    return tuple(_POLICIES)

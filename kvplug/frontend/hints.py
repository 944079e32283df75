"""Routing hints from the request: Dynamo's ``nvext`` fields and headers.

Headers win over ``nvext`` (as in Dynamo). Recognised:

- pin the (decode) worker: ``nvext.backend_instance_id``, ``nvext.decode_worker_id``,
  headers ``x-worker-instance-id``, ``x-kvplug-worker``;
- pin the prefill worker: ``nvext.prefill_worker_id``, ``x-prefill-instance-id``,
  ``x-kvplug-prefill-worker``;
- pin the DP rank: ``nvext.dp_rank``, ``x-dynamo-dp-rank``, ``x-kvplug-dp-rank``;
- allow-list: ``nvext.allowed_worker_ids``, ``x-kvplug-allowed-workers`` (comma-separated);
- expected output length: ``nvext.agent_hints.osl`` (output-block weighting);
- label selector: ``nvext.labels`` (object of strings);
- admission-queue priority: ``nvext.agent_hints.latency_sensitivity`` (seconds, >= 0; Dynamo's
  ``priority_jump``: the request counts as having arrived that much earlier).

Pins, DP-rank pins, allow-lists and label selectors *steer* routing: they are read only when
the operator trusts its clients (``kvplug serve --client-routing-hints trust``). By default
(``ignore``) they are left unread and counted; ``reject`` refuses such requests (403).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplug.errors import ConfigError
from kvplug.frontend.errors import ApiError, bad_request

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RequestHints:
    worker_id: str | None = None  # aggregated / decode pin
    prefill_worker_id: str | None = None
    dp_rank: int | None = None
    allowed_worker_ids: frozenset[str] | None = None
    expected_osl: int | None = None
    labels: Mapping[str, str] | None = None
    priority_jump: float = 0.0

    def pins(self) -> list[str]:
        return [w for w in (self.worker_id, self.prefill_worker_id) if w is not None]


NO_HINTS = RequestHints()


def _worker_id(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise bad_request(f"{where} must be a worker id (string or integer)", param=where)
    return str(value)


def _int(value: Any, where: str, minimum: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise bad_request(f"{where} must be an integer", param=where) from None
    if type(value) is not int or value < minimum:
        raise bad_request(f"{where} must be an integer >= {minimum}", param=where)
    return value


# kvplug serve --client-routing-hints
HINT_POLICIES = ("ignore", "trust", "reject")
# nvext keys that steer routing (the headers in HINT_HEADERS all do)
_STEERING_NVEXT = (
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
    "dp_rank",
    "allowed_worker_ids",
    "labels",
)


def steering_hints(nvext: Mapping[str, Any] | None, headers: Mapping[str, str]) -> list[str]:
    """The routing-steering hints the request carries (header names, ``nvext.<key>``)."""
    found = [h for h in HINT_HEADERS if h in headers]
    if nvext:
        found += [f"nvext.{k}" for k in _STEERING_NVEXT if nvext.get(k) is not None]
    return found


def hints_from_request(
    nvext: Mapping[str, Any] | None, headers: Mapping[str, str], steering: bool = True
) -> RequestHints:
    """Collect the hints; ``ApiError`` (400) when one has the wrong type. With
    ``steering=False`` only the advisory hints (``nvext.agent_hints``) are read."""
    nv = nvext or {}
    if not steering:
        agent = nv.get("agent_hints")
        if agent is None:
            return NO_HINTS
        nv = {"agent_hints": agent}
        headers = {}
    elif not nv and not any(h in headers for h in HINT_HEADERS):
        return NO_HINTS  # the common case costs one scan of a few header names
    header_pin = headers.get("x-kvplug-worker") or headers.get("x-worker-instance-id")
    if header_pin is not None:
        worker = _worker_id(header_pin, "worker pin header")
    elif nv.get("decode_worker_id") is not None:
        worker = _worker_id(nv["decode_worker_id"], "nvext.decode_worker_id")
    else:
        worker = _worker_id(nv.get("backend_instance_id"), "nvext.backend_instance_id")
    prefill = _worker_id(
        headers.get("x-kvplug-prefill-worker")
        or headers.get("x-prefill-instance-id")
        or nv.get("prefill_worker_id"),
        "prefill worker pin",
    )
    dp_header = headers.get("x-kvplug-dp-rank") or headers.get("x-dynamo-dp-rank")
    dp_rank = _int(dp_header if dp_header is not None else nv.get("dp_rank"), "dp_rank")

    allowed: frozenset[str] | None = None
    allowed_header = headers.get("x-kvplug-allowed-workers")
    if allowed_header is not None:
        allowed = frozenset(w.strip() for w in allowed_header.split(",") if w.strip())
    elif nv.get("allowed_worker_ids") is not None:
        ids = nv["allowed_worker_ids"]
        if not isinstance(ids, list):
            raise bad_request(
                "nvext.allowed_worker_ids must be a list of worker ids",
                param="nvext.allowed_worker_ids",
            )
        allowed = frozenset(_worker_id(w, "nvext.allowed_worker_ids[]") for w in ids)  # type: ignore[misc]

    osl = None
    jump = 0.0
    agent = nv.get("agent_hints")
    if agent is not None:
        if not isinstance(agent, dict):
            raise bad_request("nvext.agent_hints must be an object", param="nvext.agent_hints")
        osl = _int(agent.get("osl"), "nvext.agent_hints.osl", minimum=1)
        sensitivity = agent.get("latency_sensitivity")
        if sensitivity is not None:
            if (
                isinstance(sensitivity, bool)
                or not isinstance(sensitivity, (int, float))
                or not 0 <= sensitivity < float("inf")
            ):
                raise bad_request(
                    "nvext.agent_hints.latency_sensitivity must be a number of seconds >= 0",
                    param="nvext.agent_hints.latency_sensitivity",
                )
            jump = float(sensitivity)

    labels = nv.get("labels")
    if labels is not None and (
        not isinstance(labels, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise bad_request("nvext.labels must be an object of strings", param="nvext.labels")

    return RequestHints(worker, prefill, dp_rank, allowed, osl, labels or None, jump)


# the headers that steer routing: read (or refused) by the Python path only
HINT_HEADERS = (
    "x-kvplug-worker",
    "x-worker-instance-id",
    "x-kvplug-prefill-worker",
    "x-prefill-instance-id",
    "x-kvplug-dp-rank",
    "x-dynamo-dp-rank",
    "x-kvplug-allowed-workers",
)


class ClientHints:
    """Reads a request's hints as ``--client-routing-hints`` says: ``trust`` all of them,
    ``ignore`` the steering ones (counted per hint in ``ignored``, a Prometheus counter, and
    logged once), or ``reject`` a request carrying any (403)."""

    def __init__(self, policy: str, ignored: Any = None) -> None:
        if policy not in HINT_POLICIES:
            raise ConfigError(
                f"client_routing_hints must be one of {HINT_POLICIES}, got {policy!r}"
            )
        self.policy = policy
        self._ignored = ignored
        self._children: dict[str, Any] = {}
        self._warned = False

    def read(self, nvext: Mapping[str, Any] | None, headers: Mapping[str, str]) -> RequestHints:
        if self.policy != "trust":
            steering = steering_hints(nvext, headers)
            if steering:
                if self.policy == "reject":
                    raise ApiError(
                        403,
                        f"this server does not accept client routing hints ({', '.join(steering)})"
                        "; its operator can allow them with --client-routing-hints trust",
                        "permission_error",
                        "routing_hints_not_allowed",
                    )
                self._count(steering)
        return hints_from_request(nvext, headers, steering=self.policy == "trust")

    def _count(self, steering: list[str]) -> None:
        if self._ignored is not None:
            for hint in steering:
                child = self._children.get(hint)
                if child is None:
                    child = self._children[hint] = self._ignored.labels(hint)
                child.inc()
        if not self._warned:
            self._warned = True
            log.warning(
                "a client sent routing hints (%s): ignored, as every later one is "
                "(counted in kvplug_routing_hints_ignored_total); start kvplug serve with "
                "--client-routing-hints trust to honour them",
                ", ".join(steering),
            )


def check_hint_targets(hints: RequestHints, workers: Mapping[str, Any]) -> None:
    """400 for hints naming what the fleet does not have: a pinned or allowed worker, or a DP
    rank no candidate worker has (``workers``: worker id -> entry with ``worker.dp_ranks``)."""
    for worker_id in hints.pins():
        if worker_id not in workers:
            raise bad_request(
                f"unknown worker {worker_id!r} in the request's routing hints",
                code="unknown_worker",
            )
    if hints.allowed_worker_ids is not None:
        unknown = hints.allowed_worker_ids - workers.keys()
        if unknown == hints.allowed_worker_ids:
            raise bad_request(
                f"none of the allowed workers {sorted(unknown)} is known", code="unknown_worker"
            )
    rank = hints.dp_rank
    if rank is not None:  # a rank no candidate has is the same mistake as an unknown worker
        scope = [hints.worker_id] if hints.worker_id is not None else hints.allowed_worker_ids
        entries = workers.values() if scope is None else [workers[w] for w in scope if w in workers]
        if not any(rank in e.worker.dp_ranks for e in entries):
            raise bad_request(
                f"no worker has DP rank {rank} (the request's routing hints)",
                code="unknown_dp_rank",
                param="dp_rank",
            )

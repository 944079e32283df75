"""Find a vLLM engine's event sources and cache config, and check its block size.

``GET /kv_event_sources`` has answered in three shapes (all accepted, see ``parse_event_sources``):

* vLLM 0.32 / 0.33: ``{"<dp_rank>": {KVEventsConfig as resolved}}``;
* later upstream, a bare list (vllm-project/vllm 153c3aa2, ``entrypoints/serve/kv_events``):
  ``[{"data_parallel_rank", "endpoint", "replay_endpoint", "topic", ...}]``;
* the same list in an envelope (vllm-project/vllm f123199a): ``{"sources": [...]}``, endpoints
  as bound (``tcp://0.0.0.0:41001`` for a wildcard or an ephemeral port).

Older engines answer 404: then the configured endpoint is used with vLLM's per-rank port
offsets. The block
size comes from the ``vllm:cache_config_info`` metric's labels; an engine whose block size
differs from the router's is refused (``ConfigError``) — its events could never match.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from kvplug import ConfigError

from .metrics import MetricsSample, scrape
from .subscriber import offset_endpoint

log = logging.getLogger("kvplug.vllm")


class EngineNotUp(ConfigError):
    """The engine did not answer ``/kv_event_sources`` (down, still starting, unreachable) and
    no event endpoint is configured: what to subscribe to is not known yet. The adapter asks
    again in the background rather than refusing the worker."""


@dataclass
class RankSource:
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


@dataclass
class EngineInfo:
    """What kvplug learned about one engine (from the engine when it says, else config)."""

    sources: list[RankSource]
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    hash_algo: str | None = None
    discovered: bool = False  # sources came from /kv_event_sources
    cache_config: dict[str, str] = field(default_factory=dict)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - engine URL
        return json.loads(resp.read().decode("utf-8"))


def fetch_event_sources(base_url: str, timeout: float = 2.0) -> list[RankSource] | None:
    """Sources per DP rank from ``GET /kv_event_sources``; None when the engine has no such
    endpoint (older vLLM) or publishes no events."""
    try:
        data = get_json(base_url.rstrip("/") + "/kv_event_sources", timeout)
    except urllib.error.HTTPError as e:
        if e.code in (404, 405):
            return None
        raise
    return parse_event_sources(data, base_url)


def _wildcard(endpoint: str) -> str:
    """An endpoint as bound (``0.0.0.0`` / ``[::]``) back in vLLM's wildcard form: the engine's
    PUB bound it, so kvplug must dial the engine's host rather than bind the address itself."""
    return endpoint.replace("//0.0.0.0:", "//*:").replace("//[::]:", "//*:")


def _rank_source(rank: Any, cfg: Any, where: str) -> RankSource | None:
    """One rank's entry (either shape) → a source; None (logged) for one that publishes no ZMQ
    events or is malformed, so one bad rank does not hide the others."""
    if not isinstance(cfg, dict):
        log.warning("%s: rank entry %r is not an object; ignored", where, cfg)
        return None
    if cfg.get("enable_kv_cache_events") is False:
        return None
    if cfg.get("publisher", "zmq") not in ("zmq", None) or cfg.get("transport", "zmq") != "zmq":
        return None
    endpoint, replay, topic = cfg.get("endpoint"), cfg.get("replay_endpoint"), cfg.get("topic")
    try:
        dp_rank = int(rank)
    except (TypeError, ValueError):
        dp_rank = -1
    if (
        dp_rank < 0
        or isinstance(rank, bool)
        or not isinstance(endpoint, str)
        or not endpoint
        or not (replay is None or isinstance(replay, str))
        or not (topic is None or isinstance(topic, str))
    ):
        log.warning("%s: malformed source %r; ignored", where, cfg)
        return None
    return RankSource(
        dp_rank, _wildcard(endpoint), _wildcard(replay) if replay else None, topic or ""
    )


def parse_event_sources(data: Any, base_url: str = "?") -> list[RankSource] | None:
    """A ``/kv_event_sources`` answer of any shape vLLM has shipped → sources sorted by rank;
    None when it names none. Raises ConfigError for an answer of no known shape."""
    where = f"{base_url}/kv_event_sources"
    entries: list[tuple[Any, Any]]
    if isinstance(data, dict) and isinstance(data.get("sources"), list):
        data = data["sources"]
    if isinstance(data, list):
        entries = [
            (item.get("data_parallel_rank") if isinstance(item, dict) else None, item)
            for item in data
        ]
    elif isinstance(data, dict):
        entries = list(data.items())
    else:
        raise ConfigError(f"{where} answered {type(data).__name__}, not a map or a list")
    out = [rs for rank, cfg in entries if (rs := _rank_source(rank, cfg, where)) is not None]
    out.sort(key=lambda rs: rs.dp_rank)
    return out or None


def configured_sources(
    endpoint: str, replay_endpoint: str | None, topic: str, dp_start: int, dp_size: int
) -> list[RankSource]:
    """Sources from configuration, offset per DP rank the way vLLM offsets them."""
    return [
        RankSource(
            r, offset_endpoint(endpoint, r) or endpoint, offset_endpoint(replay_endpoint, r), topic
        )
        for r in range(dp_start, dp_start + dp_size)
    ]


def discover(
    base_url: str | None,
    *,
    endpoint: str | None = None,
    replay_endpoint: str | None = None,
    topic: str = "",
    dp_start: int = 0,
    dp_size: int = 1,
    metrics_url: str | None = None,
    timeout: float = 2.0,
    answered: tuple[list[RankSource] | None] | None = None,
) -> EngineInfo:
    """Ask the engine (when it has a URL) for its sources and cache config; fill the rest from
    configuration. ``answered``: ``(fetch_event_sources's answer,)`` when the caller has just
    fetched it (not asked again). Raises ConfigError when neither gives an event endpoint."""
    sources = None
    if answered is not None:
        (sources,) = answered
    elif base_url:
        try:
            sources = fetch_event_sources(base_url, timeout)
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) and not endpoint:  # nothing to subscribe to yet
                raise EngineNotUp(
                    f"vLLM engine {base_url}: GET /kv_event_sources failed ({e})"
                ) from e
            log.warning(
                "vLLM %s: GET /kv_event_sources failed (%s); using configuration", base_url, e
            )
    discovered = sources is not None
    if sources is None:
        if not endpoint:
            raise ConfigError(
                f"vLLM engine {base_url or '?'}: no /kv_event_sources answer and no configured "
                "event endpoint (start it with --kv-events-config and give event_endpoint)"
            )
        sources = configured_sources(endpoint, replay_endpoint, topic, dp_start, dp_size)
    info = EngineInfo(sources=sources, discovered=discovered)
    murl = metrics_url or (base_url.rstrip("/") + "/metrics" if base_url else None)
    if murl:
        try:
            sample: MetricsSample = scrape(murl, timeout)
            info.cache_config = sample.cache_config
            info.block_size = sample.block_size
            info.num_gpu_blocks = sample.num_gpu_blocks
            info.hash_algo = sample.cache_config.get("prefix_caching_hash_algo")
        except (OSError, ValueError) as e:
            log.warning("vLLM %s: no cache config from metrics (%s)", murl, e)
    return info


def check_block_size(
    worker_id: str,
    engine_block_size: int | None,
    router_block_size: int,
    configured: int | None = None,
) -> int:
    """The engine's block size, refusing one that differs from the router's (loudly)."""
    bs = engine_block_size or configured
    if bs is None:
        log.warning(
            "vLLM %s: block size unknown (no cache_config_info); assuming the router's "
            "%d — stores of another size will be dropped and counted",
            worker_id,
            router_block_size,
        )
        return router_block_size
    if bs != router_block_size:
        raise ConfigError(
            f"vLLM worker {worker_id} uses block size {bs} but the router indexes blocks of "
            f"{router_block_size} tokens: start the engine with --block-size "
            f"{router_block_size} or the router with --kv-block-size {bs}"
        )
    return bs

"""vLLM ``GET /metrics`` (Prometheus text) -> kvplug worker attributes.

Parsed with ``prometheus_client``'s own text parser. Metric names carry the ``vllm:`` prefix;
labels include ``engine`` (the DP rank's engine index) and ``model_name``. Values of one metric
across engines are summed (requests, counters) or averaged (usage). ``vllm:kv_cache_usage_perc``
is a fraction 0-1 despite its name; before 0.12 it was ``vllm:gpu_cache_usage_perc``.
``vllm:cache_config_info`` is an info gauge whose *labels* hold the cache config (block size,
number of GPU blocks, hash algorithm...).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvplug.vllm")

# attribute name -> (metric family names to try in order, how to merge engines)
_GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "num_requests_running": (("vllm:num_requests_running",), "sum"),
    "num_requests_waiting": (("vllm:num_requests_waiting",), "sum"),
    "kv_cache_usage": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "mean"),
    "prefix_cache_queries": (("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"), "sum"),
    "prefix_cache_hits": (("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"), "sum"),
    "external_prefix_cache_queries": (("vllm:external_prefix_cache_queries",), "sum"),
    "external_prefix_cache_hits": (("vllm:external_prefix_cache_hits",), "sum"),
    "num_preemptions": (("vllm:num_preemptions",), "sum"),
}
_CACHE_INFO = "vllm:cache_config_info"
_CACHE_NUMERIC = (
    "block_size",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "hash_block_size",
    "gpu_memory_utilization",
)


@dataclass
class MetricsSample:
    """One scrape: ``attributes`` (floats, for ``Router.set_attributes``; the vLLM names plus
    the aliases kvplug's scorers read: ``queue_depth``, ``running_requests``, ``kv_usage``),
    ``cache_config`` (the raw labels of ``vllm:cache_config_info``), and ``ts``, the wall-clock
    time of the scrape (the router stamps attributes on its own clock when they arrive)."""

    ts: float
    attributes: dict[str, float]
    cache_config: dict[str, str] = field(default_factory=dict)
    per_engine: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def block_size(self) -> int | None:
        v = self.cache_config.get("block_size")
        return int(v) if v not in (None, "", "None") else None

    @property
    def num_gpu_blocks(self) -> int | None:
        v = self.cache_config.get("num_gpu_blocks")
        return int(v) if v not in (None, "", "None") else None


def parse_metrics(text: str, ts: float | None = None) -> MetricsSample:
    """Prometheus exposition text from a vLLM engine -> a sample."""
    values: dict[str, dict[str, float]] = {}  # family -> engine label -> value
    cache_config: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # counters appear as <name>_total samples of the family <name>
            if s.name.endswith(("_created", "_bucket", "_count", "_sum")) and fam.type != "gauge":
                continue
            if fam.name == _CACHE_INFO or s.name == _CACHE_INFO:
                cache_config.update(s.labels)
                continue
            engine = s.labels.get("engine", "0")
            # counters: the parser names the family without "_total" only when the TYPE line
            # does; normalise so both spellings land on one name
            name = fam.name[:-6] if fam.name.endswith("_total") else fam.name
            values.setdefault(name, {})[engine] = float(s.value)
    attrs: dict[str, float] = {}
    per_engine: dict[str, dict[str, float]] = {}
    for attr, (names, how) in _GAUGES.items():
        for name in names:
            if name in values:
                by_engine = values[name]
                vals = list(by_engine.values())
                attrs[attr] = sum(vals) if how == "sum" else sum(vals) / len(vals)
                for eng, v in by_engine.items():
                    per_engine.setdefault(eng, {})[attr] = v
                break
    start = values.get("process_start_time_seconds")
    if start:
        # changes when the engine's API server (and with it the engine) restarted
        attrs["process_start_time"] = next(iter(start.values()))
    for key in _CACHE_NUMERIC:
        raw = cache_config.get(key)
        try:
            if raw not in (None, "", "None"):
                attrs[key] = float(raw)
        except ValueError:
            pass
    # the names kvplug's scorers and filters read (llm-d style)
    for alias, src in (
        ("queue_depth", "num_requests_waiting"),
        ("running_requests", "num_requests_running"),
        ("kv_usage", "kv_cache_usage"),
        ("gpu_cache_usage_perc", "kv_cache_usage"),
    ):
        if src in attrs:
            attrs[alias] = attrs[src]
    return MetricsSample(
        ts=time.time() if ts is None else ts,
        attributes=attrs,
        cache_config=cache_config,
        per_engine=per_engine,
    )


def scrape(url: str, timeout: float = 2.0) -> MetricsSample:
    """GET ``url`` (the engine's ``/metrics``) and parse it. Raises OSError on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - engine URL
        text = resp.read().decode("utf-8", "replace")
    return parse_metrics(text)


class MetricsScraper:
    """Scrapes one engine every ``period`` seconds on its own thread.

    ``on_sample(sample)`` gets each good scrape; ``on_failure(consecutive_failures, error)``
    each failed one. ``healthy`` is False after ``unhealthy_after`` consecutive failures — a
    liveness signal the frontend can use next to the event stream's silence.
    """

    def __init__(
        self,
        url: str,
        on_sample: Callable[[MetricsSample], Any],
        *,
        period: float = 1.0,
        timeout: float = 2.0,
        on_failure: Callable[[int, Exception], Any] | None = None,
        unhealthy_after: int = 2,
    ) -> None:
        self.url = url
        self.on_sample = on_sample
        self.on_failure = on_failure
        self.period = period
        self.timeout = timeout
        self.unhealthy_after = unhealthy_after
        self.failures = 0
        self.scrapes = 0
        self.last: MetricsSample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def healthy(self) -> bool:
        return self.failures < self.unhealthy_after

    def scrape_once(self) -> MetricsSample | None:
        try:
            sample = scrape(self.url, self.timeout)
        except Exception as e:  # network errors, bad text: counted, never fatal
            self.failures += 1
            if self.failures in (1, self.unhealthy_after) or self.failures % 100 == 0:
                log.warning(
                    "vLLM metrics %s: scrape failed (%d in a row): %s", self.url, self.failures, e
                )
            if self.on_failure is not None:
                self.on_failure(self.failures, e)
            return None
        self.failures = 0
        self.scrapes += 1
        self.last = sample
        self.on_sample(sample)
        return sample

    def start(self) -> MetricsScraper:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvplug-vllm-metrics", daemon=True
            )
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.scrape_once()
            except Exception:  # a failing callback must not kill the loop
                log.exception("vLLM metrics %s: callback failed", self.url)
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

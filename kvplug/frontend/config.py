"""Worker specs: from ``--worker [ID=]URL`` flags, a ``--worker-config`` YAML file, or the
admin API (same keys as one YAML entry).

```yaml
workers:
  - id: prefill-0            # default: host:port of the url
    engine: vllm             # an adapter kind (kvplug.adapters)
    url: http://10.0.0.1:8000
    role: prefill            # prefill | decode | both (default)
    event_endpoint: tcp://10.0.0.1:5557
    replay_endpoint: tcp://10.0.0.1:5558
    metrics_url: http://10.0.0.1:8000/metrics
    labels: {accelerator: h100}
    taints: [spot]
    dp_start: 0
    dp_size: 1
    device: gpu              # gpu | cpu
    kv_capacity_blocks: 0    # 0 = unknown
    max_batched_tokens: 0
    long_prefill_token_threshold: 0   # vLLM's flag of that name (0 = off)
    long_prefill_token_threshold_adaptive: false   # vLLM's flag of that name
    models: [llama-3-8b]     # served model names (default: discovered from /v1/models)
    options: {bootstrap_port: 8998}   # adapter-specific
```
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvplug.errors import ConfigError

ROLES = ("prefill", "decode", "both")
# DP ranks of one worker: each is a routing endpoint, scored on every request; the largest
# data-parallel deployments run a few hundred
MAX_DP_SIZE = 1024
MAX_DP_RANK = 2**31 - 1
DEVICES = ("gpu", "cpu")
_KEYS = {
    "id",
    "worker_id",
    "engine",
    "url",
    "role",
    "event_endpoint",
    "replay_endpoint",
    "metrics_url",
    "labels",
    "taints",
    "dp_start",
    "dp_size",
    "device",
    "kv_capacity_blocks",
    "max_batched_tokens",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "models",
    "options",
}


@dataclass
class WorkerSpec:
    worker_id: str
    url: str
    engine: str = "vllm"
    role: str = "both"
    event_endpoint: str | None = None
    replay_endpoint: str | None = None
    metrics_url: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[str] = field(default_factory=list)
    dp_start: int = 0
    dp_size: int = 1
    device: str = "gpu"
    kv_capacity_blocks: int = 0
    max_batched_tokens: int = 0
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    models: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    # neither dp_start nor dp_size was given: the fleet asks the engine which DP ranks it
    # serves behind the URL before registering (EngineAdapter.engine_ranks)
    dp_from_engine: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.worker_id,
            "engine": self.engine,
            "url": self.url,
            "role": self.role,
            "event_endpoint": self.event_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "metrics_url": self.metrics_url,
            "labels": dict(self.labels),
            "taints": list(self.taints),
            "dp_start": self.dp_start,
            "dp_size": self.dp_size,
            "device": self.device,
            "kv_capacity_blocks": self.kv_capacity_blocks,
            "max_batched_tokens": self.max_batched_tokens,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "long_prefill_token_threshold_adaptive": self.long_prefill_token_threshold_adaptive,
            "models": list(self.models),
            "options": dict(self.options),
        }

    def to_worker(self):
        """The router's ``Worker`` for this spec."""
        from kvplug.workers import Role, Worker

        return Worker(
            worker_id=self.worker_id,
            url=self.url,
            engine=self.engine,
            role=Role(self.role),
            dp_start=self.dp_start,
            dp_size=self.dp_size,
            labels=dict(self.labels),
            taints=frozenset(self.taints),
            device=self.device,
            kv_capacity_blocks=self.kv_capacity_blocks,
            max_batched_tokens=self.max_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
            event_endpoint=self.event_endpoint,
            replay_endpoint=self.replay_endpoint,
            metrics_url=self.metrics_url,
        )


def normalise_url(url: Any, where: str) -> str:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{where}: 'url' must be a non-empty string")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"{where}: url {url[:200]!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: url {url!r} is not http(s)://host[:port]")
    if not _resolvable_name(parts.hostname):
        raise ConfigError(f"{where}: url {url[:200]!r}: the host is not an address or DNS name")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"{where}: url {url!r} has a bad port") from None
    return url.rstrip("/")


def _resolvable_name(host: str) -> bool:
    """An IP address, or a name DNS can carry (IDNA-encodable, labels of 1-63 bytes, at most
    253 in all): anything else fails only later, deep inside the HTTP client."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        encoded = host.encode("idna")
    except UnicodeError:
        return False
    return 0 < len(encoded) <= 253


def default_worker_id(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def _int(
    d: dict, key: str, default: int, minimum: int, where: str, maximum: int | None = None
) -> int:
    value = d.get(key, default)
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: {key!r} must be at most {maximum}, got {value!r}")
    return value


def _metrics_url(d: dict, where: str) -> str | None:
    """http(s) only: the adapters fetch it, and a file:// URL would read local files."""
    url = _opt_str(d, "metrics_url", where)
    if url is not None:
        try:
            parts = urlsplit(url)
        except ValueError:
            parts = None
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or not _resolvable_name(parts.hostname)
        ):
            raise ConfigError(
                f"{where}: metrics_url {url[:200]!r} is not http(s)://host[:port]/path"
            )
    return url


def _opt_str(d: dict, key: str, where: str) -> str | None:
    value = d.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{where}: {key!r} must be a non-empty string")
    return value


def spec_from_mapping(d: Any, where: str, default_engine: str = "vllm") -> WorkerSpec:
    """One worker entry (YAML or admin JSON) → ``WorkerSpec``; ``ConfigError`` naming ``where``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: a worker must be a mapping, got {type(d).__name__}")
    unknown = set(d) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    url = normalise_url(d.get("url"), where)
    worker_id = d.get("id", d.get("worker_id")) or default_worker_id(url)
    if not isinstance(worker_id, (str, int)) or isinstance(worker_id, bool):
        raise ConfigError(f"{where}: 'id' must be a string")
    engine = d.get("engine", default_engine)
    if not isinstance(engine, str) or not engine:
        raise ConfigError(f"{where}: 'engine' must be an engine kind name")
    role = d.get("role", "both")
    if role not in ROLES:
        raise ConfigError(f"{where}: 'role' must be one of {ROLES}, got {role!r}")
    device = d.get("device", "gpu")
    if device not in DEVICES:
        raise ConfigError(f"{where}: 'device' must be one of {DEVICES}, got {device!r}")
    labels = d.get("labels") or {}
    if not isinstance(labels, dict):
        raise ConfigError(f"{where}: 'labels' must be a mapping")
    taints = d.get("taints") or []
    if not isinstance(taints, list) or not all(isinstance(t, str) for t in taints):
        raise ConfigError(f"{where}: 'taints' must be a list of strings")
    models = d.get("models") or []
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{where}: 'models' must be a list of model names")
    options = d.get("options") or {}
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: 'options' must be a mapping")
    adaptive = d.get("long_prefill_token_threshold_adaptive", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"{where}: 'long_prefill_token_threshold_adaptive' must be true or false")
    return WorkerSpec(
        worker_id=str(worker_id),
        url=url,
        engine=engine,
        role=role,
        event_endpoint=_opt_str(d, "event_endpoint", where),
        replay_endpoint=_opt_str(d, "replay_endpoint", where),
        metrics_url=_metrics_url(d, where),
        labels={str(k): str(v) for k, v in labels.items()},
        taints=list(taints),
        dp_start=_int(d, "dp_start", 0, 0, where, MAX_DP_RANK - MAX_DP_SIZE),
        dp_size=_int(d, "dp_size", 1, 1, where, MAX_DP_SIZE),
        device=device,
        kv_capacity_blocks=_int(d, "kv_capacity_blocks", 0, 0, where),
        max_batched_tokens=_int(d, "max_batched_tokens", 0, 0, where),
        long_prefill_token_threshold=_int(d, "long_prefill_token_threshold", 0, 0, where),
        long_prefill_token_threshold_adaptive=adaptive,
        models=list(models),
        options=dict(options),
        dp_from_engine=d.get("dp_start") is None and d.get("dp_size") is None,
    )


def parse_worker_flag(value: str, default_engine: str = "vllm") -> WorkerSpec:
    """``--worker URL`` or ``--worker ID=URL``."""
    worker_id = None
    if "=" in value:
        worker_id, _, value = value.partition("=")
        if not worker_id:
            raise ConfigError(f"--worker {value!r}: empty worker id before '='")
    entry: dict[str, Any] = {"url": value, "engine": default_engine}
    if worker_id:
        entry["id"] = worker_id
    return spec_from_mapping(entry, f"--worker {value}", default_engine)


def load_worker_config(path: str | Path, default_engine: str = "vllm") -> list[WorkerSpec]:
    """Read a workers YAML file: a list of entries, or a mapping with a ``workers`` list."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--worker-config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--worker-config {path}: not valid YAML ({exc})") from None
    if isinstance(data, dict):
        data = data.get("workers")
    if not isinstance(data, list):
        raise ConfigError(
            f"--worker-config {path}: expected a list of workers "
            "(or a mapping with a 'workers' list)"
        )
    return [
        spec_from_mapping(d, f"{path} workers[{i}]", default_engine) for i, d in enumerate(data)
    ]


def check_unique(specs: list[WorkerSpec]) -> None:
    seen: dict[str, str] = {}
    for s in specs:
        if s.worker_id in seen:
            raise ConfigError(
                f"worker id {s.worker_id!r} is given twice ({seen[s.worker_id]} and {s.url})"
            )
        seen[s.worker_id] = s.url

"""A vLLM general plugin: the engine registers itself with a running ``kvplug serve``.

Installed as the ``vllm.general_plugins`` entry point ``kvplug`` (``pip install kvplug[vllm]``
in the engine's environment). It does nothing unless ``KVPLUG_ROUTER_URL`` (kvplug's admin API,
``http://host:admin-port``) is in the engine's environment; with it (and ``KVPLUG_ADMIN_TOKEN``)

1. once the engine's own API answers ``/health``, it reads what the engine says about itself:
   ``/kv_event_sources`` (event and replay endpoints with their real ports, per DP rank),
   ``/metrics`` (``vllm:cache_config_info``: block size, KV capacity in blocks), ``/v1/models``;
   its role comes from ``--kv-transfer-config`` (``kv_producer`` → prefill, ``kv_consumer`` →
   decode), its URL from ``--host`` / ``--port``;
2. it ``POST``s that worker to ``/admin/workers``, retrying in the background (with backoff,
   logged) while kvplug is unreachable; the engine starts either way. A worker of the same id
   left over from an earlier run of this engine is replaced;
3. on shutdown (the process exits, or its API stops answering) it drains the worker, waits a
   little for kvplug's in-flight requests to it, and deletes it.

vLLM calls general plugins in every process it starts (API server, engine cores, workers, the
model-registry probe; ``vllm/plugins/__init__.py``: "loaded in all processes"). Only the first
process acts — the API server process, where vLLM's ``AsyncEngineArgs.add_cli_args`` loads the
plugins before the command line is parsed — and it marks the environment its children inherit
(``KVPLUG_VLLM_PLUGIN_PID``), so engine cores and workers, forked or spawned, stay out. The
command line is read from vLLM's own parser: the plugin wraps
``FlexibleArgumentParser.parse_args`` to keep the serve namespace it returns (so ``--config``
files and ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server`` alike work), with a
plain ``sys.argv`` scan as the fallback.

With ``KVPLUG_ETCD_URL`` instead (``etcd://host:2379``, and ``KVPLUG_FLEET_NAMESPACE``), the
same entry goes into etcd under a lease for router replicas started with ``kvplug serve
--discovery etcd://...`` (:class:`EtcdRegistrar`); an engine that dies leaves every replica when
its lease expires.

Environment: ``KVPLUG_ROUTER_URL`` (or ``KVPLUG_ETCD_URL``), ``KVPLUG_ADMIN_TOKEN``,
``KVPLUG_WORKER_ID`` (default ``host:port``), ``KVPLUG_ENGINE_URL`` (the URL kvplug reaches
this engine at; default from ``--host`` / ``--port``, a wildcard host replaced by the local
address that routes to kvplug), ``KVPLUG_WORKER_LABELS`` (``k=v,k2=v2``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvplug.vllm.plugin")

ROUTER_URL_ENV = "KVPLUG_ROUTER_URL"
TOKEN_ENV = "KVPLUG_ADMIN_TOKEN"
WORKER_ID_ENV = "KVPLUG_WORKER_ID"
ENGINE_URL_ENV = "KVPLUG_ENGINE_URL"
LABELS_ENV = "KVPLUG_WORKER_LABELS"
ETCD_URL_ENV = "KVPLUG_ETCD_URL"  # register in etcd (kvplug serve --discovery) instead
NAMESPACE_ENV = "KVPLUG_FLEET_NAMESPACE"
OWNER_ENV = "KVPLUG_VLLM_PLUGIN_PID"  # the one process that registers; children inherit it

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_HINTS = {
    401: f": is {TOKEN_ENV} kvplug serve's --admin-token?",
    404: f": is {ROUTER_URL_ENV} kvplug serve's admin API (--admin-port, default --port + 1)?",
    405: f": is {ROUTER_URL_ENV} kvplug serve's admin API (--admin-port, default --port + 1)?",
}

_registrar: Registrar | None = None


def register() -> None:
    """The entry point vLLM calls (in every process). Never raises: a plugin that raises
    would stop vLLM from starting."""
    global _registrar
    try:
        router_url = os.environ.get(ROUTER_URL_ENV, "").strip()
        etcd_url = os.environ.get(ETCD_URL_ENV, "").strip()
        if not (router_url or etcd_url) or _registrar is not None:
            return
        owner = os.environ.get(OWNER_ENV)
        if owner and owner != str(os.getpid()):
            return  # an engine core, a worker or another child of the registering process
        os.environ[OWNER_ENV] = str(os.getpid())
        _setup_logging()
        args = ArgsCapture()
        args.install()
        registrar: Registrar
        if etcd_url:
            namespace = os.environ.get(NAMESPACE_ENV, "default")
            registrar = EtcdRegistrar(etcd_url, namespace, args).start()
        else:
            registrar = Registrar(router_url, os.environ.get(TOKEN_ENV) or None, args).start()
        atexit.register(registrar.shutdown)
        _registrar = registrar
    except Exception:  # noqa: BLE001 - never break the engine
        log.exception("kvplug plugin: could not start; the engine runs unregistered")


def _setup_logging() -> None:
    """vLLM configures its own ``vllm`` logger only: when nothing else would show our lines
    (no root handler), give ours a stderr handler."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvplug] %(message)s"))
        log.addHandler(handler)
    log.setLevel(os.environ.get("KVPLUG_LOG_LEVEL", "INFO").upper())


# -------------------------------------------------------------------------------------------
# What the engine was started with
# -------------------------------------------------------------------------------------------


@dataclass
class ServeArgs:
    """The parts of ``vllm serve``'s command line the registration needs."""

    host: str | None = None
    port: int = 8000
    uds: str | None = None
    https: bool = False
    kv_role: str | None = None
    events_config: dict[str, Any] | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    long_prefill_token_threshold_adaptive: bool = False
    headless: bool = False  # engine cores only, no API server (vllm serve --headless)


_EVENTS_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic")


def _as_dict(value: Any, names: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """A config given as a dict, a JSON string or an object (vLLM's parsed config class; only
    ``names`` are read from it)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return {k: getattr(value, k) for k in names if hasattr(value, k)}


_PRODUCER_ROLES = ("kv_producer", "kv_both")  # vLLM's KVProducer
_CONSUMER_ROLES = ("kv_consumer", "kv_both")  # vLLM's KVConsumer


def transfer_role(transfer: dict[str, Any]) -> str | None:
    """The engine's ``kv_role`` as vLLM decides it. With ``MultiConnector`` the child
    connectors' roles decide (vLLM >= 0.34 does not pass the top-level role down to them:
    ``KVTransferConfig._connector_roles``); the top-level one counts when no child names
    one, as in earlier vLLM."""
    role = transfer.get("kv_role")
    if transfer.get("kv_connector") != "MultiConnector":
        return role if isinstance(role, str) else None
    extra = transfer.get("kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, dict) else None
    roles = [c.get("kv_role") for c in children or () if isinstance(c, dict)]
    roles = [r for r in roles if isinstance(r, str)]
    if not roles:
        return role if isinstance(role, str) else None
    producer = any(r in _PRODUCER_ROLES for r in roles)
    consumer = any(r in _CONSUMER_ROLES for r in roles)
    if producer and consumer:
        return "kv_both"
    return "kv_producer" if producer else "kv_consumer" if consumer else None


_TRANSFER_FIELDS = ("kv_role", "kv_connector", "kv_connector_extra_config")


def args_from_namespace(ns: Any) -> ServeArgs:
    """From the namespace vLLM's serve parser returns."""
    transfer = _as_dict(getattr(ns, "kv_transfer_config", None), _TRANSFER_FIELDS) or {}
    events = _as_dict(getattr(ns, "kv_events_config", None), _EVENTS_FIELDS)
    batched = getattr(ns, "max_num_batched_tokens", None)
    long_prefill = getattr(ns, "long_prefill_token_threshold", None)
    return ServeArgs(
        host=getattr(ns, "host", None) or None,
        port=int(getattr(ns, "port", None) or 8000),
        uds=getattr(ns, "uds", None) or None,
        https=bool(getattr(ns, "ssl_keyfile", None)),
        kv_role=transfer_role(transfer),
        events_config=events,
        data_parallel_size=int(getattr(ns, "data_parallel_size", None) or 1),
        data_parallel_rank=getattr(ns, "data_parallel_rank", None),
        max_num_batched_tokens=batched if isinstance(batched, int) else None,
        long_prefill_token_threshold=long_prefill if isinstance(long_prefill, int) else None,
        long_prefill_token_threshold_adaptive=(
            getattr(ns, "long_prefill_token_threshold_adaptive", False) is True
        ),
        headless=bool(getattr(ns, "headless", False)),
    )


def args_from_argv(argv: list[str]) -> ServeArgs:
    """A plain scan of the command line, for when vLLM's parser was not seen."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            name = name.replace("_", "-")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            values[name] = value
        i += 1
    transfer = _as_dict(values.get("kv-transfer-config")) or {}
    role = values.get("kv-transfer-config.kv-role") or values.get("kv-transfer-config.kv_role")
    batched = values.get("max-num-batched-tokens", "")
    long_prefill = values.get("long-prefill-token-threshold", "")
    return ServeArgs(
        host=values.get("host") or None,
        port=int(values.get("port") or 8000),
        uds=values.get("uds") or None,
        https=bool(values.get("ssl-keyfile")),
        kv_role=transfer_role(transfer) or role,
        events_config=_as_dict(values.get("kv-events-config")),
        data_parallel_size=int(values.get("data-parallel-size") or 1),
        max_num_batched_tokens=int(batched) if batched.isdigit() else None,
        long_prefill_token_threshold=int(long_prefill) if long_prefill.isdigit() else None,
        # a flag without a value (vLLM's BooleanOptionalAction; --no-... turns it off), though
        # the scan above may have taken the next word for its value
        long_prefill_token_threshold_adaptive="long-prefill-token-threshold-adaptive" in values
        and values["long-prefill-token-threshold-adaptive"].lower() not in ("false", "0"),
    )


class ArgsCapture:
    """Keeps the serve namespace vLLM's ``FlexibleArgumentParser.parse_args`` returns."""

    def __init__(self) -> None:
        self.namespace: Any = None
        self.seen = threading.Event()

    def install(self) -> None:
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            try:
                from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef] # < 0.11
            except ImportError:
                log.debug("vLLM's argument parser not found; reading sys.argv")
                return
        original = FlexibleArgumentParser.parse_args
        if getattr(original, "_kvplug_capture", False):
            return
        capture = self

        def parse_args(self, *a, **kw):  # type: ignore[no-untyped-def]
            ns = original(self, *a, **kw)
            if capture.namespace is None and hasattr(ns, "port") and hasattr(ns, "host"):
                capture.namespace = ns
                capture.seen.set()
            return ns

        parse_args._kvplug_capture = True  # type: ignore[attr-defined]
        FlexibleArgumentParser.parse_args = parse_args  # type: ignore[method-assign]

    def get(self, timeout: float, stop: threading.Event) -> ServeArgs | None:
        """The serve arguments once vLLM has parsed them (``sys.argv`` after ``timeout``);
        None when ``stop`` is set first."""
        deadline = time.monotonic() + timeout
        while not self.seen.wait(0.2):
            if stop.is_set():
                return None
            if time.monotonic() > deadline:
                log.info("no vLLM serve arguments seen; reading the command line")
                return args_from_argv(sys.argv[1:])
        return args_from_namespace(self.namespace)


# -------------------------------------------------------------------------------------------
# Registration
# -------------------------------------------------------------------------------------------


class AdminError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def _http(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 5.0
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - configured URL
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise AdminError(e.code, e.read().decode(errors="replace")) from None
    return json.loads(raw) if raw.strip() else None


def local_address_towards(url: str) -> str:
    """This host's address on the route to ``url`` (no packet is sent)."""
    parts = urlsplit(url)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((parts.hostname or "127.0.0.1", parts.port or 80))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _labels_from_env() -> dict[str, str]:
    out = {}
    for item in os.environ.get(LABELS_ENV, "").split(","):
        k, eq, v = item.partition("=")
        if eq and k.strip():
            out[k.strip()] = v.strip()
    return out


@dataclass
class EngineView:
    """What the running engine says about itself."""

    sources: list[Any] = field(default_factory=list)  # discovery.RankSource
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    models: list[str] = field(default_factory=list)


def read_engine(base_url: str, args: ServeArgs) -> EngineView:
    """Sources, cache config and models from the engine's own API (config as the fallback)."""
    from .discovery import configured_sources, fetch_event_sources
    from .metrics import scrape

    view = EngineView()
    try:
        view.sources = fetch_event_sources(base_url) or []
    except Exception as e:  # noqa: BLE001 - an old engine: fall back to its config
        log.warning("GET %s/kv_event_sources failed (%s); using --kv-events-config", base_url, e)
    cfg = args.events_config or {}
    if not view.sources and cfg.get("enable_kv_cache_events") and cfg.get("endpoint"):
        start = args.data_parallel_rank or 0
        size = 1 if args.data_parallel_rank is not None else args.data_parallel_size
        view.sources = configured_sources(
            cfg["endpoint"], cfg.get("replay_endpoint"), str(cfg.get("topic") or ""), start, size
        )
    try:
        sample = scrape(base_url + "/metrics")
        view.block_size, view.num_gpu_blocks = sample.block_size, sample.num_gpu_blocks
    except Exception as e:  # noqa: BLE001
        log.warning("GET %s/metrics failed (%s): block size and capacity unknown", base_url, e)
    try:
        data = _http("GET", base_url + "/v1/models")
        view.models = [m["id"] for m in data.get("data", []) if isinstance(m.get("id"), str)]
    except Exception as e:  # noqa: BLE001
        log.warning("GET %s/v1/models failed (%s)", base_url, e)
    return view


def worker_entry(
    worker_id: str | None, url: str, args: ServeArgs, view: EngineView, labels: dict[str, str]
) -> dict[str, Any]:
    """The admin API body (``POST /admin/workers``) for this engine."""
    role = ROLES.get(args.kv_role or "", "both")
    parts = urlsplit(url)
    # kvplug's own default id (host:port), given explicitly so that a restarted engine can
    # replace its stale entry (409) under either
    default_id = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    entry: dict[str, Any] = {"id": worker_id or default_id, "engine": "vllm", "url": url}
    entry["role"] = role
    labels = dict(labels)
    if view.sources:
        ranks = sorted(s.dp_rank for s in view.sources)
        first = min(view.sources, key=lambda s: s.dp_rank)
        entry["event_endpoint"] = first.endpoint
        if first.replay_endpoint:
            entry["replay_endpoint"] = first.replay_endpoint
        entry["dp_start"], entry["dp_size"] = ranks[0], ranks[-1] - ranks[0] + 1
        if first.topic:
            labels["kv_events_topic"] = first.topic
    if view.num_gpu_blocks:
        entry["kv_capacity_blocks"] = int(view.num_gpu_blocks)
    if args.max_num_batched_tokens:
        entry["max_batched_tokens"] = int(args.max_num_batched_tokens)
    if args.long_prefill_token_threshold:
        entry["long_prefill_token_threshold"] = int(args.long_prefill_token_threshold)
        if args.long_prefill_token_threshold_adaptive:
            entry["long_prefill_token_threshold_adaptive"] = True
    if view.models:
        entry["models"] = view.models
    if labels:
        entry["labels"] = labels
    return entry


class Registrar:
    """The background registration of one engine (a daemon thread in the API server process)."""

    def __init__(
        self,
        router_url: str,
        token: str | None,
        args: ArgsCapture | ServeArgs,
        *,
        poll: float = 0.5,
        max_backoff: float = 15.0,
        drain_wait: float = 10.0,
        recheck: float = 5.0,
    ) -> None:
        router_url = router_url.strip().rstrip("/")
        self.router_url = router_url if "://" in router_url else f"http://{router_url}"
        self.token = token
        self.args_source = args
        self.poll = poll
        self.max_backoff = max_backoff
        self.drain_wait = drain_wait
        self.recheck = recheck
        self.worker_id: str | None = os.environ.get(WORKER_ID_ENV) or None
        self.registered = threading.Event()
        self.stopping = threading.Event()
        self.done = threading.Event()  # the thread has finished
        self.entry: dict[str, Any] | None = None
        self.engine_url: str | None = None
        self._lock = threading.Lock()
        self._deregistered = False
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Registrar:
        self._thread = threading.Thread(target=self._run, name="kvplug-register", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Drain and deregister (atexit in the registering process; idempotent)."""
        if os.getpid() != self._pid:
            return  # a forked child inherited the atexit hook
        self.stopping.set()
        self.deregister()

    def _run(self) -> None:
        try:
            args = (
                self.args_source
                if isinstance(self.args_source, ServeArgs)
                else self.args_source.get(120.0, self.stopping)
            )
            if args is None:
                return
            if args.headless:
                log.info("headless engine (no API server): the API server registers, not this")
                return
            local, advertised = self._engine_urls(args)
            if local is None:
                return
            if not self._wait_engine_up(local):
                return
            view = read_engine(local, args)
            self.entry = worker_entry(self.worker_id, advertised, args, view, _labels_from_env())
            self.engine_url = advertised
            if view.block_size:
                log.info("engine %s: block size %d", advertised, view.block_size)
            if self._register_with_retries():
                self._watch(local)
        except Exception:  # noqa: BLE001 - the engine keeps running regardless
            log.exception("kvplug registration failed; the engine runs unregistered")
        finally:
            self.done.set()

    def _engine_urls(self, args: ServeArgs) -> tuple[str | None, str]:
        scheme = "https" if args.https else "http"
        override = os.environ.get(ENGINE_URL_ENV, "").strip().rstrip("/")
        if args.uds and not override:
            log.error(
                "the engine listens on a unix socket (--uds): kvplug cannot reach it; "
                "set %s to a URL it can",
                ENGINE_URL_ENV,
            )
            return None, ""
        host = args.host or ""
        wildcard = host in ("", "0.0.0.0", "::", "[::]")
        local_host = "127.0.0.1" if wildcard else host
        if ":" in local_host and not local_host.startswith("["):
            local_host = f"[{local_host}]"
        local = f"{scheme}://{local_host}:{args.port}"
        if override:
            return local, override
        adv_host = local_address_towards(self.router_url) if wildcard else local_host
        return local, f"{scheme}://{adv_host}:{args.port}"

    def _wait_engine_up(self, local: str) -> bool:
        while not self.stopping.is_set():
            try:
                _http("GET", local + "/health", timeout=5)
                return True
            except Exception:  # noqa: BLE001 - not up yet
                self.stopping.wait(self.poll)
        return False

    def _admin(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        return _http(method, self.router_url + path, body, self.token, timeout)

    def _register_with_retries(self) -> bool:
        assert self.entry is not None
        delay = self.poll
        attempt = replaced = 0
        while not self.stopping.is_set():
            attempt += 1
            try:
                answer = self._admin("POST", "/admin/workers", self.entry, timeout=60)
            except AdminError as e:
                if e.status == 409 and replaced < 3:
                    # this engine's id from an earlier run that kvplug still holds: replace it
                    log.warning("worker %s already registered; replacing it", self.entry["id"])
                    self._delete(self.entry["id"])
                    replaced += 1
                    continue
                if e.status < 500:
                    log.error(
                        "kvplug refused the registration of %s (%s)%s; not retrying",
                        self.entry["url"],
                        e,
                        _HINTS.get(e.status, ""),
                    )
                    return False
                err: Exception = e
            except (OSError, ValueError) as e:  # unreachable, reset, timeout, bad JSON
                err = e
            else:
                with self._lock:
                    self.worker_id = str(answer.get("id", self.worker_id))
                    self._deregistered = False
                    self.registered.set()
                log.info(
                    "registered with kvplug at %s as worker %s (%s, role %s, pid %d)",
                    self.router_url,
                    self.worker_id,
                    self.entry["url"],
                    self.entry["role"],
                    os.getpid(),
                )
                return True
            if attempt == 1 or attempt % 10 == 0:
                log.warning(
                    "kvplug at %s unreachable (%s); retrying in the background",
                    self.router_url,
                    err,
                )
            self.stopping.wait(delay)
            delay = min(delay * 2, self.max_backoff)
        return False

    def _watch(self, local: str) -> None:
        """After registering, until shutdown:

        * when the engine's listener closes (it is shutting down), take the worker out of
          routing at once rather than at process exit. A bare TCP connect, not an HTTP
          request: nothing shows up in the engine's access log;
        * every ``recheck`` seconds, ask kvplug whether it still has the worker: a restarted
          ``kvplug serve`` has forgotten it, so register again."""
        parts = urlsplit(local)
        address = (parts.hostname or "127.0.0.1", parts.port or 80)
        refused = 0
        next_check = time.monotonic() + self.recheck
        while not self.stopping.wait(self.poll):
            try:
                socket.create_connection(address, timeout=5).close()
                refused = 0
            except ConnectionRefusedError:
                refused += 1
            except OSError:  # slow or unreachable for another reason: not a shutdown
                refused = 0
            if refused >= 2:
                log.info("the engine's API is closed: deregistering from kvplug")
                self.deregister()
                return
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.recheck
                if self._forgotten() and not self._register_with_retries():
                    return

    def _forgotten(self) -> bool:
        """kvplug answers and no longer lists this worker (kvplug restarted)."""
        try:
            workers = self._admin("GET", "/admin/workers", timeout=5)["workers"]
        except Exception:  # noqa: BLE001 - kvplug down or restarting: ask again later
            return False
        if any(w.get("id") == self.worker_id for w in workers):
            return False
        with self._lock:
            if self._deregistered:
                return False
            self.registered.clear()
        log.warning(
            "kvplug no longer has worker %s (restarted?): registering again", self.worker_id
        )
        return True

    # -- deregistration -------------------------------------------------------------------------
    def _delete(self, worker_id: str) -> None:
        try:
            self._admin("DELETE", f"/admin/workers/{worker_id}", timeout=5)
        except AdminError as e:
            if e.status != 404:
                log.warning("kvplug: removing worker %s failed (%s)", worker_id, e)
        except (OSError, ValueError) as e:
            log.warning("kvplug: removing worker %s failed (%s)", worker_id, e)

    def _inflight(self, worker_id: str) -> int | None:
        try:
            workers = self._admin("GET", "/admin/workers", timeout=5)["workers"]
        except Exception:  # noqa: BLE001
            return None
        for w in workers:
            if w.get("id") == worker_id:
                return int(w.get("inflight") or 0)
        return None

    def deregister(self) -> None:
        """Drain (no new requests), wait up to ``drain_wait`` for kvplug's in-flight requests
        to this engine, then remove the worker. Once per registration."""
        with self._lock:
            if not self.registered.is_set() or self._deregistered:
                return
            self._deregistered = True
            worker_id = self.worker_id
        assert worker_id is not None
        try:
            self._admin("POST", f"/admin/workers/{worker_id}/drain", timeout=5)
        except Exception as e:  # noqa: BLE001 - still try to remove it
            log.warning("kvplug: draining worker %s failed (%s)", worker_id, e)
        deadline = time.monotonic() + self.drain_wait
        while time.monotonic() < deadline:
            n = self._inflight(worker_id)
            if not n:
                break
            time.sleep(0.1)
        self._delete(worker_id)
        log.info("deregistered worker %s from kvplug", worker_id)


class EtcdRegistrar(Registrar):
    """Registers the engine in etcd under a lease (``KVPLUG_ETCD_URL``), for replicas started
    with ``kvplug serve --discovery etcd://...``: every replica sees the engine, and if the
    engine dies its lease expires and it leaves them all. On shutdown the entry is marked
    draining (the replicas stop sending new requests), then the lease is revoked."""

    def __init__(
        self,
        etcd_url: str,
        namespace: str,
        args: ArgsCapture | ServeArgs,
        *,
        ttl: int = 10,
        **kw: Any,
    ) -> None:
        super().__init__(etcd_url, None, args, **kw)
        self.etcd_url = etcd_url
        self.namespace = namespace
        self.ttl = ttl
        self._loop: Any = None
        self._registration: Any = None

    def _run_async(self, coro: Any, timeout: float = 30.0) -> Any:
        import asyncio

        if self._loop is None:  # the lease keep-alive needs a loop that keeps running
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="kvplug-etcd", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _register_with_retries(self) -> bool:
        from kvplug.discovery.etcd import EtcdRegistration

        assert self.entry is not None
        delay, attempt = self.poll, 0
        while not self.stopping.is_set():
            attempt += 1
            reg = EtcdRegistration(
                self.etcd_url, self.entry, namespace=self.namespace, ttl=self.ttl
            )
            try:
                self._run_async(reg.start())
            except Exception as e:  # noqa: BLE001 - unreachable: retry in the background
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("etcd at %s unreachable (%s); retrying", self.etcd_url, e)
                self.stopping.wait(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            with self._lock:
                self._registration = reg
                self.worker_id = str(self.entry["id"])
                self._deregistered = False
                self.registered.set()
            log.info(
                "registered in etcd at %s as worker %s (%s, lease %d s)",
                self.etcd_url,
                self.worker_id,
                self.entry["url"],
                self.ttl,
            )
            return True
        return False

    def _forgotten(self) -> bool:
        return False  # the lease keep-alive holds the entry; etcd, not kvplug, forgets

    def deregister(self) -> None:
        with self._lock:
            if not self.registered.is_set() or self._deregistered:
                return
            self._deregistered = True
            reg = self._registration
        assert self.entry is not None and reg is not None
        try:  # draining first: the replicas stop routing here, in-flight requests finish
            self._run_async(reg.update({**self.entry, "draining": True}), timeout=5)
            time.sleep(min(self.drain_wait, 2.0))
        except Exception as e:  # noqa: BLE001 - still revoke
            log.warning("etcd: marking %s draining failed (%s)", self.worker_id, e)
        try:
            self._run_async(reg.close(), timeout=10)
        except Exception as e:  # noqa: BLE001
            log.warning("etcd: revoking the lease of %s failed (%s)", self.worker_id, e)
        log.info("deregistered worker %s from etcd", self.worker_id)

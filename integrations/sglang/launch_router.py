"""Drop-in for ``python -m sglang_router.launch_router`` / ``python -m smg.launch_router``: the
same command line, kvplug underneath.

    python -m kvplug.integrations.sglang.launch_router --host 127.0.0.1 --port 30000 \\
        --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --policy kvplug

    python -m kvplug.integrations.sglang.launch_router --pd-disaggregation \\
        --prefill http://10.0.0.1:30000 8998 --prefill http://10.0.0.2:30000 none \\
        --decode http://10.0.0.3:30000 --decode http://10.0.0.4:30000 --port 30000

Every flag of sglang-router 0.3.2 and smg 1.13 is accepted (``router_flags.py``). Mapped:

* ``--host``, ``--port``: the OpenAI API address; ``--worker-urls`` (aggregated workers),
  ``--pd-disaggregation`` with ``--prefill URL [BOOTSTRAP_PORT|none]`` (default port 8998,
  the prefill worker's ``bootstrap_port`` option) and ``--decode URL``; ``--dp-aware`` sends
  ``routed_dp_rank`` on both PD hops;
* ``--policy`` (``--prefill-policy``, ``--decode-policy``): ``kvplug``, ``cache_aware`` (the
  default) and ``prefix_hash`` → ``kvplug serve``'s default routing
  (``RouterConfig.router_mode``, ``affinity``; ``--router-mode kv`` for the event-driven cost
  alone); ``random``, ``round_robin``, ``power_of_two``, ``least_load`` → kvplug's ``random``,
  ``round-robin``, ``power-of-two``, ``least-loaded``; the rest → the default with a note.
  kvplug routes both PD stages with one mode;
* ``--api-key``: both routers answer 401 on their serving routes (``/v1/...``,
  ``/generate``) to a request without ``Authorization: Bearer KEY`` and send the key to the
  workers (sglang-router 0.3.2 and smg 1.13, checked by running them), so it becomes
  ``--api-key`` (clients must send it on ``/v1/*``, ``/v1/models`` too, which both leave open;
  ``/health``, ``/ready``, ``/metrics`` stay open, as theirs) **and** ``--engine-api-key``
  (sent to the engines, and to their ``/server_info`` here); an explicit ``--engine-api-key``
  wins for the engines; ``--log-level`` (``warn`` → ``warning``); ``--log-dir`` (a
  ``kvplug-router.log`` there as well as stderr); ``--request-timeout-secs`` →
  ``--request-timeout``; ``--max-payload-size`` → ``--max-body-bytes``; ``--disable-retries``
  → ``--retries 0``, ``--retry-max-retries N`` → ``--retries N``;
  ``--health-check-interval-secs`` / ``--health-check-timeout-secs`` → ``--health-interval`` /
  ``--health-timeout``, ``--disable-health-check`` → ``--health-interval 0``;
  ``--tokenizer-path`` / ``--model-path`` (a local directory) → ``--tokenizer``;
  ``--block-size`` (smg) → ``--kv-block-size``; ``--backend sglang|vllm|openai`` → the worker
  engine; ``--model-alias`` → ``--served-model-name``;
* ``--prometheus-host`` / ``--prometheus-port``: a ``/metrics`` listener there relaying kvplug's
  metrics (served on the API port too);
* block size: without ``--kv-block-size`` (or ``--block-size``) the launcher reads the workers'
  page size from ``GET /server_info`` (``kv_events.block_size``, else ``page_size``; SGLang's
  default is 1), waiting up to ``--worker-startup-timeout-secs`` and asking every
  ``--worker-startup-check-interval`` seconds (default 1 here) until a worker answers;
* DP ranks: a router command line gives none, so every worker that answered ``/server_info``
  gets the DP rank count its engine reports (``kv_events.dp_size``, else ``dp_size`` ×
  ``attn_dp_size``) as its ``dp_size``: each rank is routed, indexed and loaded on its own,
  and PD rooms are drawn ≡ the rank. kvplug cannot add ranks to a registered worker, so with
  ``--dp-aware`` the launcher waits (up to the same timeout) for every worker's answer; without
  it, the workers that answered in the pass that found the block size (one pass when
  ``--kv-block-size`` is given) are sized and the others keep one rank.

Everything else of the two routers is accepted and has no effect under kvplug; the launcher
logs each such flag once with the reason. Arguments neither router knows go to ``kvplug
serve`` unchanged (``--kv-block-size 16 --tokenizer /models/qwen --router-mode ...``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

from kvplug import ConfigError, RouterConfig
from kvplug.frontend.config import MAX_DP_SIZE

from .metrics import (
    dp_ranks_from_server_info,
    kv_events_from_server_info,
    page_size_from_server_info,
)
from .router_flags import (
    ANY,
    BOOL,
    DECODE,
    FLAG,
    IGNORED,
    MAPPED,
    ONE,
    PREFILL,
    REPEAT,
    SOME,
)

log = logging.getLogger("kvplug.launch_router")

# the cache-aware policies map to kvplug serve's default routing (kv's cost, then cache
# affinity with a latency guard); pass --router-mode kv for Dynamo's cost alone
DEFAULT_MODE = RouterConfig.router_mode
POLICY_MODES = {
    "kvplug": DEFAULT_MODE,
    "cache_aware": DEFAULT_MODE,
    "prefix_hash": DEFAULT_MODE,
    "random": "random",
    "round_robin": "round-robin",
    "power_of_two": "power-of-two",
    "least_load": "least-loaded",
}
DEFAULT_BOOTSTRAP_PORT = 8998
LOG_LEVELS = {"debug": "debug", "info": "info", "warn": "warning", "warning": "warning"}
LOG_LEVELS["error"] = "error"
BACKEND_ENGINES = {"sglang": "sglang", "vllm": "vllm", "openai": "openai"}
DEFAULT_PROMETHEUS = ("0.0.0.0", 29000)  # sglang-router's defaults
LOG_FILE = "kvplug-router.log"

_ARITY_KWARGS: dict[str, dict[str, Any]] = {
    FLAG: {"action": "store_true"},
    ONE: {},
    ANY: {"nargs": "*", "action": "extend"},
    SOME: {"nargs": "+", "action": "extend"},
    PREFILL: {"action": "append", "nargs": "+"},
    DECODE: {"action": "append", "nargs": 1},
    REPEAT: {"action": "append"},
    BOOL: {"action": argparse.BooleanOptionalAction},
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: kvplug serve's own flags (--tokenizer, --retries, ...) must not be
    # taken for abbreviations of sglang-router flags (--tokenizer-path, --retry-max-retries)
    p = argparse.ArgumentParser(
        prog="python -m kvplug.integrations.sglang.launch_router",
        description="sglang-router / smg compatible launcher for kvplug serve (see the module "
        "doc); arguments neither router knows are passed to kvplug serve",
        allow_abbrev=False,
    )
    for flag, arity in MAPPED.items():
        p.add_argument(flag, dest=_dest(flag), default=None, **_ARITY_KWARGS[arity])
    for flag, (arity, _) in IGNORED.items():
        # SUPPRESS: only the flags actually given appear in the namespace
        p.add_argument(flag, dest=_dest(flag), default=argparse.SUPPRESS, **_ARITY_KWARGS[arity])
    return p


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return build_parser()  # ~250 options: built once per process


@dataclass
class Launch:
    """What ``main`` runs: kvplug serve's argv (without the worker file), the worker file,
    notes for the log, and the launcher's own jobs."""

    serve: list[str]
    workers: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    log_level: str = "info"
    log_dir: str | None = None
    prometheus: tuple[str, int] | None = None
    api_host: str = "127.0.0.1"
    api_port: int = 30000
    startup_timeout: float = 1800.0
    startup_interval: float = 1.0
    dp_aware: bool = False  # some worker's hops carry routed_dp_rank
    engine_api_key: str | None = None  # sent to the workers' /server_info too

    @property
    def worker_urls(self) -> list[str]:
        return list(dict.fromkeys(w["url"] for w in self.workers["workers"]))


def _int(value: str, flag: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r}: not an integer") from None


def _prefill_entry(values: list[str], engine: str, dp_aware: bool) -> dict[str, Any]:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {values}")
    url = values[0]
    port: int | None = DEFAULT_BOOTSTRAP_PORT
    if len(values) == 2:
        if values[1].lower() == "none":
            port = None
        else:
            try:
                port = int(values[1])
            except ValueError:
                raise ConfigError(
                    f"--prefill {url}: bootstrap port {values[1]!r} is not an integer or 'none'"
                ) from None
    options: dict[str, Any] = {"bootstrap_port": port}
    if dp_aware:
        options["dp_aware"] = True
    return {"url": url, "engine": engine, "role": "prefill", "options": options}


def _workers(args: argparse.Namespace, engine: str, notes: list[str]) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = []
    prefill, decode = args.prefill or [], args.decode or []
    if args.pd_disaggregation:
        if not prefill or not decode:
            raise ConfigError("--pd-disaggregation needs at least one --prefill and one --decode")
        workers += [_prefill_entry(v, engine, args.dp_aware) for v in prefill]
        for (url,) in decode:
            entry: dict[str, Any] = {"url": url, "engine": engine, "role": "decode"}
            if args.dp_aware:
                entry["options"] = {"dp_aware": True}
            workers.append(entry)
        if args.worker_urls:
            notes.append(
                "--worker-urls with --pd-disaggregation: also serving them as aggregated workers"
            )
    elif prefill or decode:
        raise ConfigError("--prefill/--decode need --pd-disaggregation")
    workers += [{"url": u, "engine": engine} for u in args.worker_urls or []]
    return workers


def _mode(args: argparse.Namespace, notes: list[str]) -> str:
    policy = args.policy or "cache_aware"
    mode = POLICY_MODES.get(policy)
    if mode is None:
        mode = DEFAULT_MODE
        notes.append(
            f"--policy {policy}: no kvplug equivalent, using kvplug's default routing "
            f"({DEFAULT_MODE})"
        )
    stages = {policy, args.prefill_policy or policy, args.decode_policy or policy}
    if len(stages) > 1:
        notes.append(
            f"prefill/decode policies {sorted(stages)}: kvplug routes both stages with mode {mode}"
        )
    return mode


def _serving_flags(args: argparse.Namespace, rest: list[str], notes: list[str]) -> list[str]:
    """kvplug serve arguments for the mapped sglang-router flags (an explicit kvplug serve
    argument in ``rest`` wins)."""
    out: list[str] = []

    def put(flag: str, *values: str) -> None:
        if flag not in rest:
            out.extend([flag, *values])

    if args.api_key:
        # both routers guard their own serving routes with it (401 without the bearer) and
        # send it to the workers: kvplug does both
        put("--api-key", args.api_key)
        put("--engine-api-key", args.api_key)
    if args.request_timeout_secs is not None:
        put("--request-timeout", str(_int(args.request_timeout_secs, "--request-timeout-secs")))
    if args.max_payload_size is not None:
        put("--max-body-bytes", str(_int(args.max_payload_size, "--max-payload-size")))
    if args.disable_retries:
        put("--retries", "0")
    elif args.retry_max_retries is not None:
        put("--retries", str(_int(args.retry_max_retries, "--retry-max-retries")))
    if args.disable_health_check:
        put("--health-interval", "0")
    elif args.health_check_interval_secs is not None:
        put("--health-interval", args.health_check_interval_secs)
    if args.health_check_timeout_secs is not None:
        put("--health-timeout", args.health_check_timeout_secs)
    if args.block_size is not None:
        put("--kv-block-size", str(_int(args.block_size, "--block-size")))
    for alias in args.model_alias or []:
        out += ["--served-model-name", alias]
    tokenizer = args.tokenizer_path or args.model_path or args.model
    if tokenizer is not None:
        if os.path.isdir(tokenizer):
            put("--tokenizer", tokenizer)
        else:
            notes.append(
                f"tokenizer {tokenizer!r} is not a local directory (kvplug downloads nothing): "
                "token ids come from the engines' /tokenize; pass --tokenizer DIR to "
                "tokenize locally"
            )
    return out


def translate(argv: list[str]) -> Launch:
    """The ``kvplug serve`` launch for an sglang-router / smg command line."""
    args, rest = _parser().parse_known_args(argv)
    notes: list[str] = []
    backend = args.backend or "sglang"
    engine = BACKEND_ENGINES.get(backend)
    if engine is None:
        engine = "openai"
        notes.append(f"--backend {backend}: no kvplug adapter, workers are served as 'openai'")
    workers = _workers(args, engine, notes)
    mode = _mode(args, notes)
    level = (args.log_level or "info").lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {args.log_level!r}: one of debug, info, warn, error")
    host = args.host or "0.0.0.0"
    port = _int(args.port, "--port") if args.port is not None else 30000
    serve = ["serve", "--host", host, "--port", str(port), "--worker-engine", engine]
    serve += ["--log-level", LOG_LEVELS[level]]
    if "--router-mode" not in rest:
        serve += ["--router-mode", mode]
    serve += _serving_flags(args, rest, notes)
    prometheus = None
    if args.prometheus_host is not None or args.prometheus_port is not None:
        prometheus = (
            args.prometheus_host or DEFAULT_PROMETHEUS[0],
            _int(args.prometheus_port, "--prometheus-port")
            if args.prometheus_port is not None
            else DEFAULT_PROMETHEUS[1],
        )
    else:
        notes.append(f"metrics: http://{host}:{port}/metrics (the API port)")
    by_reason: dict[str, list[str]] = {}
    for flag, (_, reason) in IGNORED.items():
        if hasattr(args, _dest(flag)):
            by_reason.setdefault(reason, []).append(flag)
    for reason, flags in by_reason.items():
        notes.append(f"accepted, no effect under kvplug: {' '.join(flags)}: {reason}")
    launch = Launch(
        serve + rest,
        {"workers": workers},
        notes,
        log_level=LOG_LEVELS[level],
        log_dir=args.log_dir,
        prometheus=prometheus,
        api_host="127.0.0.1" if host in ("0.0.0.0", "::", "") else host,
        api_port=port,
        # the PD hops are what carry routed_dp_rank (the adapter's dp_aware option)
        dp_aware=any(w.get("options", {}).get("dp_aware") for w in workers),
        engine_api_key=_serve_value(serve + rest, "--engine-api-key")
        or os.environ.get("KVPLUG_ENGINE_API_KEY")
        or None,
    )
    if args.worker_startup_timeout_secs is not None:
        launch.startup_timeout = float(
            _int(args.worker_startup_timeout_secs, "--worker-startup-timeout-secs")
        )
    if args.worker_startup_check_interval is not None:
        launch.startup_interval = float(
            _int(args.worker_startup_check_interval, "--worker-startup-check-interval")
        )
    return launch


def _serve_value(argv: list[str], flag: str) -> str | None:
    """The last value of ``flag`` in a kvplug serve argv (``FLAG V`` or ``FLAG=V``)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


# -- what the workers say in /server_info: page size, DP ranks -------------------------------
def _server_info(url: str, timeout: float, api_key: str | None = None) -> dict[str, Any] | None:
    """``/server_info`` (``/get_server_info`` on old builds), None if the worker is not up.
    ``api_key``: an engine started with ``--api-key`` guards ``/server_info`` with it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/server_info", "/get_server_info"):
        try:
            request = urllib.request.Request(url.rstrip("/") + path, headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                info = json.loads(resp.read())
                return info if isinstance(info, dict) else {}
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                continue
            if exc.code in (401, 403):  # up, and refusing: waiting will not help
                raise ConfigError(
                    f"worker {url} answered {path} with HTTP {exc.code}: "
                    + (
                        "--api-key is not the key it was started with"
                        if api_key
                        else "it needs its key: give it with --api-key"
                    )
                ) from None
            return None
        except (OSError, ValueError):
            return None
    return {}  # up, but neither path exists: not an SGLang server


def read_server_infos(
    urls: list[str],
    timeout: float,
    interval: float,
    *,
    wait_for_all: bool = False,
    require_answer: bool = True,
    api_key: str | None = None,
) -> dict[str, dict[str, Any]]:
    """The ``/server_info`` of the workers that answer, by URL (``{}`` for a server without
    one). Asks every ``interval`` seconds until ``timeout``: until a first pass in which some
    worker answered, or (``wait_for_all``) until every worker has. Without either need
    (``require_answer`` false, ``wait_for_all`` false) one pass. Nobody answering by the
    deadline is a ``ConfigError`` when ``require_answer``."""
    deadline = time.monotonic() + timeout
    infos: dict[str, dict[str, Any]] = {}
    pending = list(dict.fromkeys(urls))
    while True:
        for url in pending:
            info = _server_info(url, min(5.0, max(timeout, 0.1)), api_key)
            if info is not None:
                infos[url] = info
        pending = [u for u in pending if u not in infos]
        if not pending or (infos and not wait_for_all):
            return infos  # everyone, or the first answers when that is all that is wanted
        if not wait_for_all and not require_answer:
            return infos  # nothing to wait for: one look
        if time.monotonic() >= deadline:
            if infos or not require_answer:
                return infos
            raise ConfigError(
                f"no worker answered /server_info within {timeout:g} s "
                "(--worker-startup-timeout-secs): start the workers, or give the page size "
                "with --kv-block-size"
            )
        time.sleep(interval)


def block_size_from_infos(infos: dict[str, dict[str, Any]]) -> int | None:
    """The page size the workers publish KV events with; None if none of them says
    (kvplug's default applies). Workers that disagree are a ``ConfigError``."""
    sizes: dict[str, int | None] = {}
    for url, info in infos.items():
        kv = kv_events_from_server_info(info, url)
        sizes[url] = kv.block_size if kv is not None else page_size_from_server_info(info)
    known = {u: s for u, s in sizes.items() if s is not None}
    if len(set(known.values())) > 1:
        raise ConfigError(
            "the workers publish KV events at different page sizes: "
            + ", ".join(f"{u}={s}" for u, s in known.items())
        )
    if not known:
        return None
    url, size = next(iter(known.items()))
    log.info("block size %d: the page size %s reports in /server_info", size, url)
    return size


def discover_block_size(urls: list[str], timeout: float, interval: float) -> int | None:
    """The page size the workers publish KV events with; None if the workers that answered
    do not say (kvplug's default applies). Waits up to ``timeout`` for a first answer."""
    return block_size_from_infos(read_server_infos(urls, timeout, interval))


def apply_engine_dp_sizes(launch: Launch, infos: dict[str, dict[str, Any]]) -> None:
    """Give every command-line worker the DP rank count its engine reports (none is given on
    a router command line: smg reads it from ``/server_info`` too), so that each rank is an
    endpoint of its own (events, load, routing) and PD rooms steer ranks. kvplug cannot change
    a registered worker's ranks later: a worker that has not answered keeps one rank."""
    for entry in launch.workers["workers"]:
        url = entry["url"]
        if url not in infos:
            if entry.get("options", {}).get("dp_aware"):
                log.warning(
                    "worker %s did not answer /server_info in time: registered with one DP "
                    "rank, so --dp-aware routes it all to rank 0; restart the launcher once "
                    "it is up to use all its ranks",
                    url,
                )
            continue
        ranks = dp_ranks_from_server_info(infos[url])
        if ranks is None or ranks == 1:
            continue
        if ranks > MAX_DP_SIZE:
            raise ConfigError(
                f"worker {url}: /server_info reports {ranks} DP ranks, kvplug routes at most "
                f"{MAX_DP_SIZE} per worker"
            )
        entry["dp_size"] = ranks
        log.info("worker %s: %d DP ranks (its /server_info)", url, ranks)


# -- --prometheus-port -----------------------------------------------------------------------
def start_metrics_relay(host: str, port: int, source: str) -> ThreadingHTTPServer:
    """A ``GET /metrics`` listener at ``host:port`` answering with kvplug's ``source`` metrics."""

    class Relay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            try:
                with urllib.request.urlopen(source, timeout=5) as resp:
                    body, ctype = resp.read(), resp.headers.get("Content-Type", "text/plain")
            except (OSError, ValueError) as exc:
                self.send_error(503, f"kvplug serve is not answering yet: {exc}")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    try:
        server = ThreadingHTTPServer((host, port), Relay)
    except OSError as exc:
        raise ConfigError(f"--prometheus-host/--prometheus-port {host}:{port}: {exc}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-relay", daemon=True).start()
    return server


def _setup_logging(launch: Launch) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(launch.log_level.upper())
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if launch.log_dir:
        os.makedirs(launch.log_dir, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(launch.log_dir, LOG_FILE)))
    for h in handlers:  # kvplug serve's logging.basicConfig then keeps these
        h.setFormatter(fmt)
        root.addHandler(h)


def main(argv: list[str] | None = None) -> int:
    from kvplug.cli import main as kvplug_main

    try:
        launch = translate(list(sys.argv[1:] if argv is None else argv))
        _setup_logging(launch)
        for note in launch.notes:
            log.info("%s", note)
        if launch.worker_urls:
            need_block_size = _serve_value(launch.serve, "--kv-block-size") is None
            # --dp-aware sends each request's rank to the engine: a worker registered with too
            # few ranks would get everything on rank 0, so every worker's count is awaited
            infos = read_server_infos(
                launch.worker_urls,
                launch.startup_timeout,
                launch.startup_interval,
                wait_for_all=launch.dp_aware,
                require_answer=need_block_size,
                api_key=launch.engine_api_key,
            )
            if need_block_size:
                size = block_size_from_infos(infos)
                if size is not None:
                    launch.serve += ["--kv-block-size", str(size)]
            apply_engine_dp_sizes(launch, infos)
        if launch.prometheus is not None:
            host, port = launch.prometheus
            start_metrics_relay(host, port, f"http://{launch.api_host}:{launch.api_port}/metrics")
            log.info("metrics relayed on http://%s:%d/metrics", host, port)
    except ConfigError as exc:
        print(f"launch_router: {exc}", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kvplug-sglang-") as f:
        yaml.safe_dump(launch.workers, f)
        f.flush()
        return kvplug_main(launch.serve + ["--worker-config", f.name])


if __name__ == "__main__":
    sys.exit(main())

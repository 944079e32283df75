"""``kvplug serve``: an OpenAI-compatible, KV-cache-aware routing frontend for a fleet of
engines (vLLM, SGLang, TRT-LLM or any OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from kvplug.cli import RunError, UsageError
from kvplug.config import QUEUE_POLICIES
from kvplug.errors import ConfigError, KvplugError

DESCRIPTION = """\
Serve the OpenAI API on one URL and route every request to the engine that holds most of its
prompt in KV cache and has the least load (Dynamo's KV-router cost, kvplug's index).

examples:
  kvplug serve --worker http://10.0.0.1:8000 --worker http://10.0.0.2:8000 \\
      --kv-block-size 16 --tokenizer /models/llama-3-8b
  kvplug serve --worker-config workers.yaml --admin-token "$TOKEN"
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API in front of a fleet of engines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    from kvplug.config import add_router_arguments

    add_router_arguments(parser)
    parser.set_defaults(func=run)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address of the OpenAI API (default 127.0.0.1: this machine only; 0.0.0.0 or :: "
        "serves other machines, as a container or Kubernetes pod needs)",
    )
    g.add_argument(
        "--port",
        "--http-port",
        dest="port",
        type=int,
        default=8000,
        help="port of the OpenAI API (default 8000)",
    )
    g.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="model name clients may ask for (repeatable); default: discovered from "
        "the workers' /v1/models and the worker config's 'models'",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=0,
        metavar="N",
        help="refuse prompts longer than N tokens with HTTP 400 (0 = no limit; "
        "checked when token ids are known)",
    )
    g.add_argument(
        "--max-batch-prompts",
        type=int,
        default=256,
        metavar="N",
        help="refuse /v1/completions batches (prompt as a list) of more than N prompts with "
        "HTTP 400 (0 = no limit; each prompt of a batch is routed and sent on its own)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="N",
        help="refuse request bodies over N bytes with HTTP 413 (default 16 MiB)",
    )
    g.add_argument(
        "--decision-store-size",
        type=int,
        default=10_000,
        metavar="N",
        help="recent decisions kept for GET /kvplug/decisions/{id} (default 10000)",
    )
    g.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="serve from N processes on the one port (Linux SO_REUSEPORT), each a full "
        "router subscribed to every engine's KV events, sharing in-flight load and answering "
        "/metrics and decision lookups for all; a process that dies is restarted "
        "(docs/frontend.md, 'Several processes'). Not with --admin-token, --epp-port or "
        "--replica-sync. Default 1",
    )
    g.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="auto: uvloop when installed (faster proxying), else asyncio",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="default info",
    )

    g.add_argument(
        "--client-routing-hints",
        choices=("ignore", "trust", "reject"),
        default="ignore",
        help="client-sent routing hints (worker and DP-rank pins, allow-lists, label "
        "selectors: x-kvplug-* / x-worker-instance-id / x-dynamo-dp-rank headers, nvext "
        "pins): ignore (default: routed as if absent, counted in "
        "kvplug_routing_hints_ignored_total, logged once), trust (honour them: only behind "
        "a gateway that sets or strips them), reject (HTTP 403)",
    )
    g.add_argument(
        "--client-header-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client has to send a request's head (line and headers) after "
        "connecting or after its previous answer; then HTTP 408 and the connection closes "
        "(default 30; 0 = no limit)",
    )
    g.add_argument(
        "--client-body-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a client has to send a request's whole body once its head arrived; "
        "then HTTP 408 (default 60; 0 = no limit)",
    )
    g.add_argument(
        "--no-http-lane",
        dest="http_lane",
        action="store_false",
        help="serve every request with aiohttp's server; by default kvplug's own HTTP/1.1 "
        "lane answers plain POSTs to /v1/completions and /v1/chat/completions and hands "
        "everything else to aiohttp (docs/frontend.md, The HTTP lane)",
    )

    g.add_argument(
        "--data-path",
        choices=("auto", "native", "python"),
        default="auto",
        help="who serves the plain routed requests (token-id completions, and text with a local "
        "--tokenizer): 'native', a compiled HTTP data path (Linux) that calls Python only to "
        "route and to record, or 'python'; every other request goes to the Python path. "
        "'auto' (default): native where kvplug._lane is built, else python, said at start "
        "(docs/frontend.md, The native data path)",
    )

    q = parser.add_argument_group(
        "admission queue",
        "Dynamo's router queue: a request waits (instead of being routed) while every worker "
        "it could go to has more active prefill tokens than THRESHOLD x its max_batched_tokens "
        "(a worker without a known budget never counts as busy); waiting requests are "
        "routed, in policy order, as load drops",
    )
    q.add_argument(
        "--router-queue-threshold",
        type=float,
        default=None,
        metavar="FRAC",
        help="fraction of max_batched_tokens (e.g. 1.0); default: off (no queue), as Dynamo",
    )
    q.add_argument(
        "--router-queue-policy",
        choices=QUEUE_POLICIES,
        default=None,
        help="order of release: fcfs (arrival; tail TTFT), wspt (shortest uncached prompt "
        "first; mean TTFT), lcfs (newest first); nvext.agent_hints.latency_sensitivity "
        "(seconds) moves a request ahead; default fcfs",
    )
    q.add_argument(
        "--router-queue-max-length",
        type=int,
        default=None,
        metavar="N",
        help="waiting requests at most; more are refused with HTTP 529 queue_full "
        "(default 0 = no cap)",
    )
    q.add_argument(
        "--router-queue-max-wait",
        type=float,
        default=None,
        metavar="S",
        help="seconds a request may wait before it fails with HTTP 503 queue_timeout "
        "(default 0 = no limit)",
    )

    w = parser.add_argument_group("workers")
    w.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="[ID=]URL",
        help="an engine's base URL, e.g. http://10.0.0.1:8000 (repeatable); the id "
        "defaults to host:port",
    )
    w.add_argument(
        "--worker-engine",
        default="vllm",
        metavar="KIND",
        help="engine kind (adapter) of --worker engines and of YAML entries without "
        "'engine' (default vllm; built-in kinds: openai, vllm, sglang, trtllm)",
    )
    w.add_argument(
        "--worker-config",
        metavar="YAML",
        help="workers file: engine, url, role, event_endpoint, replay_endpoint, "
        "metrics_url, labels, taints, dp_start, dp_size, device, models, options "
        "(see docs/frontend.md)",
    )

    t = parser.add_argument_group("tokens")
    t.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="local tokenizer directory (tokenizer.json + tokenizer_config.json "
        "with the chat template); nothing is downloaded",
    )
    t.add_argument(
        "--tokenizer-cache-chunks",
        type=int,
        default=16_384,
        metavar="N",
        help="keep the token ids of up to N ~256-character chunks of prompt text, so text "
        "seen before (system prompts, conversation history) is not tokenized again; checked "
        "against whole-text tokenization at start and on every 64th prompt, and off for a "
        "tokenizer that fails (docs/frontend.md; default 16384, ~10 MB; 0 = off)",
    )
    t.add_argument(
        "--no-engine-tokenize",
        dest="engine_tokenize",
        action="store_false",
        help="never ask an engine's /tokenize (route on load when token ids are unknown)",
    )
    t.add_argument(
        "--max-tokenize-chars",
        type=int,
        default=1_000_000,
        metavar="N",
        help="refuse prompts of more than N characters with HTTP 413 when their token ids "
        "would come from an engine's /tokenize (default 1000000; 0 = no cap; a local "
        "--tokenizer has no cap)",
    )
    t.add_argument(
        "--tokenize-concurrency",
        type=int,
        default=4,
        metavar="N",
        help="engine /tokenize calls at once (default 4; 0 = no limit); a request that "
        "cannot get a slot within --tokenize-timeout is routed on load only",
    )
    t.add_argument(
        "--tokenize-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an engine /tokenize call (and the wait for a slot) may take (default 5)",
    )

    f = parser.add_argument_group("failures and health")
    f.add_argument(
        "--retries",
        type=int,
        default=1,
        metavar="N",
        help="retries on another worker when an engine fails before its first byte (default 1)",
    )
    f.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to connect to an engine (default 5)",
    )
    f.add_argument(
        "--per-try-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds one attempt may wait for the engine's first byte before it counts as "
        "failed and is retried on another worker (default 0 = only --request-timeout)",
    )
    f.add_argument(
        "--idle-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds without a byte from an engine before the request fails (default 600)",
    )
    f.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="total seconds for a request: the whole answer, or a stream's first byte; "
        "then HTTP 504 request_timeout (default 600; 0 = none)",
    )
    f.add_argument(
        "--max-stream-duration",
        type=float,
        default=0.0,
        metavar="S",
        help="total seconds of a streamed answer; then the stream ends with an error "
        "event (default 0 = none)",
    )
    f.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds for a disaggregated prefill hop (default 120)",
    )
    f.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between health probes of every worker (default 5; 0 = off)",
    )
    f.add_argument(
        "--health-timeout",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds a health probe may take (default 2)",
    )
    f.add_argument(
        "--health-unhealthy-threshold",
        type=int,
        default=2,
        metavar="N",
        help="failed health probes in a row before a worker is taken out (default 2)",
    )
    o = parser.add_argument_group(
        "outlier detection",
        "Envoy's consecutive-failure ejection: a worker whose requests keep failing (5xx, "
        "reset, timeout, broken stream) is taken out of rotation even while its health path "
        "answers, for a time that grows with each ejection; a passing probe then brings it back",
    )
    o.add_argument(
        "--outlier-consecutive-failures",
        type=int,
        default=5,
        metavar="N",
        help="failures in a row that eject a worker (default 5; 0 = off)",
    )
    o.add_argument(
        "--outlier-base-ejection-time",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds of the first ejection; the n-th lasts n times as long (default 30)",
    )
    o.add_argument(
        "--outlier-max-ejection-time",
        type=float,
        default=300.0,
        metavar="S",
        help="longest ejection (default 300)",
    )
    o.add_argument(
        "--outlier-max-ejection-percent",
        type=float,
        default=10.0,
        metavar="P",
        help="no ejection while P%% of the workers are ejected; one worker may always be "
        "(default 10)",
    )

    g2 = parser.add_argument_group("gateway endpoint picker")
    g2.add_argument(
        "--epp-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the Gateway API Inference Extension's endpoint-picker protocol "
        "(Envoy ext_proc over gRPC, with gRPC health) on this port, so Envoy, kgateway, Istio "
        "or llm-d can use kvplug as their picker (needs the gateway extra); default: off",
    )
    g2.add_argument(
        "--epp-host",
        default="127.0.0.1",
        help="address of the endpoint picker (default 127.0.0.1)",
    )

    r = parser.add_argument_group("router replicas")
    r.add_argument(
        "--replica-sync",
        default=None,
        metavar="NATS_URL",
        help="share in-flight load with the other kvplug replicas over NATS "
        "(e.g. nats://127.0.0.1:4222), so replicas do not herd onto one worker; every replica "
        "subscribes to every engine's events itself (needs the replicas extra); default: off",
    )
    r.add_argument(
        "--discovery",
        default=None,
        metavar="ETCD_URL",
        help="also take workers from etcd (etcd://HOST:2379: engines register under "
        "/kvplug/<namespace>/workers/<id> with a lease; a worker whose lease expires leaves; "
        "needs the replicas extra) or from a Kubernetes Service's EndpointSlices "
        "(kubernetes://NAMESPACE/SERVICE[?port=NAME&engine=KIND], in-cluster credentials); "
        "default: off",
    )
    r.add_argument(
        "--fleet-namespace",
        default="default",
        help="the replicas of one fleet share a namespace (NATS subject kvplug.<namespace>.load, "
        "etcd prefix /kvplug/<namespace>/workers/)",
    )
    r.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name on the wire (default: random)",
    )

    k = parser.add_argument_group("API keys")
    k.add_argument(
        "--api-key",
        default=os.environ.get("KVPLUG_API_KEY"),
        help="clients must send 'Authorization: Bearer KEY' to /v1/* (or env KVPLUG_API_KEY); "
        "default: no check",
    )
    k.add_argument(
        "--engine-api-key",
        default=os.environ.get("KVPLUG_ENGINE_API_KEY"),
        help="bearer token kvplug sends to the engines (their --api-key; or env "
        "KVPLUG_ENGINE_API_KEY); default: the client's Authorization header is forwarded, "
        "unless --api-key is set",
    )

    a = parser.add_argument_group("admin API")
    a.add_argument(
        "--admin-host",
        default="127.0.0.1",
        help="address of the admin API (default 127.0.0.1: loopback only)",
    )
    a.add_argument(
        "--admin-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port of the admin API (default --port + 1)",
    )
    a.add_argument(
        "--admin-token",
        default=os.environ.get("KVPLUG_ADMIN_TOKEN"),
        help="bearer token of the admin API (or env KVPLUG_ADMIN_TOKEN); without "
        "it the admin API is off",
    )


def settings_from_args(args: argparse.Namespace):
    from kvplug.frontend.app import ServeSettings
    from kvplug.frontend.outliers import OutlierSettings

    for name in (
        "max_prompt_tokens",
        "max_batch_prompts",
        "max_body_bytes",
        "retries",
        "decision_store_size",
        "per_try_timeout",
        "idle_timeout",
        "request_timeout",
        "max_stream_duration",
        "max_tokenize_chars",
        "tokenizer_cache_chunks",
        "tokenize_concurrency",
        "tokenize_timeout",
        "outlier_consecutive_failures",
        "outlier_base_ejection_time",
        "outlier_max_ejection_time",
        "outlier_max_ejection_percent",
    ):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("client_header_timeout", "client_body_timeout"):
        value = getattr(args, name)
        if not 0 <= value < float("inf"):
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds >= 0")
    return ServeSettings(
        max_prompt_tokens=args.max_prompt_tokens,
        max_batch_prompts=args.max_batch_prompts,
        max_body_bytes=args.max_body_bytes,
        retries=args.retries,
        decision_store_size=args.decision_store_size,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        connect_timeout=args.connect_timeout,
        per_try_timeout=args.per_try_timeout,
        idle_timeout=args.idle_timeout,
        request_timeout=args.request_timeout,
        max_stream_duration=args.max_stream_duration,
        prefill_timeout=args.prefill_timeout,
        served_model_names=list(args.served_model_name),
        engine_tokenize=args.engine_tokenize,
        max_tokenize_chars=args.max_tokenize_chars,
        tokenize_concurrency=args.tokenize_concurrency,
        tokenize_timeout=args.tokenize_timeout,
        health_unhealthy_threshold=max(1, args.health_unhealthy_threshold),
        outliers=OutlierSettings(
            consecutive_failures=args.outlier_consecutive_failures,
            base_ejection_time=args.outlier_base_ejection_time,
            max_ejection_time=args.outlier_max_ejection_time,
            max_ejection_percent=args.outlier_max_ejection_percent,
        ),
        api_key=args.api_key or None,
        engine_api_key=args.engine_api_key or None,
        client_routing_hints=args.client_routing_hints,
        client_header_timeout=args.client_header_timeout,
        client_body_timeout=args.client_body_timeout,
        http_lane=args.http_lane,
        data_path=args.data_path,
    )


def specs_from_args(args: argparse.Namespace):
    from kvplug.frontend.config import check_unique, load_worker_config, parse_worker_flag

    specs = [parse_worker_flag(w, args.worker_engine) for w in args.worker]
    if args.worker_config:
        specs += load_worker_config(args.worker_config, args.worker_engine)
    check_unique(specs)
    return specs


async def _serve(args: argparse.Namespace, group=None) -> None:
    """One serving process; ``group`` (kvplug.frontend.supervisor.ProcessGroup) when it is
    one of ``--processes N``."""
    from kvplug.config import RouterConfig
    from kvplug.frontend.server import start_frontend
    from kvplug.frontend.tokens import LocalTokenizer
    from kvplug.router import Router

    settings = settings_from_args(args)
    specs = specs_from_args(args)
    router_config = RouterConfig.from_args(args)
    admin_port = args.admin_port if args.admin_port is not None else args.port + 1
    if group is None:  # else the supervisor has checked and holds the port
        _check_listen_ports(args, admin_port)  # before any worker is contacted
    if not specs:
        logging.getLogger("kvplug").warning(
            "no workers given: add them with --worker, --worker-config or the admin API"
        )
    tokenizer = (
        LocalTokenizer(args.tokenizer, prefix_cache_chunks=args.tokenizer_cache_chunks)
        if args.tokenizer
        else None
    )
    router = Router(router_config)
    peers = None
    if group is not None:
        from kvplug.frontend.peers import ProcessPeers

        peers = ProcessPeers(group.directory, group.index, group.count)
    running = await start_frontend(
        router,
        specs,
        settings,
        host=args.host,
        port=args.port,
        tokenizer=tokenizer,
        admin_token=args.admin_token,
        admin_host=args.admin_host,
        admin_port=admin_port,
        default_engine=args.worker_engine,
        peers=peers,
    )
    log = logging.getLogger("kvplug.serve")
    local_sync = None
    if peers is not None:
        from kvplug.local_sync import LocalLoadSync

        local_sync = LocalLoadSync(router, group.directory, group.index, group.count)
        try:
            await peers.start()
            await local_sync.start()
        except BaseException:
            await local_sync.close()
            await peers.close()
            await running.close()
            raise
    picker = None
    if args.epp_port is not None:
        try:
            from kvplug.frontend.epp import start_endpoint_picker

            picker = await start_endpoint_picker(running.frontend, args.epp_host, args.epp_port)
        except ImportError as exc:
            await running.close()
            raise ConfigError(f"--epp-port: {exc}") from None
        except BaseException:
            await running.close()
            raise
    sync = None
    if args.replica_sync:
        from kvplug.replica_sync import LoadSync

        sync = LoadSync(
            router, args.replica_sync, namespace=args.fleet_namespace, replica_id=args.replica_id
        )
        try:
            await sync.start()
        except ImportError as exc:
            await running.close()
            raise ConfigError(f"--replica-sync needs the replicas extra: {exc}") from None
        except Exception as exc:
            await running.close()
            raise ConfigError(f"--replica-sync: cannot reach {args.replica_sync}: {exc}") from None
    discovery = None
    if args.discovery:
        try:
            discovery = _discovery(args, running.frontend.fleet)
            await discovery.start()
        except (ImportError, ConnectionError, ConfigError, OSError) as exc:
            if sync is not None:
                await sync.close()
            await running.close()
            raise ConfigError(f"--discovery: {exc}") from None
    log.info(
        "kvplug serving the OpenAI API on %s (%d workers, %s data path)",
        ", ".join(running.bound),
        len(specs),
        "native" if running.native is not None else "python",
    )
    if running.admin_url:
        log.info("admin API on %s", ", ".join(running.admin_bound))
    else:
        log.info("admin API off (set --admin-token to enable it)")
    from kvplug.frontend.gc_tuning import tune_for_serving

    tune_for_serving()  # startup is done: fewer collector passes per request from here on
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # not on this platform
            pass
    if group is not None:
        if group.parent_sentinel is not None:  # the supervisor died: stop too
            loop.add_reader(group.parent_sentinel, stop.set)
        group.notify_ready()
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        if discovery is not None:
            await discovery.close()
        if sync is not None:
            await sync.close()
        if local_sync is not None:
            await local_sync.close()
        if peers is not None:
            await peers.close()
        if group is not None:
            group.leave()
        if picker is not None:
            await picker.close()
        await running.close()


def _discovery(args: argparse.Namespace, fleet):
    """etcd://HOST:PORT or kubernetes://NAMESPACE/SERVICE (kvplug.discovery)."""
    if args.discovery.startswith(("kubernetes://", "k8s://")):
        from kvplug.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery.from_url(fleet, args.discovery, args.worker_engine)
    from kvplug.discovery.etcd import EtcdDiscovery

    return EtcdDiscovery(
        fleet, args.discovery, namespace=args.fleet_namespace, default_engine=args.worker_engine
    )


def _check_listen_ports(args: argparse.Namespace, admin_port: int) -> None:
    from kvplug.cli import check_port, check_ports_free

    check_port(args.port, "--port", allow_zero=True)
    ports = [(args.port, "--port")]
    if args.admin_token:
        check_port(admin_port, "--admin-port", allow_zero=True)
        check_ports_free(args.host, ports)
        ports = [(admin_port, "--admin-port")]
        check_ports_free(args.admin_host, ports)
    else:
        check_ports_free(args.host, ports)


def _run_loop(coro, choice: str) -> None:
    factory = None
    if choice in ("auto", "uvloop"):
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("--event-loop uvloop: uvloop is not installed") from None
    if factory is None:
        asyncio.run(coro)
        return
    if hasattr(asyncio, "Runner"):  # Python >= 3.11
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(coro)
        return
    loop = factory()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(coro)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


_LOG_FORMAT = "%(asctime)s %(levelname)s {where}%(name)s: %(message)s"


def run(args: argparse.Namespace) -> int:
    if args.processes != 1:
        return _run_supervisor(args)
    logging.basicConfig(level=args.log_level.upper(), format=_LOG_FORMAT.format(where=""))
    return _run_serve(args, None)


def _run_supervisor(args: argparse.Namespace) -> int:
    from kvplug.frontend.supervisor import check_args, run_processes

    logging.basicConfig(
        level=args.log_level.upper(), format=_LOG_FORMAT.format(where="[supervisor] ")
    )
    try:
        check_args(args)
        return run_processes(args)
    except (ConfigError, UsageError) as exc:
        print(f"kvplug serve: error: {exc}", file=sys.stderr)
        return 2
    except (KvplugError, RunError, OSError) as exc:
        print(f"kvplug serve: error: {exc}", file=sys.stderr)
        return 1


def run_child(args: argparse.Namespace, group) -> int:
    """One process of ``--processes N`` (in the forked child); every log line names it."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format=_LOG_FORMAT.format(where=f"[p{group.index}/%(process)d] "),
        force=True,
    )
    return _run_serve(args, group)


def _run_serve(args: argparse.Namespace, group) -> int:
    who = "kvplug serve" if group is None else f"kvplug serve [p{group.index}]"
    try:
        _run_loop(_serve(args, group), args.event_loop)
    except (ConfigError, UsageError) as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 2
    except (KvplugError, RunError, OSError) as exc:  # a correct command that cannot run
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0

"""Every flag of ``sglang-router`` 0.3.2 and ``smg`` 1.13 (``python -m sglang_router.launch_router``
/ ``python -m smg.launch_router``), with how many values each takes and, for the ones kvplug's
launcher does not map, why they have no effect under kvplug.

The launcher (``launch_router.py``) declares all of them, so an sglang-router or smg command line
parses unchanged; ``MAPPED`` flags are translated, the others are accepted and reported (one
log line per reason). ``tests/test_sglang_launcher.py`` checks this table against both
packages' own argument parsers.
"""

from __future__ import annotations

# arity: how the flag consumes the command line (as upstream declares it)
FLAG = "flag"  # store_true
ONE = "one"  # one value
ANY = "*"  # zero or more values (smg extends across repeats)
SOME = "+"  # one or more values
PREFILL = "prefill"  # repeatable: URL [BOOTSTRAP_PORT|none]
DECODE = "decode"  # repeatable: URL
REPEAT = "repeat"  # repeatable, one value each
BOOL = "bool"  # --x / --no-x

# flags the launcher translates into kvplug serve arguments or worker entries
MAPPED: dict[str, str] = {
    "--host": ONE,
    "--port": ONE,
    "--worker-urls": ANY,
    "--policy": ONE,
    "--prefill-policy": ONE,
    "--decode-policy": ONE,
    "--pd-disaggregation": FLAG,
    "--prefill": PREFILL,
    "--decode": DECODE,
    "--dp-aware": FLAG,
    "--api-key": ONE,
    "--log-level": ONE,
    "--log-dir": ONE,
    "--prometheus-host": ONE,
    "--prometheus-port": ONE,
    "--request-timeout-secs": ONE,
    "--max-payload-size": ONE,
    "--disable-retries": FLAG,
    "--retry-max-retries": ONE,
    "--health-check-interval-secs": ONE,
    "--health-check-timeout-secs": ONE,
    "--disable-health-check": FLAG,
    "--model-path": ONE,
    "--model": ONE,
    "--tokenizer-path": ONE,
    "--block-size": ONE,
    "--backend": ONE,
    "--model-alias": REPEAT,
    "--worker-startup-timeout-secs": ONE,
    "--worker-startup-check-interval": ONE,
}

_TREE = (
    "tunes sglang-router's approximate prefix tree or its load-balancing heuristics; kvplug "
    "routes on the engines' real KV events and reported load"
)
_OVERLOAD = (
    "worker overload, warm-up and staleness heuristics; kvplug's cost model reads each "
    "engine's queue and KV usage"
)
_DISCOVERY = (
    "service discovery: give workers with --worker-urls / --prefill / --decode, or add and "
    "remove them at run time with kvplug's admin API"
)
_RETRY = (
    "retry back-off and circuit-breaker tuning: kvplug retries on another worker before the "
    "first byte (--retries) and takes a failing worker out until a health probe passes"
)
_HEALTH = "health-probe thresholds: kvplug marks a worker down on the first failed probe"
_QUEUE = (
    "router-side queueing and rate limiting: kvplug has an admission queue instead "
    "(kvplug serve --router-queue-threshold)"
)
_CONN = "client/upstream connection tuning: kvplug keeps aiohttp's defaults"
_TOKENIZER = (
    "router-side tokenizer cache and parsers: kvplug tokenizes for routing only (--tokenizer or "
    "the engine's /tokenize) and sends the client's body to the engine unchanged"
)
_GATEWAY = (
    "gateway features kvplug does not have (responses-API history, MCP, WASM, mesh, RL "
    "control, multimodal processing, tenants, control-plane auth)"
)
_TLS = "TLS: put kvplug behind a TLS-terminating proxy; engines are reached over plain HTTP"
_OBS = (
    "observability extras: kvplug serves Prometheus /metrics and per-request decision traces "
    "(GET /kvplug/decisions/ID)"
)
_MODES = "router modes kvplug does not run (IGW, mini load balancer, encode/EPD, sticky keys)"
_REQUEST_ID = "kvplug forwards the client's X-Request-Id (or makes one) to the engines"

# flag → (arity, why it has no effect under kvplug)
IGNORED: dict[str, tuple[str, str]] = {}


def _ignore(reason: str, **flags: str) -> None:
    for name, arity in flags.items():
        IGNORED["--" + name.replace("_", "-")] = (arity, reason)


_ignore(
    _TREE,
    cache_threshold=ONE,
    cache_match_threshold=ONE,
    balance_abs_threshold=ONE,
    spill_abs_threshold=ONE,
    balance_rel_threshold=ONE,
    spill_rel_threshold=ONE,
    balance_token_usage_threshold=ONE,
    overload_token_usage_threshold=ONE,
    bucket_adjust_interval_secs=ONE,
    eviction_interval_secs=ONE,
    max_tree_size=ONE,
    max_idle_secs=ONE,
    sticky_key_idle_secs=ONE,
    assignment_mode=ONE,
    prefix_token_count=ONE,
    prefix_hash_load_factor=ONE,
    prefix_hash_balance_abs_threshold=ONE,
    least_load_kv_pressure_weight=ONE,
    least_load_default_throughput=ONE,
    least_load_mean_prefill_tokens=ONE,
    least_load_max_waiting_requests=ONE,
    power_of_two_load_metric=ONE,
    kv_index=ONE,
    selection_policy=ONE,
    selection_accounting_ttl_ms=ONE,
    overlap_decay=ONE,
    selection_temperature=ONE,
    cache_boundaries=ONE,
    cache_index=ONE,
    cache_ttl_secs=ONE,
    dp_minimum_tokens_scheduler=FLAG,
    encode_policy=ONE,
)
_ignore(
    _OVERLOAD,
    worker_overload_waiting_requests=ONE,
    worker_overload_token_usage=ONE,
    worker_overload_protection=FLAG,
    disable_worker_overload_protection=FLAG,
    worker_overload_shed=FLAG,
    worker_stall_secs=ONE,
    worker_wedge_secs=ONE,
    worker_stale_secs=ONE,
    worker_warmup_secs=ONE,
    worker_warmup_share=ONE,
    worker_warmup_blocks=ONE,
    worker_warmup_thin_ratio=ONE,
    worker_warmup_divert_every=ONE,
    worker_startup_delay=ONE,
    load_monitor_interval=ONE,
    disable_load_monitoring=FLAG,
)
_ignore(
    _DISCOVERY,
    service_discovery=FLAG,
    discovery_provider=ONE,
    discovery_file=ONE,
    discovery_check_interval_secs=ONE,
    selector=SOME,
    service_discovery_port=ONE,
    service_discovery_namespace=ONE,
    kv_connector_annotation=ONE,
    kv_engine_id_annotation=ONE,
    encode_selector=SOME,
    prefill_selector=SOME,
    decode_selector=SOME,
    router_selector=SOME,
    model_id_from=ONE,
)
_ignore(
    _RETRY,
    retry_initial_backoff_ms=ONE,
    retry_max_backoff_ms=ONE,
    retry_backoff_multiplier=ONE,
    retry_jitter_factor=ONE,
    cb_failure_threshold=ONE,
    cb_success_threshold=ONE,
    cb_timeout_duration_secs=ONE,
    cb_window_duration_secs=ONE,
    disable_circuit_breaker=FLAG,
)
_ignore(
    _HEALTH,
    health_failure_threshold=ONE,
    health_success_threshold=ONE,
    health_check_endpoint=ONE,
    health_check_port=ONE,
    remove_unhealthy_workers=BOOL,
    worker_auto_recovery=BOOL,
)
_ignore(
    _QUEUE,
    max_concurrent_requests=ONE,
    queue_size=ONE,
    queue_timeout_secs=ONE,
    rate_limit_tokens_per_second=ONE,
    priority_scheduler_enabled=FLAG,
    priority_scheduler_default_max_class=ONE,
    priority_scheduler_config=ONE,
    priority_scheduler_tenant_metric_top_n=ONE,
    tenant_rate_limit_enabled=FLAG,
    tenant_rate_limit_config=ONE,
    prefill_max_inflight_requests_per_worker=ONE,
    prefill_queue_size=ONE,
    prefill_queue_timeout_secs=ONE,
    pd_admission_wait_secs=ONE,
    job_queue_capacity=ONE,
    job_queue_concurrency=ONE,
    max_background_responses=ONE,
)
_ignore(
    _CONN,
    upstream_http2=FLAG,
    upstream_pool_idle_timeout_secs=ONE,
    header_read_timeout_secs=ONE,
    idle_connection_timeout_secs=ONE,
    stream_body_stall_timeout_secs=ONE,
    sse_keepalive_secs=ONE,
    shutdown_grace_period_secs=ONE,
    max_buffered_request_bytes=ONE,
    cors_allowed_origins=ANY,
)
_ignore(
    _TOKENIZER,
    chat_template=ONE,
    disable_tokenizer_autoload=FLAG,
    parser=ONE,
    tokenizer_cache_enable_l0=FLAG,
    tokenizer_cache_l0_max_entries=ONE,
    tokenizer_cache_l0_max_memory=ONE,
    tokenizer_cache_enable_l1=FLAG,
    tokenizer_cache_l1_max_memory=ONE,
    reasoning_parser=ONE,
    tool_call_parser=ONE,
)
_ignore(
    _GATEWAY,
    mcp_config_path=ONE,
    zmq_engine_count=ONE,
    enable_wasm=FLAG,
    storage_hook_wasm_path=ONE,
    history_backend=ONE,
    history_memory_max_responses=ONE,
    history_memory_max_items=ONE,
    history_memory_retention_secs=ONE,
    oracle_wallet_path=ONE,
    oracle_tns_alias=ONE,
    oracle_connect_descriptor=ONE,
    oracle_username=ONE,
    oracle_password=ONE,
    oracle_external_auth=FLAG,
    oracle_pool_min=ONE,
    oracle_pool_max=ONE,
    oracle_pool_timeout_secs=ONE,
    postgres_db_url=ONE,
    postgres_pool_max=ONE,
    postgres_op_timeout_secs=ONE,
    redis_url=ONE,
    redis_pool_max=ONE,
    redis_retention_days=ONE,
    redis_op_timeout_secs=ONE,
    schema_config=ONE,
    enable_rl=FLAG,
    rl_control_timeout_secs=ONE,
    rl_fanout_concurrency=ONE,
    multimodal_tensor_transport=ONE,
    multimodal_shm_min_bytes=ONE,
    multimodal_max_inflight_bytes=ONE,
    mm_per_request_image_limit=ONE,
    mm_processing=ONE,
    mm_pixel_cache_mb=ONE,
    mm_pixel_rdma=FLAG,
    mm_allowed_media_domains=ONE,
    mm_allow_private_media_hosts=FLAG,
    rdma_listen_ip=ONE,
    rdma_slot_ttl_s=ONE,
    trust_tenant_header=FLAG,
    tenant_header_name=ONE,
    tenant_api_key=REPEAT,
    control_plane_api_keys=ANY,
    control_plane_audit_enabled=FLAG,
    jwt_issuer=ONE,
    jwt_audience=ONE,
    jwt_jwks_uri=ONE,
    jwt_role_mapping=ANY,
    enable_mesh=FLAG,
    mesh_server_name=ONE,
    mesh_host=ONE,
    mesh_advertise_host=ONE,
    mesh_port=ONE,
    mesh_peer_urls=ANY,
    mesh_tls_ca_cert=ONE,
    mesh_tls_cert=ONE,
    mesh_tls_key=ONE,
    storage_context_headers=ANY,
)
_ignore(
    _TLS,
    client_cert_path=ONE,
    client_key_path=ONE,
    ca_cert_paths=ANY,
    tls_cert_path=ONE,
    tls_key_path=ONE,
)
_ignore(
    _OBS,
    prometheus_duration_buckets=SOME,
    enable_trace=FLAG,
    otlp_traces_endpoint=ONE,
    log_json=FLAG,
    jemalloc_prof_dir=ONE,
    log_mm_timing=FLAG,
)
_ignore(
    _MODES,
    enable_igw=FLAG,
    mini_lb=FLAG,
    epd_disaggregation=FLAG,
    encode=PREFILL,
    routing_key_override=FLAG,
    sticky_sessions=FLAG,
    routing_key_headers=ANY,
)
_ignore(_REQUEST_ID, request_id_headers=ANY)

# the negative spellings of the --x/--no-x flags
BOOL_ALIASES = {
    "--remove-unhealthy-workers": "--no-remove-unhealthy-workers",
    "--worker-auto-recovery": "--no-worker-auto-recovery",
}

assert not MAPPED.keys() & IGNORED.keys()


def all_flags() -> set[str]:
    """Every option string the launcher accepts from sglang-router / smg."""
    return set(MAPPED) | set(IGNORED) | set(BOOL_ALIASES.values())

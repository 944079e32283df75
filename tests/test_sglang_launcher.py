"""The sglang-router / smg compatible launcher: flag translation into ``kvplug serve``, the
block size read from the workers, and the full flag lists of sglang-router 0.3.2 and smg 1.13
(their own argument parsers) accepted."""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import threading
import time

import pytest
import yaml
from aiohttp import web
from kvplug.integrations.sglang.launch_router import (
    apply_engine_dp_sizes,
    discover_block_size,
    read_server_infos,
    start_metrics_relay,
    translate,
)
from kvplug.integrations.sglang.metrics import dp_ranks_from_server_info
from kvplug.integrations.sglang.router_flags import IGNORED, MAPPED, all_flags

from kvplug.cli import build_parser
from kvplug.errors import ConfigError
from kvplug.frontend.config import load_worker_config
from kvplug.testing import free_port


@functools.cache
def _kvplug_parser():
    return build_parser()


def _serve_ok(launch, tmp_path):
    """kvplug serve's own parser accepts what the launcher produced."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(launch.workers))
    args = _kvplug_parser().parse_args(launch.serve + ["--worker-config", str(path)])
    return args, load_worker_config(path, "sglang")


def test_aggregated_workers_and_policy(tmp_path):
    launch = translate(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--worker-urls",
            "http://127.0.0.1:30001",
            "http://127.0.0.1:30002",
            "--policy",
            "round_robin",
            "--cache-threshold",
            "0.3",
            "--kv-block-size",
            "16",
        ]
    )
    assert launch.serve[:7] == [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--worker-engine",
        "sglang",
    ]
    assert launch.workers == {
        "workers": [
            {"url": "http://127.0.0.1:30001", "engine": "sglang"},
            {"url": "http://127.0.0.1:30002", "engine": "sglang"},
        ]
    }
    args, specs = _serve_ok(launch, tmp_path)
    assert args.router_mode == "round-robin" and args.port == 30000
    assert args.kv_block_size == 16
    assert [s.role for s in specs] == ["both", "both"]
    assert any("--cache-threshold" in n and "prefix tree" in n for n in launch.notes)


@pytest.mark.parametrize(
    ("policy", "mode"),
    [
        ("kvplug", "affinity"),
        ("cache_aware", "affinity"),
        ("prefix_hash", "affinity"),
        ("least_load", "least-loaded"),
        ("power_of_two", "power-of-two"),
        ("random", "random"),
        ("consistent_hashing", "affinity"),
    ],
)
def test_policies(policy, mode, tmp_path):
    launch = translate(["--worker-urls", "http://a:1", "--policy", policy, "--block-size", "1"])
    args, _ = _serve_ok(launch, tmp_path)
    assert args.router_mode == mode
    assert args.kv_block_size == 1  # smg's --block-size
    assert (policy == "consistent_hashing") == any(
        "no kvplug equivalent" in n for n in launch.notes
    )


def test_pd_flags_become_roles_and_bootstrap_ports(tmp_path):
    launch = translate(
        [
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000",
            "9000",
            "--prefill",
            "http://10.0.0.2:30000",
            "none",
            "--prefill",
            "http://10.0.0.5:30000",
            "--decode",
            "http://10.0.0.3:30000",
            "--decode",
            "http://10.0.0.4:30000",
            "--prefill-policy",
            "random",
            "--dp-aware",
        ]
    )
    args, specs = _serve_ok(launch, tmp_path)
    assert args.router_mode == "affinity"  # cache_aware: kvplug serve's default routing
    assert [(s.url, s.role) for s in specs] == [
        ("http://10.0.0.1:30000", "prefill"),
        ("http://10.0.0.2:30000", "prefill"),
        ("http://10.0.0.5:30000", "prefill"),
        ("http://10.0.0.3:30000", "decode"),
        ("http://10.0.0.4:30000", "decode"),
    ]
    assert [s.options.get("bootstrap_port", "-") for s in specs] == [9000, None, 8998, "-", "-"]
    assert all(s.options.get("dp_aware") for s in specs)
    assert any("policies" in n for n in launch.notes)


def test_mapped_serving_flags(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    launch = translate(
        [
            "--worker-urls",
            "http://a:1",
            "--api-key",
            "the-secret",
            "--log-level",
            "warn",
            "--request-timeout-secs",
            "30",
            "--max-payload-size",
            "1000",
            "--disable-retries",
            "--health-check-interval-secs",
            "7",
            "--health-check-timeout-secs",
            "3",
            "--tokenizer-path",
            str(tok),
            "--model-alias",
            "m1",
            "--model-alias",
            "m2",
            "--backend",
            "vllm",
            "--kv-block-size",
            "16",
        ]
    )
    args, specs = _serve_ok(launch, tmp_path)
    # sglang-router and smg guard their own API with --api-key and send it to the workers
    assert args.api_key == "the-secret" and args.engine_api_key == "the-secret"
    assert args.log_level == "warning"
    assert args.request_timeout == 30 and args.max_body_bytes == 1000 and args.retries == 0
    assert args.health_interval == 7 and args.health_timeout == 3
    assert args.tokenizer == str(tok)
    assert args.served_model_name == ["m1", "m2"]
    assert args.worker_engine == "vllm" and specs[0].engine == "vllm"
    off = translate(["--worker-urls", "http://a:1", "--disable-health-check", "--model", "Qwen/X"])
    args, _ = _serve_ok(off, tmp_path)
    assert args.health_interval == 0 and args.tokenizer is None
    assert any("not a local directory" in n for n in off.notes)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--pd-disaggregation", "--prefill", "http://a:1"], "at least one"),
        (["--prefill", "http://a:1"], "need --pd-disaggregation"),
        (
            ["--pd-disaggregation", "--prefill", "http://a:1", "port", "--decode", "http://b:1"],
            "not an integer",
        ),
        (
            ["--pd-disaggregation", "--prefill", "http://a:1", "1", "2", "--decode", "http://b:1"],
            "URL \\[BOOTSTRAP_PORT",
        ),
        (["--worker-urls", "http://a:1", "--log-level", "loud"], "--log-level"),
        (["--worker-urls", "http://a:1", "--request-timeout-secs", "soon"], "not an integer"),
    ],
)
def test_bad_values_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        translate(argv)


@pytest.mark.parametrize(
    "flavour",
    [
        ["--worker-urls", "http://a:1"],  # sglang-router 0.3.2
        ["--worker-urls", "http://a:1", "--tenant-api-key", "t1:k1"],  # smg 1.13 only
        ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"],
    ],
    ids=["sglang-router", "smg", "pd"],
)
def test_api_key_guards_kvplug_and_goes_to_the_engines(flavour, tmp_path, monkeypatch):
    monkeypatch.delenv("KVPLUG_ENGINE_API_KEY", raising=False)
    args, _ = _serve_ok(translate(flavour + ["--api-key", "K"]), tmp_path)
    assert args.api_key == "K" and args.engine_api_key == "K"
    # kvplug serve's own --engine-api-key wins for the engines; the client side stays guarded
    launch = translate(flavour + ["--api-key", "K", "--engine-api-key", "E"])
    args, _ = _serve_ok(launch, tmp_path)
    assert args.api_key == "K" and args.engine_api_key == "E" and launch.engine_api_key == "E"
    plain = translate(flavour)  # no key given: none asked of clients or sent to engines
    assert plain.engine_api_key is None and "--api-key" not in plain.serve
    assert "--engine-api-key" not in plain.serve


def test_explicit_kvplug_arguments_win():
    launch = translate(
        ["--worker-urls", "http://a:1", "--router-mode", "least-loaded", "--retries", "3"]
        + ["--retry-max-retries", "5"]
    )
    assert launch.serve.count("--router-mode") == 1 and "least-loaded" in launch.serve
    assert (
        launch.serve.count("--retries") == 1
        and launch.serve[launch.serve.index("--retries") + 1] == "3"
    )


# -- sglang-router's and smg's own argument parsers ------------------------------------------
UPSTREAM = {
    "sglang_router": "sglang_router.router_args",  # sglang-router 0.3.2
    "smg": "smg.router_args",  # smg 1.13
}


def upstream_parser(package: str) -> argparse.ArgumentParser:
    """The router's own parser, as its launch_router.parse_router_args builds it."""
    module = importlib.import_module(UPSTREAM[package])
    parser = argparse.ArgumentParser()
    module.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def upstream_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings]


def sample_argv(action: argparse.Action, flag: str) -> list[str]:
    """``flag`` with a value its upstream parser accepts."""
    if action.nargs == 0:
        return [flag]
    if flag in ("--prefill", "--encode"):
        return [flag, "http://p:1", "9000"]
    if flag == "--decode":
        return [flag, "http://d:1"]
    if action.choices:
        value = str(next(iter(action.choices)))
    elif action.type in (int, float) or getattr(action.type, "__name__", "") in (
        "_non_negative_int",
        "_parse_int_csv",
    ):
        value = "1"
    else:
        value = "x"
    return [flag, value]


@pytest.mark.parametrize("package", sorted(UPSTREAM))
def test_every_upstream_flag_is_mapped_or_accepted_with_a_reason(package, tmp_path):
    parser = upstream_parser(package)
    actions = upstream_actions(parser)
    flags = {flag for a in actions for flag in a.option_strings}
    assert flags <= all_flags(), f"not in router_flags.py: {sorted(flags - all_flags())}"
    base = ["--worker-urls", "http://w:1", "--kv-block-size", "16"]
    everything: list[str] = []
    for action in actions:
        for flag in action.option_strings:
            argv = sample_argv(action, flag)
            parser.parse_args(argv)  # the sample is a valid upstream command line
            extra = []
            if flag in ("--prefill", "--decode", "--pd-disaggregation"):
                extra = ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
            launch = translate(argv + extra + base)  # never raises: nothing is rejected
            _serve_ok(launch, tmp_path)  # nothing leaked into kvplug serve's arguments
            if flag in IGNORED:
                assert any(flag in n and ": " in n for n in launch.notes), (flag, launch.notes)
            else:
                assert flag in MAPPED or flag.startswith("--no-"), flag
            if flag not in ("--prefill", "--decode", "--encode", "--model-alias"):
                everything += argv
    # and the whole list at once
    launch = translate(
        everything + ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
    )
    _serve_ok(launch, tmp_path)


# -- the block size from the workers' /server_info -------------------------------------------
class FakeSglang:
    """``/server_info`` as SGLang answers it (server args echoed; ``kv_events`` on >= 0.5.20);
    with ``api_key``, 401 without ``Authorization: Bearer <api_key>`` (SGLang's --api-key)."""

    def __init__(self, info: dict | None, missing: bool = False, api_key: str | None = None):
        self.info = info
        self.missing = missing
        self.api_key = api_key
        self.authorizations: list[str | None] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        app = web.Application()

        async def server_info(request):
            self.authorizations.append(request.headers.get("Authorization"))
            if self.api_key is not None and (
                request.headers.get("Authorization") != f"Bearer {self.api_key}"
            ):
                raise web.HTTPUnauthorized()
            if self.missing:
                raise web.HTTPNotFound()
            return web.json_response(self.info)

        app.router.add_get("/server_info", server_info)
        app.router.add_get("/get_server_info", server_info)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(20)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_block_size_is_sglangs_default_page_size_1():
    with FakeSglang({"page_size": 1, "model_path": "m"}) as w:
        assert discover_block_size([w.url], timeout=20, interval=0.1) == 1


def test_kv_events_block_size_wins_and_workers_must_agree():
    kv = {"endpoint_port_base": 5557, "block_size": 32, "dp_size": 1, "topic": "kv"}
    with FakeSglang({"page_size": 16, "kv_events": kv}) as a, FakeSglang({"page_size": 32}) as b:
        assert discover_block_size([a.url, b.url], timeout=20, interval=0.1) == 32
    with FakeSglang({"page_size": 16}) as a, FakeSglang({"page_size": 64}) as b:
        with pytest.raises(ConfigError, match="different page sizes"):
            discover_block_size([a.url, b.url], timeout=20, interval=0.1)


def test_a_worker_without_server_info_leaves_kvplugs_default():
    with FakeSglang(None, missing=True) as w:
        assert discover_block_size([w.url], timeout=20, interval=0.1) is None


def test_no_worker_up_times_out_with_a_clear_error():
    with pytest.raises(ConfigError, match="--worker-startup-timeout-secs"):
        discover_block_size([f"http://127.0.0.1:{free_port()}"], timeout=0.3, interval=0.1)


# -- the DP ranks from the workers' /server_info ----------------------------------------------
def test_dp_ranks_from_server_info():
    kv = {"endpoint_port_base": 5557, "block_size": 16, "dp_size": 4}
    assert dp_ranks_from_server_info({"dp_size": 2, "kv_events": kv}) == 4  # kv_events first
    assert dp_ranks_from_server_info({"dp_size": 2}) == 2  # older builds, what smg reads
    # 0.5.23: --dp-size 2 --enable-dp-attention resolves to attn_dp_size 2, dp_size 1
    assert dp_ranks_from_server_info({"dp_size": 1, "attn_dp_size": 2}) == 2
    assert dp_ranks_from_server_info({"dp_size": 2, "attn_dp_size": None}) == 2
    for junk in ({}, {"dp_size": 0}, {"dp_size": "2"}, {"dp_size": True}, [], None):
        assert dp_ranks_from_server_info(junk) is None


def _pd_launch(prefill_url: str, decode_url: str, *extra: str):
    return translate(
        ["--pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url]
        + ["--kv-block-size", "16", *extra]
    )


def test_command_line_workers_get_the_engines_dp_size(tmp_path):
    two = {"page_size": 16, "dp_size": 2}
    with FakeSglang(two) as p, FakeSglang({"page_size": 16, "dp_size": 1}) as d:
        launch = _pd_launch(p.url, d.url, "--dp-aware")
        assert launch.dp_aware
        infos = read_server_infos(launch.worker_urls, 20, 0.1, wait_for_all=True)
        apply_engine_dp_sizes(launch, infos)
    _, specs = _serve_ok(launch, tmp_path)
    assert [(s.role, s.dp_size) for s in specs] == [("prefill", 2), ("decode", 1)]
    assert specs[0].to_worker().dp_ranks == range(2)
    with FakeSglang({"page_size": 16, "dp_size": 4096}) as w:
        launch = translate(["--worker-urls", w.url])
        with pytest.raises(ConfigError, match="at most 1024"):
            apply_engine_dp_sizes(launch, read_server_infos([w.url], 20, 0.1))


def test_dp_aware_waits_for_every_worker_and_the_others_take_one_pass():
    early = FakeSglang({"page_size": 16, "dp_size": 2})
    late = FakeSglang({"page_size": 16, "dp_size": 2})
    urls = [early.url, late.url]
    with early:
        # no --dp-aware and a given block size: one look, nobody waited for
        started = time.monotonic()
        assert set(read_server_infos(urls, 20, 0.1, require_answer=False)) == {early.url}
        assert time.monotonic() - started < 5
        # the block size wanted: the first pass in which someone answered
        assert set(read_server_infos(urls, 20, 0.1)) == {early.url}
        # --dp-aware: every worker, the late one included
        timer = threading.Timer(0.5, late.__enter__)
        timer.start()
        try:
            infos = read_server_infos(urls, 20, 0.1, wait_for_all=True, require_answer=False)
            assert set(infos) == {early.url, late.url}
        finally:
            timer.join()
            late.__exit__()
    # past the deadline: who answered; nobody is an error only when the block size is needed
    gone = f"http://127.0.0.1:{free_port()}"
    assert read_server_infos([gone], 0.3, 0.1, wait_for_all=True, require_answer=False) == {}
    with pytest.raises(ConfigError, match="--worker-startup-timeout-secs"):
        read_server_infos([gone], 0.3, 0.1, wait_for_all=True)


def test_server_info_is_asked_with_the_engine_key():
    with FakeSglang({"page_size": 16, "dp_size": 2}, api_key="K") as w:
        assert read_server_infos([w.url], 20, 0.1, api_key="K")[w.url]["dp_size"] == 2
        assert w.authorizations == ["Bearer K"]
        # refused: at once, naming the flag, not after the whole startup timeout
        for key, match in ((None, "give it with --api-key"), ("bad", "not the key")):
            started = time.monotonic()
            with pytest.raises(ConfigError, match=match):
                read_server_infos([w.url], 600, 0.1, api_key=key)
            assert time.monotonic() - started < 5


def test_metrics_relay_serves_the_api_ports_metrics():
    import urllib.error
    import urllib.request

    with FakeSglang({"page_size": 1}) as source:  # any HTTP source: relays its /server_info
        port = free_port()
        relay = start_metrics_relay("127.0.0.1", port, source.url + "/server_info")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200 and b'"page_size"' in r.read()
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
        finally:
            relay.shutdown()
            relay.server_close()
    with pytest.raises(ConfigError, match="prometheus"):
        busy = start_metrics_relay("127.0.0.1", 0, "http://127.0.0.1:1/metrics")
        try:
            start_metrics_relay("127.0.0.1", busy.server_address[1], "http://127.0.0.1:1/")
        finally:
            busy.shutdown()
            busy.server_close()

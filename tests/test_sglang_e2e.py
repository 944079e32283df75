"""End to end: the sglang-router compatible launcher (a real ``kvplug serve`` process) in front
of a prefill and a decode stub engine speaking SGLang's bootstrap handshake."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvplug.frontend.stub_engine import StubEngine, TransferBoard
from kvplug.testing import free_ports, stop_process, wait_ready_async

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
async def test_pd_request_through_the_launcher(tmp_path):
    board = TransferBoard()
    prefill = StubEngine("p", role="prefill", pd="sglang", board=board, block_size=16)
    decode = StubEngine("d", role="decode", pd="sglang", board=board, block_size=16)
    p_url, d_url = await prefill.start(), await decode.start()
    port, admin_port = free_ports(2)
    log = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvplug.integrations.sglang.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--pd-disaggregation",
            "--prefill",
            p_url,
            "none",
            "--decode",
            d_url,
            "--kv-block-size",
            "16",
            "--admin-port",
            str(admin_port),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        log_text = lambda: log.read_text()[-4000:]  # noqa: E731
        await wait_ready_async(base + "/health", proc=proc, timeout=60, interval=0.1, log=log)
        async with aiohttp.ClientSession() as session:
            body = {"model": "stub-model", "prompt": "hello sglang " * 4, "max_tokens": 4}
            async with session.post(base + "/v1/completions", json=body) as resp:
                text = await resp.text()
                assert resp.status == 200, (text, log_text())
        p_req = [r for r in prefill.requests if r["path"].endswith("/completions")]
        d_req = [r for r in decode.requests if r["path"].endswith("/completions")]
        assert len(p_req) == 1 and len(d_req) == 1, (p_req, d_req, log_text())
        pb, db = p_req[0]["body"], d_req[0]["body"]
        assert pb["bootstrap_room"] == db["bootstrap_room"]
        assert 0 <= pb["bootstrap_room"] < 2**63
        assert pb["bootstrap_host"] == db["bootstrap_host"] == "127.0.0.1"
        assert pb["bootstrap_port"] is None and "bootstrap_port" in db  # "--prefill URL none"
        assert board.pulled == 1  # the decode stub found its prefill partner
    finally:
        stop_process(proc, timeout=10, sig=signal.SIGTERM)
        await prefill.stop()
        await decode.stop()


@pytest.mark.timeout(120)
async def test_an_sglang_router_command_line_runs_unchanged(tmp_path):
    """sglang-router's own flags (no --kv-block-size: the block size comes from the engine's
    /server_info, SGLang's default page size 1), --api-key guarding kvplug's API as it guards
    sglang-router's and sent to the engines, metrics on --prometheus-port, a log file in
    --log-dir."""
    engine = StubEngine("w", block_size=1)

    async def server_info(request):
        return web.json_response({"page_size": 1, "model_path": "stub-model"})

    engine.app.router.add_get("/server_info", server_info)
    url = await engine.start()
    port, admin_port, prom_port = free_ports(3)
    log_dir = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stderr = tmp_path / "stderr"
    # the command line of sglang_router.launch_router, plus kvplug's --admin-port
    argv = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", url]
    argv += ["--policy", "cache_aware", "--api-key", "the-key", "--log-level", "info"]
    argv += ["--log-dir", str(log_dir), "--prometheus-port", str(prom_port)]
    argv += ["--prometheus-host", "127.0.0.1", "--request-timeout-secs", "60"]
    argv += ["--max-concurrent-requests", "64", "--disable-circuit-breaker"]
    argv += ["--health-check-interval-secs", "5", "--request-id-headers", "x-request-id"]
    argv += ["--worker-startup-timeout-secs", "30", "--admin-port", str(admin_port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplug.integrations.sglang.launch_router", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_ready_async(base + "/health", proc=proc, timeout=60, interval=0.1, log=stderr)
        async with aiohttp.ClientSession() as session:
            body = {"model": "stub-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2}
            # sglang-router 0.3.2 and smg 1.13 answer 401 here without the key (run for real)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with session.post(
                    base + "/v1/completions", json=body, headers=headers
                ) as resp:
                    assert resp.status == 401, (headers, await resp.text())
            async with session.get(base + "/v1/models") as resp:
                assert resp.status == 401
            async with session.get(base + "/health") as resp:
                assert resp.status == 200  # probes stay open, as sglang-router's
            auth = {"Authorization": "Bearer the-key"}
            async with session.post(base + "/v1/completions", json=body, headers=auth) as resp:
                assert resp.status == 200, (await resp.text(), stderr.read_text()[-3000:])
            async with session.get(f"http://127.0.0.1:{prom_port}/metrics") as resp:
                metrics = await resp.text()
                assert resp.status == 200 and "kvplug_" in metrics, metrics[:500]
        sent = [r for r in engine.requests if r["path"].endswith("/completions")]
        assert len(sent) == 1  # the refused requests never reached the engine
        assert sent[0]["headers"]["Authorization"] == "Bearer the-key"
        logged = (log_dir / "kvplug-router.log").read_text()
        assert "block size 1" in logged, logged[-3000:]
        assert "--max-concurrent-requests" in logged and "--disable-circuit-breaker" in logged
    finally:
        stop_process(proc, timeout=10, sig=signal.SIGTERM)
        await engine.stop()

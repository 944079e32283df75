"""benchmarks/bench_frontend.py and its instant engines: a short real run, and the engines'
HTTP answers (what the routers under test parse)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug.testing import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture
def instant_engine():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "instant_engine.py"), str(port), "--tokens", "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield port
    finally:
        stop_process(proc, timeout=5)


def _post(body: bytes, path: bytes = b"/v1/completions") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _read_answers(sock: socket.socket, n: int) -> list[tuple[bytes, bytes]]:
    """n answers off a kept-alive connection: (head, body), chunked bodies de-chunked."""
    buf = b""
    out = []
    while len(out) < n:
        data = sock.recv(65536)
        assert data, "engine closed the connection"
        buf += data
        while len(out) < n and b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            if b"transfer-encoding: chunked" in head.lower():
                body, pos = b"", 0
                while True:
                    eol = rest.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    size = int(rest[pos:eol], 16)
                    if len(rest) < eol + 2 + size + 2:
                        eol = -1
                        break
                    body += rest[eol + 2 : eol + 2 + size]
                    pos = eol + 2 + size + 2
                    if size == 0:
                        break
                if eol < 0 or size != 0:
                    break
                out.append((head, body))
                buf = rest[pos:]
            else:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(rest) < length:
                    break
                out.append((head, rest[:length]))
                buf = rest[length:]
    return out


def test_instant_engine_answers_pipelined_requests(instant_engine):
    plain = json.dumps({"model": "m", "prompt": [1, 2], "stream": False}).encode()
    streamed = json.dumps({"model": "m", "prompt": "a b", "stream": True}).encode()
    chat = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", instant_engine)) as sock:
        # three requests in one write, the last split mid-head: each answered, in order
        wire = _post(plain) + _post(streamed) + _post(chat, b"/v1/chat/completions")
        sock.sendall(wire[:-20])
        sock.sendall(wire[-20:])
        (h1, b1), (h2, b2), (h3, b3) = _read_answers(sock, 3)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        [(h4, b4)] = _read_answers(sock, 1)
    assert h1.startswith(b"HTTP/1.1 200") and json.loads(b1)["choices"][0]["text"] == " t0 t1 t2"
    events = [e[len(b"data: ") :] for e in b2.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and len(events) == 4
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
    assert b"text/event-stream" in h3 and b'"delta"' in b3 and b3.endswith(b"data: [DONE]\n\n")
    assert json.loads(b4)["data"][0]["id"] == "stub-model"


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (.ci/run)")
def test_bench_frontend_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_frontend.py"), "--quick", "--no-rust", "--floor"]
        + ["--processes", "2"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    targets = {t["target"]: t for t in results["targets"]}
    assert set(targets) == {
        "engine (direct)",
        "kvplug (text+tokenizer)",
        "kvplug (token ids)",
        "kvplug default routing (token ids)",
        "floor: kvplug's HTTP stacks + engine pool",
        "kvplug --processes 2 (text+tokenizer)",
        "kvplug --processes 2 (token ids)",
        "kvplug default routing --processes 2 (token ids)",
    }
    for t in targets.values():
        for mode in ("plain", "stream"):
            assert t[f"{mode}_throughput"]["requests_per_s"] > 0
            assert t[f"{mode}_throughput"]["cpu_ms_per_request"] > 0
            assert t[f"{mode}_latency"]["median_ms"] > 0
    # wrk is no bottleneck: under one core of CPU in every run, the engine's own included (a
    # share, not a throughput ratio, which other load on the machine moves: a CI run with two
    # benchmarks beside it saw the engine only 2.2x kvplug's requests/s against 3x otherwise)
    for t in targets.values():
        for mode in ("plain", "stream"):
            assert t[f"{mode}_throughput"]["wrk_cpu_share"] < 1.0, t
    assert "| kvplug (token ids) | streamed |" in proc.stdout

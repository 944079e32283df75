"""OpenAI-compatible engines that answer at once, for measuring routers, not engines.

A raw ``asyncio.Protocol`` on uvloop (no HTTP framework): it parses just enough HTTP/1.1 to find
each request's end (``Content-Length`` bodies, keep-alive, pipelining), answers
``POST /v1/completions`` and ``/v1/chat/completions`` with a fixed answer of ``--tokens``
tokens (one JSON document, or SSE events plus ``[DONE]`` in chunked encoding when the body asks
``"stream": true``), and the probes routers send (``/health``, ``/v1/models``, SGLang's
``/get_server_info`` / ``/get_model_info``, ``/metrics``). About 20 us of CPU per request here,
a tenth of an aiohttp server's, so a router in front of two of them is what the load generator
saturates.

    python benchmarks/instant_engine.py PORT [PORT ...] [--tokens 8]

Prints ``ready`` once every port listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

MODEL = "stub-model"
_STREAM = re.compile(rb'"stream"\s*:\s*true')


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def answers(tokens: int) -> dict[str, bytes]:
    """The fixed wire answers, built once."""
    usage = {"prompt_tokens": 512, "completion_tokens": tokens, "total_tokens": 512 + tokens}
    text = "".join(f" t{i}" for i in range(tokens))
    completion = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        "usage": usage,
    }
    chat = {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        ],
        "usage": usage,
    }

    def sse(chat_kind: bool) -> bytes:
        events = []
        for i in range(tokens):
            last = i == tokens - 1
            if chat_kind:
                choice = {"index": 0, "delta": {"content": f" t{i}"}}
            else:
                choice = {"index": 0, "text": f" t{i}"}
            choice["finish_reason"] = "length" if last else None
            event: dict = {
                "id": "cmpl-stub",
                "object": "chat.completion.chunk" if chat_kind else "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [choice],
            }
            if last:
                event["usage"] = usage
            events.append(b"data: " + json.dumps(event).encode() + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        return head + b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"

    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
    info = {"model_path": MODEL, "served_model_name": MODEL, "is_generation": True}
    return {
        "completions": _response("200 OK", json.dumps(completion).encode()),
        "chat": _response("200 OK", json.dumps(chat).encode()),
        "completions_stream": sse(False),
        "chat_stream": sse(True),
        "models": _response("200 OK", json.dumps(models).encode()),
        "ok": _response("200 OK", b'{"status":"ok"}'),
        "info": _response("200 OK", json.dumps(info).encode()),
        "metrics": _response("200 OK", b"", b"text/plain; version=0.0.4"),
        "not_found": _response("404 Not Found", b'{"error":"not found"}'),
        "bad": _response("400 Bad Request", b'{"error":"bad request"}'),
    }


class InstantEngine(asyncio.Protocol):
    def __init__(self, wire: dict[str, bytes]) -> None:
        self.wire = wire
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : stop if stop >= 0 else None])
            if b"transfer-encoding: chunked" in lower:  # nobody sends it here; refuse plainly
                out.append(self.wire["bad"])
                self.buf = b""
                break
            if len(self.buf) < end + 4 + length:
                break
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            out.append(self._answer(head, body))
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _answer(self, head: bytes, body: bytes) -> bytes:
        line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
        parts = line.split(b" ")
        path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
        w = self.wire
        if path == b"/v1/completions":
            return w["completions_stream"] if _STREAM.search(body) else w["completions"]
        if path == b"/v1/chat/completions":
            return w["chat_stream"] if _STREAM.search(body) else w["chat"]
        if path == b"/v1/models":
            return w["models"]
        if path in (b"/health", b"/health_generate", b"/readiness", b"/liveness"):
            return w["ok"]
        if path in (b"/get_server_info", b"/get_model_info", b"/server_info", b"/model_info"):
            return w["info"]
        if path == b"/metrics":
            return w["metrics"]
        return w["not_found"]


async def serve(ports: list[int], tokens: int) -> None:
    loop = asyncio.get_running_loop()
    wire = answers(tokens)
    servers = [
        await loop.create_server(
            lambda: InstantEngine(wire), "127.0.0.1", port, reuse_address=True, backlog=1024
        )
        for port in ports
    ]
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for s in servers:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ports", type=int, nargs="+")
    ap.add_argument("--tokens", type=int, default=8, help="tokens (SSE events) per answer")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.ports, args.tokens))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

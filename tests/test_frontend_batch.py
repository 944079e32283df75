"""Batched completions (``prompt`` as a list): one routed sub-request per prompt, merged into
what one engine answers for the batch. Stub engines on loopback, a real Router, real HTTP.

The reference answer is the same batch sent straight to one stub engine, which answers batches
as vLLM does (choice ``j`` of prompt ``i`` is index ``i * n + j``, usage summed); with
``tag_text`` each choice's text names its prompt and choice, so a misplaced choice shows.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

import pytest
from test_frontend_harness import MODEL, eventually, prompt, serving

from kvplug.frontend.app import ServeSettings

pytestmark = pytest.mark.timeout(60)

TAGGED = {"tag_text": True}


def sse_payloads(raw: bytes) -> list[str]:
    return [
        line[5:].strip()
        for block in raw.decode().split("\n\n")
        for line in block.split("\n")
        if line.startswith("data:")
    ]


def without_ids(obj: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(out.get("usage"), dict):  # cached tokens depend on each engine's cache
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


async def seed(h, prompts_by_worker: dict[str, list[int]]) -> None:
    """Put each prompt's blocks in its worker's cache (pinned single requests)."""
    for worker, p in prompts_by_worker.items():
        resp, raw = await h.complete(p, headers={"x-kvplug-worker": worker})
        assert resp.status == 200, raw
    h.assert_idle()


async def direct(h, worker: str, body: dict) -> tuple[int, bytes]:
    async with h.session.post(h.engines[worker].url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def test_prompts_are_routed_to_the_engines_holding_their_prefixes():
    async with serving(3) as h:
        a, b = prompt(6, 1), prompt(6, 2)
        await seed(h, {"w0": a, "w2": b})
        batch = [a + prompt(1, 7), b + prompt(1, 8)]
        resp, raw = await h.complete(batch, max_tokens=3)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "w0,w2"
        assert resp.headers["x-kvplug-dp-rank"] == "0,0"
        ids = resp.headers["x-kvplug-decision-id"].split(",")
        assert len(ids) == 2 and len(set(ids)) == 2
        rid = resp.headers["X-Request-Id"]
        for i, (decision_id, worker) in enumerate(zip(ids, ("w0", "w2"), strict=True)):
            trace = await h.trace(decision_id)
            assert trace["worker_id"] == worker and trace["outcome"] == "ok"
            assert trace["batch"] == {"request_id": rid, "prompt_index": i, "size": 2}
            assert trace["request_id"] == f"{rid}-{i}"
            assert trace["tokens"] == {"source": "request", "count": len(batch[i]), "note": None}
            assert trace["router"]["overlap_blocks"] == 6
            assert trace["output_tokens"] == 3
        # each engine got exactly its own prompt, as a single-prompt request
        assert h.engines["w0"].requests[-1]["body"]["prompt"] == batch[0]
        assert h.engines["w2"].requests[-1]["body"]["prompt"] == batch[1]
        assert h.engines["w2"].requests[-1]["headers"]["X-Request-Id"] == f"{rid}-1"
        assert len(h.engines["w1"].requests) == 0
        h.assert_idle()


async def test_text_prompts_are_tokenized_and_routed_one_by_one():
    async with serving(2) as h:
        texts = ["x" * 64 + "first", "y" * 64 + "second"]
        await seed(h, {"w1": [ord(c) for c in "x" * 64], "w0": [ord(c) for c in "y" * 64]})
        resp, raw = await h.complete(texts, max_tokens=2)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "w1,w0"  # the engines' /tokenize
        assert h.engines["w1"].requests[-1]["body"]["prompt"] == texts[0]
        h.assert_idle()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", ["ids", "text"])
async def test_merged_answer_is_what_one_engine_answers_for_the_batch(n, kind):
    async with serving(3, stub_options=TAGGED) as h:
        seeds = [prompt(4, s) for s in (1, 2, 3)]
        await seed(h, {"w2": seeds[0], "w0": seeds[1], "w1": seeds[2]})
        batch: list[Any] = [s + prompt(1, 10 + i) for i, s in enumerate(seeds)]
        if kind == "text":
            batch = ["".join(chr(0x4E00 + t % 1000) for t in p) for p in batch]
        body = {"model": MODEL, "prompt": batch, "max_tokens": 3, "n": n}
        resp, raw = await h.post("/v1/completions", body)
        assert resp.status == 200, raw
        if kind == "ids":
            assert resp.headers["x-kvplug-worker"] == "w2,w0,w1"
        merged = json.loads(raw)
        status, ref_raw = await direct(h, "w1", body)
        assert status == 200
        reference = json.loads(ref_raw)
        assert without_ids(merged) == without_ids(reference)
        assert [c["index"] for c in merged["choices"]] == list(range(3 * n))
        # every choice answers its own prompt: the tag is (first token, length, choice)
        for c in merged["choices"]:
            i, j = divmod(c["index"], n)
            tokens = batch[i] if kind == "ids" else [ord(ch) for ch in batch[i]]
            assert c["text"].split()[0] == f"t0@{tokens[0]}/{len(tokens)}/{j}"
        lens = [len(p) for p in batch]
        assert merged["usage"]["prompt_tokens"] == sum(lens)
        assert merged["usage"]["completion_tokens"] == 3 * 3 * n
        assert merged["usage"]["total_tokens"] == sum(lens) + 9 * n
        assert merged["id"] == f"cmpl-{resp.headers['X-Request-Id']}"
        h.assert_idle()


@pytest.mark.parametrize("n", [1, 2])
async def test_merged_stream_is_what_one_engine_streams_for_the_batch(n):
    async with serving(2, stub_options={**TAGGED, "token_delay": 0.01}) as h:
        a, b = prompt(4, 1), prompt(4, 2)
        await seed(h, {"w1": a, "w0": b})
        body = {
            "model": MODEL,
            "prompt": [a + prompt(1, 5), b + prompt(1, 6)],
            "max_tokens": 5,
            "n": n,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        resp, raw = await h.post("/v1/completions", body)
        assert resp.status == 200, raw
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-kvplug-worker"] == "w1,w0"
        status, ref_raw = await direct(h, "w1", body)
        assert status == 200
        got, ref = sse_payloads(raw), sse_payloads(ref_raw)
        assert got.count("[DONE]") == 1 and got[-1] == "[DONE]" and ref[-1] == "[DONE]"
        got_chunks = [json.loads(p) for p in got[:-1]]
        ref_chunks = [json.loads(p) for p in ref[:-1]]
        assert len({c["id"] for c in got_chunks}) == 1
        assert len({c["created"] for c in got_chunks}) == 1
        # the usage chunk comes last, once, summed
        assert without_ids(got_chunks[-1]) == without_ids(ref_chunks[-1])
        assert got_chunks[-1]["choices"] == []
        assert got_chunks[-1]["usage"]["completion_tokens"] == 2 * 5 * n
        assert got_chunks[-1]["usage"]["prompt_tokens"] == 2 * (4 + 1) * 16

        def by_index(chunks):
            out = defaultdict(list)
            for c in chunks:
                assert len(c["choices"]) == 1
                out[c["choices"][0]["index"]].append(without_ids(c))
            return dict(out)

        assert sorted(by_index(got_chunks[:-1])) == list(range(2 * n))
        assert by_index(got_chunks[:-1]) == by_index(ref_chunks[:-1])
        h.assert_idle()
        traces = [await h.trace(d) for d in resp.headers["x-kvplug-decision-id"].split(",")]
        assert [t["output_tokens"] for t in traces] == [5 * n, 5 * n]
        assert all(t["outcome"] == "ok" for t in traces)


async def test_a_batch_of_one_is_a_single_prompt():
    async with serving(2) as h:
        p = prompt(3, 4)
        resp, raw = await h.complete([p], max_tokens=2, headers={"X-Request-Id": "one"})
        assert resp.status == 200
        assert "," not in resp.headers["x-kvplug-worker"]
        engine = h.engines[resp.headers["x-kvplug-worker"]]
        assert engine.requests[-1]["body"]["prompt"] == [p]  # the client's body, unchanged
        assert raw == engine.sent["one"]  # the engine's bytes
        h.assert_idle()


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_error_on_one_prompt_fails_the_batch_and_releases_all(stream):
    async with serving(2, stub_options={"token_delay": 0.05}) as h:
        a, b = prompt(4, 1), prompt(4, 2)
        await seed(h, {"w0": a, "w1": b})
        h.engines["w1"].fail = "http400"
        resp, raw = await h.complete(
            [a + prompt(1, 3), b + prompt(1, 4)], stream=stream, max_tokens=100
        )
        assert resp.status == 400, raw
        assert json.loads(raw)["error"]["message"] == "stub engine refuses this request"
        assert resp.headers["x-kvplug-worker"] == "w1"
        assert resp.headers["x-kvplug-batch-failed-prompt"] == "1"
        h.assert_idle()  # prompt 0 (100 tokens at 50 ms each on w0) was cancelled
        rid = resp.headers["X-Request-Id"]
        records = [r for r in h.frontend.decisions._records.values() if r.request_id == f"{rid}-0"]
        assert len(records) == 1 and records[0].outcome == "cancelled"
        failed = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert failed["outcome"] == "engine_error" and failed["status"] == 400


async def test_unroutable_prompt_fails_the_batch_cleanly():
    async with serving(2) as h:
        await h.engines["w0"].stop()
        await h.engines["w1"].stop()  # every engine refuses: 502 after the retry, or 503
        resp, raw = await h.complete([prompt(1, 1), prompt(1, 2)])  # when none is left
        assert resp.status in (502, 503), raw
        assert "of the batch" in json.loads(raw)["error"]["message"]
        assert resp.headers["x-kvplug-batch-failed-prompt"] in ("0", "1")
        h.assert_idle()


async def test_a_stream_that_breaks_mid_batch_ends_with_an_error_and_releases_all():
    async with serving(2, stub_options={"token_delay": 0.02}) as h:
        a, b = prompt(4, 1), prompt(4, 2)
        await seed(h, {"w0": a, "w1": b})
        h.engines["w1"].fail = "midstream"
        resp, raw = await h.complete(
            [a + prompt(1, 3), b + prompt(1, 4)], stream=True, max_tokens=50
        )
        assert resp.status == 200
        payloads = sse_payloads(raw)
        assert "[DONE]" not in payloads
        assert "failed mid-stream on prompt 1" in json.loads(payloads[-1])["error"]["message"]
        h.assert_idle()


async def test_an_engine_error_event_mid_stream_is_passed_on_then_done():
    async with serving(2) as h:
        a, b = prompt(4, 1), prompt(4, 2)
        await seed(h, {"w0": a, "w1": b})
        engine = h.engines["w1"]
        original = engine._stream

        async def erroring(request, body, *args, **kwargs):  # vLLM's streamed error shape
            from aiohttp import web

            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            err = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        engine._stream = erroring  # type: ignore[method-assign]
        try:
            resp, raw = await h.complete([a, b], stream=True, max_tokens=4)
        finally:
            engine._stream = original  # type: ignore[method-assign]
        payloads = sse_payloads(raw)
        assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
        assert {"error": {"message": "boom", "type": "InternalServerError", "code": 500}} in [
            json.loads(p) for p in payloads[:-1]
        ]
        h.assert_idle()


async def test_client_disconnect_mid_batch_stream_releases_everything():
    async with serving(2, stub_options={"token_delay": 0.05}) as h:
        a, b = prompt(4, 1), prompt(4, 2)
        await seed(h, {"w0": a, "w1": b})
        body = {"model": MODEL, "prompt": [a, b], "stream": True, "max_tokens": 400}
        async with h.session.post(h.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvplug-worker"] == "w0,w1"
            await resp.content.readany()
            assert h.router.stats()["active_requests"] == 2
        await eventually(lambda: h.router.stats()["active_requests"] == 0)
        h.assert_idle()
        # the engines stopped generating (400 tokens take them 20 s): their connections closed
        await eventually(lambda: h.engines["w0"].running == 0 and h.engines["w1"].running == 0)


async def test_batch_size_cap():
    settings = ServeSettings(max_batch_prompts=2, health_interval=0.2)
    async with serving(2, settings=settings) as h:
        resp, raw = await h.complete([prompt(1, 1), prompt(1, 2), prompt(1, 3)])
        assert resp.status == 400
        err = json.loads(raw)["error"]
        assert err["code"] == "batch_too_large" and "--max-batch-prompts" in err["message"]
        assert not h.engines["w0"].requests and not h.engines["w1"].requests
        resp, raw = await h.complete([prompt(1, 1), prompt(1, 2)])
        assert resp.status == 200, raw
        h.assert_idle()


async def test_per_prompt_token_limit_and_bad_ids():
    settings = ServeSettings(max_prompt_tokens=32, health_interval=0.2)
    async with serving(1, settings=settings) as h:
        resp, raw = await h.complete([prompt(1, 1), prompt(3, 2)])
        assert resp.status == 400
        assert "prompt[1]" in json.loads(raw)["error"]["message"]
        resp, raw = await h.complete([[1, 2], [3, -4]])
        assert resp.status == 400 and json.loads(raw)["error"]["param"] == "prompt[1]"
        assert not h.engines["w0"].requests
        h.assert_idle()


async def test_disaggregated_fleets_keep_a_batch_whole():
    """P/D fleets: the batch goes through both stages as one request, routed on its first
    prompt (docs/frontend.md), as before per-prompt splitting existed."""
    pd = [{"id": "p0", "role": "prefill"}, {"id": "d0", "role": "decode"}]
    async with serving(pd) as h:
        batch = [prompt(2, 1), prompt(2, 2)]
        resp, raw = await h.complete(batch, max_tokens=3)
        assert resp.status == 200, raw
        assert resp.headers["x-kvplug-worker"] == "d0"
        assert resp.headers["x-kvplug-prefill-worker"] == "p0"
        assert h.engines["d0"].requests[-1]["body"]["prompt"] == batch
        assert [c["index"] for c in json.loads(raw)["choices"]] == [0, 1]
        trace = await h.trace(resp.headers["x-kvplug-decision-id"])
        assert trace["batch"] is None and trace["tokens"]["count"] == len(batch[0])
        h.assert_idle()


async def test_concurrent_batches_with_hang_ups_and_failures_leave_no_load():
    async with serving(3, stub_options={"token_delay": 0.01}) as h:
        h.engines["w2"].fail = "http500"

        async def one(k: int) -> None:
            batch = [prompt(2, 100 + 3 * k + i) for i in range(3)]
            body = {"model": MODEL, "prompt": batch, "stream": k % 2 == 0, "max_tokens": 20}
            async with h.session.post(h.url + "/v1/completions", json=body) as resp:
                if k % 3 == 0:
                    await resp.content.readany()  # hang up early
                    return
                raw = await resp.read()
                workers = resp.headers.get("x-kvplug-worker", "")
                assert resp.status in (200, 500), raw
                assert (resp.status == 500) == ("w2" in workers.split(",")), workers

        await asyncio.gather(*(one(k) for k in range(24)))
        await eventually(lambda: h.router.stats()["active_requests"] == 0)
        h.assert_idle()

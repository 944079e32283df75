"""Frontend pieces that need no HTTP: parsing, hints, worker specs, tokens, SSE counting,
adapters, the decision store."""

from __future__ import annotations

import json

import pytest

from kvplug import adapters
from kvplug.adapters import PDContext, PDProtocolError, PDStyle, create_adapter
from kvplug.errors import ConfigError
from kvplug.frontend.config import (
    check_unique,
    load_worker_config,
    parse_worker_flag,
    spec_from_mapping,
)
from kvplug.frontend.decisions import DecisionStore
from kvplug.frontend.errors import ApiError
from kvplug.frontend.hints import NO_HINTS, hints_from_request
from kvplug.frontend.parsing import CHAT, COMPLETIONS, parse_request
from kvplug.frontend.streaming import SseCounter, completion_tokens
from kvplug.frontend.tokens import LocalTokenizer, TokenResolver
from kvplug.workers import Worker


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


# -- parsing ------------------------------------------------------------------------------


def test_parse_completion_text_and_ids():
    r = parse_request(body(model="m", prompt="hello"), COMPLETIONS)
    assert r.prompt_text == "hello" and r.prompt_ids is None and not r.stream
    r = parse_request(body(model="m", prompt=[1, 2, 3], stream=True), COMPLETIONS)
    assert list(r.prompt_ids) == [1, 2, 3] and r.stream
    raw = body(model="m", prompt=[1, 2, 3])
    assert parse_request(raw, COMPLETIONS).raw is raw  # forwarded unchanged


def test_parse_batches_keep_every_prompt():
    r = parse_request(body(model="m", prompt=["a", "b"]), COMPLETIONS)
    assert r.prompt_text == "a" and r.batch_size == 2 and r.prompts == ["a", "b"]
    r = parse_request(body(model="m", prompt=[[5, 6], [7]]), COMPLETIONS)
    assert r.prompt_ids == [5, 6] and r.prompts == [[5, 6], [7]]
    r = parse_request(body(model="m", prompt=[[5, 6]]), COMPLETIONS)  # a batch of one
    assert r.prompt_ids == [5, 6] and r.batch_size == 1 and r.prompts is None


@pytest.mark.parametrize(
    "raw, path, code",
    [
        (b"", COMPLETIONS, "invalid_json"),
        (b"{not json", COMPLETIONS, "invalid_json"),
        (b"[1, 2]", COMPLETIONS, "invalid_json"),
        (body(prompt="x"), COMPLETIONS, "missing_field"),
        (body(model="m"), COMPLETIONS, "missing_field"),
        (body(model="m", prompt=[]), COMPLETIONS, "invalid_request"),
        (body(model="m", prompt=[1, -1]), COMPLETIONS, "invalid_prompt"),
        (body(model="m", prompt=[1, 2**32]), COMPLETIONS, "invalid_prompt"),
        (body(model="m", prompt=[1, True]), COMPLETIONS, "invalid_prompt"),
        (body(model="m", prompt=[1, "a"]), COMPLETIONS, "invalid_prompt"),
        (body(model="m", prompt=[1.5, 2]), COMPLETIONS, "invalid_request"),
        (body(model="m", prompt=[[1], []]), COMPLETIONS, "invalid_request"),
        (body(model="m", prompt=["a", 1]), COMPLETIONS, "invalid_request"),
        (body(model="m", prompt="x", stream="yes"), COMPLETIONS, "invalid_request"),
        (body(model="m"), CHAT, "missing_field"),
        (body(model="m", messages=[]), CHAT, "missing_field"),
        (body(model="m", messages=[{"content": "x"}]), CHAT, "invalid_request"),
        (body(model="m", prompt="x", nvext=[1]), COMPLETIONS, "invalid_request"),
        (
            body(model="m", prompt="x", nvext={"token_data": [1, "a"]}),
            COMPLETIONS,
            "invalid_prompt",
        ),
    ],
)
def test_parse_rejects(raw, path, code):
    with pytest.raises(ApiError) as exc:
        parse_request(raw, path)
    assert exc.value.status == 400 and exc.value.code == code
    err = exc.value.body()["error"]
    assert set(err) >= {"message", "type", "code"} and err["type"] == "invalid_request_error"


def test_nvext_is_stripped_and_token_data_used():
    r = parse_request(body(model="m", prompt="x", nvext={"token_data": [9, 8]}), COMPLETIONS)
    assert r.prompt_ids == [9, 8]
    assert json.loads(r.raw) == {"model": "m", "prompt": "x"}


# -- hints --------------------------------------------------------------------------------


def test_hints_from_nvext_and_headers():
    assert hints_from_request(None, {}) is NO_HINTS
    h = hints_from_request(
        {
            "backend_instance_id": 7,
            "prefill_worker_id": "p1",
            "dp_rank": 2,
            "allowed_worker_ids": ["a", "b"],
            "agent_hints": {"osl": 100},
            "labels": {"k": "v"},
        },
        {},
    )
    assert (h.worker_id, h.prefill_worker_id, h.dp_rank, h.expected_osl) == ("7", "p1", 2, 100)
    assert h.allowed_worker_ids == frozenset({"a", "b"}) and h.labels == {"k": "v"}
    # headers win over nvext
    h = hints_from_request(
        {"backend_instance_id": "x"},
        {"x-worker-instance-id": "y", "x-dynamo-dp-rank": "1", "x-kvplug-allowed-workers": "y, z"},
    )
    assert h.worker_id == "y" and h.dp_rank == 1 and h.allowed_worker_ids == {"y", "z"}
    assert hints_from_request({"decode_worker_id": "d"}, {}).worker_id == "d"


@pytest.mark.parametrize(
    "nvext, headers",
    [
        ({"dp_rank": -1}, {}),
        ({"dp_rank": "x"}, {}),
        ({}, {"x-dynamo-dp-rank": "abc"}),
        ({"allowed_worker_ids": "a"}, {}),
        ({"agent_hints": {"osl": 0}}, {}),
        ({"agent_hints": 3}, {}),
        ({"labels": {"a": 1}}, {}),
        ({"backend_instance_id": True}, {}),
    ],
)
def test_bad_hints_are_400(nvext, headers):
    with pytest.raises(ApiError) as exc:
        hints_from_request(nvext, headers)
    assert exc.value.status == 400


# -- worker specs ---------------------------------------------------------------------------


def test_worker_flag_and_yaml(tmp_path):
    s = parse_worker_flag("http://127.0.0.1:8100")
    assert s.worker_id == "127.0.0.1:8100" and s.engine == "vllm" and s.role == "both"
    s = parse_worker_flag("w1=localhost:9000/", "openai")
    assert (s.worker_id, s.url, s.engine) == ("w1", "http://localhost:9000", "openai")
    cfg = tmp_path / "workers.yaml"
    cfg.write_text(
        "workers:\n"
        "  - {id: p0, url: 'http://h:1', role: prefill, engine: vllm, dp_size: 2,\n"
        "     labels: {tier: 1}, taints: [spot], event_endpoint: 'tcp://h:5557',\n"
        "     replay_endpoint: 'tcp://h:5558', metrics_url: 'http://h:1/metrics',\n"
        "     models: m, options: {bootstrap_port: 8998}, device: cpu,\n"
        "     long_prefill_token_threshold: 2048, long_prefill_token_threshold_adaptive: true}\n"
        "  - url: 'http://h:2'\n"
    )
    p0, d = load_worker_config(cfg)
    assert p0.role == "prefill" and p0.dp_size == 2 and p0.labels == {"tier": "1"}
    assert p0.models == ["m"] and p0.options == {"bootstrap_port": 8998}
    w = p0.to_worker()
    assert isinstance(w, Worker) and w.taints == frozenset({"spot"}) and w.dp_size == 2
    assert w.event_endpoint == "tcp://h:5557" and w.device == "cpu"
    assert w.long_prefill_token_threshold == 2048 and p0.to_dict()["long_prefill_token_threshold"]
    assert w.long_prefill_token_threshold_adaptive
    assert p0.to_dict()["long_prefill_token_threshold_adaptive"] is True
    assert d.worker_id == "h:2" and d.to_worker().long_prefill_token_threshold == 0
    assert not d.to_worker().long_prefill_token_threshold_adaptive
    check_unique([p0, d])
    with pytest.raises(ConfigError, match="twice"):
        check_unique([p0, p0])


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"url": "ftp://x:1"}, "http"),
        ({}, "url"),
        ({"url": "http://h:1", "role": "x"}, "role"),
        ({"url": "http://h:1", "dp_size": 0}, "dp_size"),
        ({"url": "http://h:1", "bogus": 1}, "unknown"),
        ({"url": "http://h:1", "taints": "a"}, "taints"),
        ({"url": "http://h:99999"}, "port"),
        ({"url": "http://h:1", "long_prefill_token_threshold": -1}, "long_prefill_token"),
        ({"url": "http://h:1", "long_prefill_token_threshold": "x"}, "long_prefill_token"),
        ({"url": "http://h:1", "long_prefill_token_threshold_adaptive": "yes"}, "true or false"),
    ],
)
def test_bad_worker_specs(entry, match):
    with pytest.raises(ConfigError, match=match):
        spec_from_mapping(entry, "test")


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("workers: {a: 1}")
    with pytest.raises(ConfigError, match="list of workers"):
        load_worker_config(f)
    with pytest.raises(ConfigError, match="No such file"):
        load_worker_config(tmp_path / "missing.yaml")


# -- tokens ---------------------------------------------------------------------------------


def make_tokenizer_dir(path, with_template=True):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "hello", "world", "user", "assistant", "system", ":", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if with_template:
        config["chat_template"] = (
            "{{ bos_token }} {% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
        )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_local_tokenizer_and_chat_template(tmp_path):
    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    assert tok.encode("hello world") == [3, 4]
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<s> user : hi assistant :"
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [0, 5, 8, 9, 6, 8]


def test_chat_template_file_wins(tmp_path):
    make_tokenizer_dir(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert LocalTokenizer(tmp_path).encode_chat([{"role": "user", "content": "hello"}]) == [3]


def test_tokenizer_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        LocalTokenizer(tmp_path / "nope")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError):
        LocalTokenizer(tmp_path)  # no tokenizer.json (and no transformers)


async def test_token_resolver_order(tmp_path):
    tok = LocalTokenizer(make_tokenizer_dir(tmp_path))
    calls = []

    async def engine(req):
        calls.append(req)
        return [42]

    resolver = TokenResolver(tok, engine)
    ids, src, _ = await resolver.resolve(parse_request(body(model="m", prompt=[7]), COMPLETIONS))
    assert (ids, src) == ([7], "request")
    ids, src, _ = await resolver.resolve(
        parse_request(body(model="m", prompt="hello"), COMPLETIONS)
    )
    assert (ids, src) == ([3], "tokenizer")
    # no chat template: the engine is asked
    (tmp_path / "plain").mkdir()
    no_tpl = LocalTokenizer(make_tokenizer_dir(tmp_path / "plain", with_template=False))
    resolver = TokenResolver(no_tpl, engine)
    ids, src, note = await resolver.resolve(
        parse_request(body(model="m", messages=[{"role": "user", "content": "hi"}]), CHAT)
    )
    assert (ids, src) == ([42], "engine") and "chat template" in note

    async def broken(req):
        raise RuntimeError("down")

    ids, src, note = await TokenResolver(None, broken).resolve(
        parse_request(body(model="m", prompt="hello"), COMPLETIONS)
    )
    assert ids is None and src == "none" and "down" in note


# -- SSE counting ---------------------------------------------------------------------------


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_sse_counter_split_anywhere():
    stream = (
        sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        + sse({"choices": [{"delta": {"content": "a"}}]})
        + b": keep-alive comment\n\n"
        + sse({"choices": [{"text": "b"}]})
        + sse({"choices": [{"text": "cd", "token_ids": [1, 2]}]})
        + sse({"choices": [{"delta": {"reasoning_content": "r"}}]})
        + b"data: [DONE]\n\n"
    )
    for cut in range(1, len(stream)):
        c = SseCounter()
        c.feed(stream[:cut])
        c.feed(stream[cut:])
        assert (c.events, c.tokens, c.done) == (5, 5, True), cut


def test_sse_counter_usage_is_authoritative_and_errors_seen():
    c = SseCounter()
    c.feed(
        sse({"choices": [{"text": "a"}]}) + sse({"choices": [], "usage": {"completion_tokens": 40}})
    )
    assert c.tokens == 40
    c.feed(b'data: {"error": {"message": "boom"}}\r\n\r\n')
    assert c.engine_error == {"message": "boom"}
    c.feed(b"data: not json\n\n")
    assert c.unparsed == 1
    assert completion_tokens(b'{"usage": {"completion_tokens": 3}}') == 3
    assert completion_tokens(b"garbage") is None


# -- adapters ---------------------------------------------------------------------------------


def test_registry_builtins_and_plugins():
    assert {"openai", "vllm", "sglang", "trtllm"} <= set(adapters.adapter_kinds())
    with pytest.raises(ConfigError, match="unknown engine kind"):
        create_adapter("no-such-engine")

    class Mine(adapters.EngineAdapter):
        kind = "mine"

    adapters.register_adapter("mine", Mine)
    try:
        assert isinstance(create_adapter("mine"), Mine)
        with pytest.raises(ConfigError, match="already registered"):
            adapters.register_adapter("mine", Mine)
        adapters.register_adapter("mine", Mine, replace=True)
    finally:
        adapters.unregister_adapter("mine")
    assert "mine" not in adapters.adapter_kinds()


def test_vllm_http_adapter_transforms():
    a = adapters.VllmHttpAdapter()
    ctx = PDContext(
        request_id="rid-1", path=COMPLETIONS, prefill_worker=Worker("p", url="http://h:1")
    )
    client = {
        "model": "m",
        "prompt": "x",
        "stream": True,
        "max_tokens": 50,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
    }
    pre = a.prefill_request(client, ctx)
    assert pre["stream"] is False and pre["max_tokens"] == 1 and "stream_options" not in pre
    assert "min_tokens" not in pre and pre["kv_transfer_params"]["do_remote_decode"] is True
    assert client["stream"] is True and "kv_transfer_params" not in client  # not mutated
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e"}
    dec = a.decode_request(client, {"kv_transfer_params": params}, ctx)
    assert dec["kv_transfer_params"] == params and dec["stream"] is True
    assert a.request_headers(ctx) == {"X-Request-Id": "rid-1"}
    with pytest.raises(PDProtocolError):
        a.decode_request(client, {"choices": []}, ctx)
    # some vLLM builds put the params in the first choice: final_answer sees them, so must this
    nested = {"choices": [{"text": "x", "finish_reason": "length", "kv_transfer_params": params}]}
    assert a.final_answer(client, nested, ctx) is None
    assert a.decode_request(client, nested, ctx)["kv_transfer_params"] == params


def test_sglang_and_trtllm_transforms():
    s = adapters.SglangHttpAdapter()
    assert s.pd_style is PDStyle.CONCURRENT
    ctx = PDContext(
        request_id="r",
        path=CHAT,
        prefill_worker=Worker("p", url="http://10.0.0.5:30000"),
        prefill_options={"bootstrap_port": 9000},
    )
    p, d = s.prefill_request({"x": 1}, ctx), s.decode_request({"x": 1}, None, ctx)
    assert p["bootstrap_room"] == d["bootstrap_room"] < 2**63
    assert p["bootstrap_host"] == "10.0.0.5" and p["bootstrap_port"] == 9000
    t = adapters.TrtllmHttpAdapter()
    pre = t.prefill_request({"prompt": "x", "stream": True}, ctx)
    assert pre["disaggregated_params"] == {"request_type": "context_only"}
    answer = {
        "choices": [
            {
                "disaggregated_params": {
                    "request_type": "context_only",
                    "encoded_opaque_state": "QUJD",
                }
            }
        ],
        "prompt_token_ids": [1, 2],
    }
    dec = t.decode_request({"prompt": "x", "stream": True}, answer, ctx)
    assert dec["disaggregated_params"] == {
        "request_type": "generation_only",
        "encoded_opaque_state": "QUJD",
    }
    assert dec["prompt"] == [1, 2]


# -- decision store ----------------------------------------------------------------------------


class _D:
    def __init__(self, i):
        self.decision_id, self.worker_id, self.dp_rank = i, "w", 0

    def to_dict(self):
        return {"decision_id": self.decision_id}


def test_decision_store_is_a_bounded_lru():
    from kvplug.frontend.decisions import DecisionRecord

    store = DecisionStore(3)
    recs = [
        DecisionRecord(
            _D(i), f"r{i}", "aggregated", 0, COMPLETIONS, "m", "request", None, 4, "http://w", 1.0
        )
        for i in range(5)
    ]
    ids = [r.decision_id for r in recs]
    for r in recs[:3]:
        store.add(r)
    assert store.get(ids[0]) is recs[0]  # refreshed: now the newest
    store.add(recs[3])
    store.add(recs[4])
    assert store.get(ids[1]) is None and store.get(ids[2]) is None
    assert store.get(ids[0]) is recs[0]
    assert len(store) == 3
    assert store.get(ids[4]).to_json()["router"] == {"decision_id": 4}


def test_decision_ids_are_random_not_the_routers_sequence():
    """Issue 9 §5: ids counted up from 1, so anyone could walk every client's traces."""
    from kvplug.frontend.decisions import DecisionRecord

    ids = [
        DecisionRecord(
            _D(i), "r", "aggregated", 0, COMPLETIONS, "m", "request", None, 4, None, 1.0
        ).decision_id
        for i in range(1, 201)
    ]
    assert len(set(ids)) == len(ids)
    # not the router's sequence (1, 2, 3, ...); a random hex id may still be all digits, by a
    # chance of (10/16)**24 each (~0.3 % over 200: this assertion once failed so in CI)
    assert not any(d == str(seq) for seq, d in enumerate(ids, 1))
    assert all(len(d) >= 24 for d in ids)  # 96 random bits


def test_decision_ids_are_random_hex_and_unique_across_refills():
    from kvplug.frontend.decisions import _RandomIds

    ids = _RandomIds()
    drawn = [ids.next() for _ in range(3 * _RandomIds._BATCH + 5)]  # three refills and some
    assert len(set(drawn)) == len(drawn)
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in drawn)
    ids.reset()  # what a forked child does: its next id comes from a fresh draw
    assert ids.next() not in drawn

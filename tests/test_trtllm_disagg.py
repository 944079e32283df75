"""TRT-LLM disaggregated transforms: the exact fields trtllm-serve's workers expect."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from kvplug.integrations.trtllm.adapter import (
    ContextAnswerFinal,
    TrtllmAdapter,
    context_is_final,
    context_request,
    final_response,
    generation_request,
)

from kvplug.adapters import PDContext, PDProtocolError, PDStyle, create_adapter
from kvplug.workers import Role, Worker

DATA = Path(__file__).parent / "data" / "trtllm"
CTX = json.loads((DATA / "context_response.json").read_bytes())

CLIENT = {
    "model": "llama",
    "prompt": "The quick brown fox",
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.0,
    "nvext": {"agent_hints": {"osl": 64}},
}


def test_context_request_fields():
    before = json.dumps(CLIENT, sort_keys=True)
    ctx = context_request(CLIENT)
    assert ctx == {
        "model": "llama",
        "prompt": "The quick brown fox",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "disaggregated_params": {"request_type": "context_only"},
    }
    assert json.dumps(CLIENT, sort_keys=True) == before  # the client's body is not mutated
    newer = context_request(CLIENT, max_tokens_one=False, disagg_request_id=12345)
    assert newer["max_tokens"] == 64
    assert newer["disaggregated_params"] == {
        "request_type": "context_only",
        "disagg_request_id": 12345,
    }


def test_generation_request_carries_params_verbatim_and_prompt_token_ids():
    gen = generation_request(CLIENT, CTX, path="/v1/completions")
    expected_params = dict(CTX["choices"][0]["disaggregated_params"])
    expected_params["request_type"] = "generation_only"
    assert gen == {
        "model": "llama",
        "prompt": [1, 450, 4996, 17354, 1701, 29916],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "disaggregated_params": expected_params,
    }
    # opaque state and ids untouched, nulls included (the same build parses them back)
    assert gen["disaggregated_params"]["encoded_opaque_state"] == "AAECAwQFBgcICQ=="
    assert "ctx_info_endpoint" in gen["disaggregated_params"]


def test_generation_request_for_chat_sets_prompt_token_ids_and_keeps_messages():
    chat = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 10,
        "stream": False,
    }
    ctx = context_request(chat)
    assert ctx["max_completion_tokens"] == 1 and ctx["max_tokens"] == 1
    gen = generation_request(chat, CTX, path="/v1/chat/completions")
    assert gen["messages"] == chat["messages"]
    assert gen["prompt_token_ids"] == CTX["prompt_token_ids"]
    assert "prompt" not in gen and gen["max_completion_tokens"] == 10


def test_without_prompt_token_ids_the_prompt_stays():
    answer = {k: v for k, v in CTX.items() if k != "prompt_token_ids"}
    assert generation_request(CLIENT, answer)["prompt"] == CLIENT["prompt"]


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ({"choices": []}, "0 choices"),
        ({"choices": [{"finish_reason": "length"}, {"finish_reason": "length"}]}, "2 choices"),
        ({"choices": [{"finish_reason": "length"}]}, "without choices"),
        (
            {
                "choices": [
                    {
                        "finish_reason": "length",
                        "disaggregated_params": {
                            "request_type": "context_only",
                            "ctx_request_id": None,
                        },
                    }
                ]
            },
            "ctx_request_id",
        ),
        (None, "no choices"),
    ],
)
def test_bad_context_answers_raise_pd_protocol_error(answer, match):
    with pytest.raises(PDProtocolError, match=match):
        generation_request(CLIENT, answer)


@pytest.mark.parametrize(
    ("reason", "final"),
    [("length", False), ("not_finished", False), ("stop", True), (None, True)],
)
def test_finish_reason_decides_whether_generation_runs(reason, final):
    answer = json.loads(json.dumps(CTX))
    answer["choices"][0]["finish_reason"] = reason
    assert context_is_final(answer) is final


def test_a_final_context_answer_never_gets_a_generation_hop():
    answer = json.loads(json.dumps(CTX))
    answer["choices"][0]["finish_reason"] = "stop"
    try:
        generation_request(CLIENT, answer, who="ctx-0")
    except ContextAnswerFinal as exc:
        assert isinstance(exc, PDProtocolError)  # unknown to a frontend: safe fallback
        assert exc.response == final_response(answer)
        assert "ctx-0" in str(exc) and "'stop'" in str(exc)
    else:
        raise AssertionError("a generation request was built for a finished answer")


def test_final_response_drops_disaggregated_params():
    out = final_response(CTX)
    assert "disaggregated_params" not in out["choices"][0]
    assert "disaggregated_params" in CTX["choices"][0]  # the input is untouched


def test_adapter_registered_and_wired():
    adapter = create_adapter("trtllm")
    assert isinstance(adapter, TrtllmAdapter) and adapter.pd_style is PDStyle.SEQUENTIAL
    adapter.rng = random.Random(7)
    worker = Worker("ctx-0", url="http://127.0.0.1:8001", engine="trtllm", role=Role.PREFILL)
    pd = PDContext(
        request_id="r1",
        path="/v1/completions",
        prefill_worker=worker,
        prefill_options={"disagg_request_id": True},
    )
    ctx = adapter.prefill_request(CLIENT, pd)
    rid = ctx["disaggregated_params"]["disagg_request_id"]
    assert isinstance(rid, int) and 0 <= rid < 2**63
    assert adapter.decode_request(CLIENT, CTX, pd)["disaggregated_params"]["request_type"] == (
        "generation_only"
    )
    assert adapter.prefill_is_final(CTX) is False
    assert adapter.request_headers(pd) == {}

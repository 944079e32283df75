"""The prefix tokenization cache (kvplug/frontend/prefix_tokens.py) with real tokenizers: the
ids it assembles from chunks are the whole text's, and a tokenizer it cannot serve turns it
off (at start, or at the first verified prompt that differs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvplug.frontend.prefix_tokens import PrefixTokenCache, cut_points
from kvplug.frontend.tokens import LocalTokenizer

TINY_LLAMA = Path.home() / ".cache" / "kvplug" / "tiny-llama" / "tokenizer.json"
WORDS = ["alpha", "beta", "gamma", "delta", "über", "café", "42", "3.14", "don't", "x"]
PUNCT = [",", ".", "?", "!", ";", "(", ")", "-", "\n", "\n\n", "  ", "\t"]


def many(tok: Tokenizer):
    def encode_many(texts, add_special):
        return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=add_special)]

    return encode_many


def byte_level_bpe() -> Tokenizer:
    """A GPT-2-style byte-level BPE (Llama-3, Qwen and GPT tokenizers are of this kind),
    trained here on a little text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS * 3) + " " + "".join(PUNCT)] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def word_level() -> Tokenizer:
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def tokenizers_under_test() -> dict[str, Tokenizer]:
    found = {"byte-level-bpe": byte_level_bpe(), "word-level": word_level()}
    # the tiny Llama's own tokenizer (byte-level BPE, no pre-split regex), made by
    # .ci/setup_vllm.sh: without it test_the_tiny_llama_tokenizer_is_tested skips (a failure
    # under CI=true)
    if TINY_LLAMA.exists():
        found["tiny-llama-byte-level"] = Tokenizer.from_file(str(TINY_LLAMA))
    return found


TOKENIZERS = tokenizers_under_test()


def test_the_tiny_llama_tokenizer_is_tested():
    if "tiny-llama-byte-level" not in TOKENIZERS:
        pytest.skip(f"{TINY_LLAMA} is missing: run .ci/setup_vllm.sh")


texts = st.lists(st.sampled_from(WORDS + PUNCT + [" "] * 6), min_size=0, max_size=400).map(
    lambda parts: " ".join(parts)
)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=texts, tails=st.lists(texts, min_size=1, max_size=4), special=st.booleans())
def test_chunked_ids_are_the_whole_texts(name, shared, tails, special):
    tok = TOKENIZERS[name]
    cache = PrefixTokenCache(many(tok), chunk_chars=32, verify_every=0)
    assert cache.enabled, cache.off_reason
    for tail in tails:  # the shared part hits the cache from the second prompt on
        text = shared + " " + tail
        want = tok.encode(text, add_special_tokens=special).ids
        assert list(cache.encode(text, special)) == want
    assert cache.enabled


def test_repeated_text_is_not_tokenized_again():
    tok = TOKENIZERS["byte-level-bpe"]
    seen: list[int] = []

    def counting(texts, add_special):
        seen.append(sum(len(t) for t in texts))
        return many(tok)(texts, add_special)

    cache = PrefixTokenCache(counting, chunk_chars=64, verify_every=0)
    shared = " ".join(WORDS * 40)  # ~2,000 characters
    seen.clear()
    first = cache.encode(shared + " alpha beta", True)
    first_chars = sum(seen)
    seen.clear()
    second = cache.encode(shared + " gamma delta", True)
    assert isinstance(second, np.ndarray)
    assert list(first) == tok.encode(shared + " alpha beta").ids
    assert list(second) == tok.encode(shared + " gamma delta").ids
    # the second prompt tokenized only its last chunk
    assert first_chars > len(shared) and sum(seen) < 200
    assert cache.stats["chunk_hits"] > 0


def test_a_tokenizer_that_adds_a_suffix_is_refused_at_start():
    tok = word_level()
    tok.add_special_tokens(["</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    cache = PrefixTokenCache(many(tok), chunk_chars=32)
    assert not cache.enabled and "sample text" in cache.off_reason
    text = " ".join(WORDS * 30)
    assert list(cache.encode(text, True)) == tok.encode(text).ids


def test_a_mismatch_seen_in_service_switches_the_cache_off(caplog):
    tok = TOKENIZERS["word-level"]
    calls = {"n": 0}

    def drifting(texts, add_special):
        # passes the start-up check, then the whole text starts tokenizing differently from
        # its chunks (as a tokenizer with merges across words would on some input)
        calls["n"] += 1
        out = many(tok)(texts, add_special)
        if calls["n"] > 4 and len(texts) == 1 and len(texts[0]) > 500:
            out[0] = [*out[0], 0]
        return out

    cache = PrefixTokenCache(drifting, chunk_chars=64, verify_every=1)
    assert cache.enabled
    text = " ".join(WORDS * 30)
    got = cache.encode(text, False)
    assert not cache.enabled and "differed" in cache.off_reason
    assert list(got) == drifting([text], False)[0]  # the whole text's ids, not the chunks'
    assert "prefix tokenization cache off" in caplog.text


def test_the_cache_stays_within_its_capacity():
    tok = TOKENIZERS["word-level"]
    cache = PrefixTokenCache(many(tok), capacity=10, chunk_chars=32, verify_every=0)
    for i in range(50):
        cache.encode(" ".join(WORDS[i % 10 :] + WORDS * 5) + f" {i}", False)
    assert len(cache._chunks) <= 10


@given(st.text(alphabet=" ab\n\t.", max_size=300), st.integers(1, 40))
@settings(max_examples=300, deadline=None)
def test_cuts_fall_between_words(text, chunk):
    cuts = cut_points(text, chunk)
    for prev, cut in zip([0, *cuts], cuts, strict=False):
        assert cut - prev >= chunk if prev else cut >= chunk
        assert text[cut] == " " and not text[cut - 1].isspace() and not text[cut + 1].isspace()


def test_local_tokenizer_serves_long_prompts_from_the_cache(tmp_path):
    TOKENIZERS["byte-level-bpe"].save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    local = LocalTokenizer(tmp_path)
    plain = LocalTokenizer(tmp_path, prefix_cache_chunks=0)
    assert local.prefix_cache is not None and local.prefix_cache.enabled
    assert plain.prefix_cache is None
    text = " ".join(WORDS * 60)
    for _ in range(2):
        assert list(local.encode(text)) == plain.encode(text)
    assert local.encode("alpha beta") == plain.encode("alpha beta")  # short: a plain list


@pytest.mark.parametrize("preset", [None, "true"])
def test_tokenizers_thread_pool_is_off_unless_the_user_asked(tmp_path, monkeypatch, preset):
    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
    TOKENIZERS["word-level"].save(str(tmp_path / "tokenizer.json"))
    LocalTokenizer(tmp_path)
    import os

    assert os.environ["TOKENIZERS_PARALLELISM"] == (preset or "false")

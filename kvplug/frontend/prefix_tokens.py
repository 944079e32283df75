"""Tokenizing a prompt chunk by chunk, with the chunks a fleet sees again and again cached.

Routing text prompts means tokenizing them, and with the ``tokenizers`` library that is most of
``kvplug serve``'s CPU per text request (200-340 us for a 2,800-character prompt here, against
~0.3 ms for everything else). Prompts repeat what earlier prompts said - a system prompt, a
conversation's history, a shared document - so, as llm-d's prefix store does, kvplug keeps the
token ids of text it has tokenized and only tokenizes what is new.

The text is cut into chunks of about ``chunk_chars`` characters, each cut just before a space
that follows a non-space and precedes one (``"... end| next ..."``). Tokenizers that split into
words before their model runs (BPE, WordPiece, WordLevel, Unigram behind a whitespace,
Metaspace, ByteLevel or regex pre-tokenizer) never make a token across such a cut, so the
prompt's ids are the chunks' ids end to end: each chunk is looked up (the first with the
special tokens the whole text would get, the rest without) and only the missing ones are
tokenized, in one batch call.

That property belongs to the tokenizer, so it is checked, never assumed: at start on sample
text, and then every ``verify_every``-th prompt is also tokenized whole and compared. A
tokenizer that fails either check has the cache switched off for good (logged once, in
``stats``), and that prompt gets the whole-text ids: a mismatch can never reach the router
twice.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

EncodeMany = Callable[[Sequence[str], bool], list[list[int]]]

# sample text for the start-up check: words, punctuation, digits, newlines, runs of spaces
_SAMPLE = (
    "The quick brown fox, 42 times, jumped over the lazy dog.\nThen it ran  away again; "
    "nobody saw where it went (maybe north?). Über café naïve résumé - 3.14159 and 2,718. "
)


def cut_points(text: str, chunk_chars: int) -> list[int]:
    """Where ``text`` is cut: about every ``chunk_chars`` characters, just before a space with
    a non-space on both sides (so no word, and no run of spaces, is split)."""
    cuts: list[int] = []
    n = len(text)
    pos = chunk_chars
    find = text.find
    while pos < n - 1:
        j = find(" ", pos)
        while j != -1 and (j + 1 >= n or text[j - 1].isspace() or text[j + 1].isspace()):
            j = find(" ", j + 1)
        if j == -1:
            break
        cuts.append(j)
        pos = j + chunk_chars
    return cuts


class PrefixTokenCache:
    """``encode(text, add_special)`` as ``encode_many`` would give it for the whole text, from
    cached chunks where it can. Thread-safe (long prompts are tokenized on a worker thread)."""

    def __init__(
        self,
        encode_many: EncodeMany,
        capacity: int = 16_384,
        chunk_chars: int = 256,
        verify_every: int = 64,
        name: str = "tokenizer",
    ) -> None:
        self._encode_many = encode_many
        self.capacity = capacity
        self.chunk_chars = chunk_chars
        self.verify_every = verify_every
        self.name = name
        self._chunks: OrderedDict[tuple[bool, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._calls = 0
        self.stats = {"prompts": 0, "chunk_hits": 0, "chunk_misses": 0, "verified": 0}
        self.off_reason: str | None = None
        self._self_check()

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    def snapshot(self) -> dict[str, int]:
        """Counters for /metrics: prompts, chunk hits and misses, verified prompts, cached
        chunks, and 1 while the cache is on."""
        return {**self.stats, "chunks": len(self._chunks), "enabled": int(self.enabled)}

    def _whole(self, text: str, add_special: bool) -> np.ndarray:
        return np.array(self._encode_many([text], add_special)[0], dtype=np.uint32)

    def _switch_off(self, reason: str) -> None:
        if self.off_reason is None:
            self.off_reason = reason
            self._chunks.clear()
            log.warning("prefix tokenization cache off for %s: %s", self.name, reason)

    def _self_check(self) -> None:
        text = _SAMPLE * 12
        for add_special in (True, False):
            whole = self._whole(text, add_special)
            pieces = self._by_chunks(text, add_special, cut_points(text, 64), cache=False)
            if not np.array_equal(whole, pieces):
                self._switch_off(
                    "it tokenizes sample text cut between words differently from the whole text"
                )
                return

    def encode(self, text: str, add_special: bool) -> list[int] | np.ndarray:
        """The whole text's ids: a list when tokenized whole (short text, cache off), else a
        uint32 array assembled from the chunks."""
        if self.off_reason is not None or len(text) < 2 * self.chunk_chars:
            return self._encode_many([text], add_special)[0]
        cuts = cut_points(text, self.chunk_chars)
        if not cuts:
            return self._encode_many([text], add_special)[0]
        ids = self._by_chunks(text, add_special, cuts, cache=True)
        self._calls += 1
        if self.verify_every and self._calls % self.verify_every == 0:
            whole = self._whole(text, add_special)
            self.stats["verified"] += 1
            if not np.array_equal(whole, ids):
                self._switch_off(
                    f"a {len(text)}-character prompt tokenized chunk by chunk differed from "
                    "the whole text"
                )
                return whole
        return ids

    def _by_chunks(self, text: str, add_special: bool, cuts: list[int], cache: bool) -> np.ndarray:
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        last = len(pieces) - 1  # the tail is tokenized every time, never cached
        keys = [(add_special and i == 0, p) for i, p in enumerate(pieces)]
        out: list[np.ndarray | None] = [None] * len(pieces)
        if cache:
            with self._lock:
                chunks = self._chunks
                for i in range(last):
                    hit = chunks.get(keys[i])
                    if hit is not None:
                        chunks.move_to_end(keys[i])
                        out[i] = hit
        missing = [i for i, got in enumerate(out) if got is None]
        if cache:
            self.stats["prompts"] += 1
            self.stats["chunk_hits"] += last + 1 - len(missing)
            self.stats["chunk_misses"] += len(missing)
        # one call per special-token setting (the first chunk alone may carry them)
        for special in (True, False):
            group = [i for i in missing if keys[i][0] == special]
            if not group:
                continue
            encoded = self._encode_many([pieces[i] for i in group], special)
            for i, ids in zip(group, encoded, strict=True):
                out[i] = np.array(ids, dtype=np.uint32)
        if cache:
            with self._lock:
                chunks = self._chunks
                for i in missing:
                    if i != last:
                        chunks[keys[i]] = out[i]  # type: ignore[assignment]
                while len(chunks) > self.capacity:
                    chunks.popitem(last=False)
        return np.concatenate(out)  # type: ignore[arg-type]

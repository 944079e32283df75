"""Trace loading and expansion (Mooncake format: timestamp ms, input/output lengths, hash_ids).

Each ``hash_id`` names one 512-token prompt block; equal ids mean equal prefix up to and including
that block. Two ways to hand a request to the router and the engines, giving the same prefix
structure:

* **hashes** (the fast path used by the replay): each full block's id is mixed into a u64
  (:func:`block_hashes_of`); the router gets them as ``RouteRequest.block_hashes`` and the engines
  report them as ``BlockStored.block_hashes``;
* **tokens**: each id expands to 512 deterministic token ids (:func:`expand_tokens`), so prompts
  sharing ids share token prefixes; the router and the index hash them with kvplug's own hash.
"""

from __future__ import annotations

import gzip
import json
import lzma
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512
VOCAB = 128_000  # Llama-3 vocabulary size (token ids stay below it)
_M64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TraceRecord:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def bundled_trace_path() -> Path:
    """The Mooncake conversation trace shipped with the package (gzip, Apache-2.0)."""
    return Path(
        str(resources.files("kvplug.sim") / "data" / "mooncake_conversation_trace.jsonl.gz")
    )


def _open(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".xz":  # a quarter of gzip's size on hash-id lists (benchmarks/data/aiperf)
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_trace(path: str | Path | None = None) -> Iterator[TraceRecord]:
    """Records in file order. Bad lines raise ValueError naming the line number."""
    p = Path(path) if path is not None else bundled_trace_path()
    with _open(p) as fh:
        lineno = 0
        while True:
            try:
                line = fh.readline()
            except (EOFError, OSError, lzma.LZMAError, UnicodeDecodeError) as exc:
                # a truncated or corrupt .gz / .xz, found wherever it breaks
                raise ValueError(f"{p}:{lineno + 1}: unreadable trace file: {exc}") from exc
            if not line:
                break
            lineno += 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rec = TraceRecord(
                    arrival_s=float(obj["timestamp"]) / 1000.0,
                    input_length=int(obj["input_length"]),
                    output_length=int(obj["output_length"]),
                    hash_ids=tuple(int(h) for h in obj["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{p}:{lineno}: bad trace record: {exc}") from exc
            if rec.input_length <= 0 or rec.output_length < 0:
                raise ValueError(f"{p}:{lineno}: non-positive lengths")
            yield rec


def load_trace(
    path: str | Path | None = None,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
    speedup: float = 1.0,
) -> list[TraceRecord]:
    """A slice of a trace, arrival times rebased to the slice start and divided by ``speedup``."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    out: list[TraceRecord] = []
    for rec in iter_trace(path):
        if rec.arrival_s < start_s:
            continue
        if duration_s is not None and rec.arrival_s >= start_s + duration_s:
            break
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        return out
    t0 = out[0].arrival_s
    return [
        TraceRecord((r.arrival_s - t0) / speedup, r.input_length, r.output_length, r.hash_ids)
        for r in out
    ]


def spread_arrivals(records: list[TraceRecord], seed: int = 0) -> list[TraceRecord]:
    """Requests that share a timestamp spread over the gap to the next one, in order.

    The bundled conversation trace stamps its requests in 3-second buckets (~10 at the same
    millisecond). One router routes such a burst one by one, seeing each decision; replicas
    sharing load with any delay could not, which real arrivals, spread over the bucket, do not
    ask of them. Each group is placed at sorted uniform times in [t, next t) (Poisson arrivals
    given their count); the last group over the trace's mean gap between distinct times."""
    if len(records) < 2:
        return list(records)
    times = sorted({r.arrival_s for r in records})
    mean_gap = (times[-1] - times[0]) / max(len(times) - 1, 1)
    next_time = dict(zip(times, [*times[1:], times[-1] + mean_gap], strict=True))
    rng = np.random.default_rng(seed)
    out: list[TraceRecord] = []
    i = 0
    while i < len(records):
        t = records[i].arrival_s
        j = i
        while j < len(records) and records[j].arrival_s == t:
            j += 1
        offsets = np.sort(rng.uniform(0.0, next_time[t] - t, j - i))
        offsets[0] = 0.0  # the group's first request keeps its time
        for r, dt in zip(records[i:j], offsets, strict=True):
            out.append(TraceRecord(t + float(dt), r.input_length, r.output_length, r.hash_ids))
        i = j
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def block_hashes_of(
    hash_ids, n_blocks: int | None = None, namespace: int = 0x6B76706C7567
) -> list[int]:
    """u64 block hashes for the first ``n_blocks`` ids (ids are already chained: one per prefix)."""
    ids = np.asarray(hash_ids[:n_blocks] if n_blocks is not None else hash_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _mix(ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(namespace & _M64)).tolist()


def expand_tokens(
    hash_ids, input_length: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> np.ndarray:
    """Deterministic token ids (uint32) for a prompt: block ``i`` is a function of ``hash_ids[i]``
    only, so prompts with equal leading ids have equal leading tokens. The last block is cut to
    ``input_length``."""
    need = -(-input_length // block_tokens)
    if need > len(hash_ids):
        raise ValueError(f"{len(hash_ids)} hash_ids cannot cover {input_length} tokens")
    ids = np.asarray(hash_ids[:need], dtype=np.uint64)[:, None]
    pos = np.arange(block_tokens, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        seeds = ids * np.uint64(0xD6E8FEB86659FD93) + pos
    toks = (_mix(seeds) % np.uint64(VOCAB)).astype(np.uint32).reshape(-1)
    return toks[:input_length]


def output_tokens(salt: int, start: int, n: int) -> np.ndarray:
    """Deterministic stand-ins for generated tokens ``start..start+n`` of one request."""
    pos = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (
            _mix(pos + np.uint64(salt & _M64) * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(VOCAB)
        ).astype(np.uint32)


def oracle_hit_rate(records: list[TraceRecord], block_tokens: int = TRACE_BLOCK_TOKENS) -> dict:
    """Block hit ratio of an infinite cache shared by all engines, over full prompt blocks (what a
    paged cache can reuse) and, for reference, over all ids including each partial last block."""
    seen: set[int] = set()
    full = full_hit = every = every_hit = 0
    for r in records:
        nf = r.input_length // block_tokens
        for i, h in enumerate(r.hash_ids):
            hit = h in seen
            if i < nf:
                full += 1
                full_hit += hit
            every += 1
            every_hit += hit
        seen.update(r.hash_ids)
    return {
        "full_blocks": full,
        "full_block_hit_rate": full_hit / full if full else 0.0,
        "all_ids": every,
        "all_id_hit_rate": every_hit / every if every else 0.0,
    }


SHARED_PREFIX_DEFAULTS = {
    "groups": 256,  # distinct system prompts: 4,096 prefix blocks, > one engine's 1,640
    "system": 8192,  # tokens of each group's shared prefix
    "question": 1024,  # unique tokens per request after the prefix
    "output": 256,
    "rate": 8.0,  # requests per second (Poisson)
    "requests": 8000,
    "seed": 0,
}


def synthetic_shared_prefix(block_tokens: int = TRACE_BLOCK_TOKENS, **params) -> list[TraceRecord]:
    """A generated workload in the trace format, like SGLang's ``generated-shared-prefix``:
    ``groups`` system prompts of ``system`` tokens, each request one group's prompt (uniform)
    plus ``question`` unique tokens, ``output`` tokens out, Poisson arrivals at ``rate``/s.
    Block ids: group g's prefix blocks are shared by its requests, the rest unique."""
    p = {**SHARED_PREFIX_DEFAULTS, **params}
    unknown = set(params) - set(SHARED_PREFIX_DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown shared-prefix parameter(s) {sorted(unknown)}; "
            f"known: {sorted(SHARED_PREFIX_DEFAULTS)}"
        )
    groups, system, question = int(p["groups"]), int(p["system"]), int(p["question"])
    output, rate, n = int(p["output"]), float(p["rate"]), int(p["requests"])
    if min(groups, n) < 1 or system < 0 or question < 1 or output < 1 or rate <= 0:
        raise ValueError(f"bad shared-prefix parameters {p}")
    rng = np.random.default_rng(int(p["seed"]))
    bt = block_tokens
    sys_blocks = system // bt  # full shared blocks; a partial one is mixed with the question
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    group_of = rng.integers(0, groups, n)
    next_id = groups * sys_blocks
    out = []
    for i in range(n):
        g = int(group_of[i])
        length = system + question
        total_blocks = -(-length // bt)
        shared = list(range(g * sys_blocks, (g + 1) * sys_blocks))
        unique = list(range(next_id, next_id + total_blocks - sys_blocks))
        next_id += total_blocks - sys_blocks
        out.append(TraceRecord(float(arrivals[i]), length, output, tuple(shared + unique)))
    return out


# multi-turn sessions; "agentic" is the same generator with tool-loop defaults
MULTI_TURN_DEFAULTS = {
    "session_rate": 1.5,  # new sessions per second (Poisson)
    "turns": 8.0,  # mean turns per session (geometric, >= 1)
    "systems": 16,  # distinct system prompts, one per session (Zipf-like popularity)
    "system": 2048,  # tokens of a system prompt
    "first": 1500,  # mean tokens of the first user message (exponential)
    "user": 300,  # mean tokens added by each later user turn (exponential)
    "output": 350,  # mean output tokens per turn (exponential, >= 8)
    "think": 60.0,  # mean seconds between a reply and the next turn (exponential)
    "max_context": 100_000,  # a session ends when its prompt would pass this
    "duration": 1200.0,  # seconds of session arrivals
    "seed": 0,
}
AGENTIC_DEFAULTS = {
    **MULTI_TURN_DEFAULTS,
    "session_rate": 0.5,
    "turns": 20.0,
    "systems": 4,
    "system": 8192,  # tool definitions and instructions
    "first": 2000,
    "user": 1500,  # tool results
    "output": 150,  # tool calls
    "think": 2.0,  # tool latency
}


def synthetic_multi_turn(
    block_tokens: int = TRACE_BLOCK_TOKENS, defaults: dict | None = None, **params
) -> list[TraceRecord]:
    """Sessions whose every turn resends the whole conversation (system prompt, earlier turns,
    earlier replies) plus a new message, as chat and agent loops do. Block ids follow the token
    stream: a session's full blocks keep their id from turn to turn (a prefix hit for the next
    turn if it stayed cached), system-prompt blocks are shared by every session using that prompt,
    a trailing partial block is unique. Turn ``k + 1`` arrives ``think`` seconds (exponential)
    after turn ``k``'s *expected* end (arrival + 0.03 s per output token), so the trace does not
    depend on the policy being measured."""
    base = defaults or MULTI_TURN_DEFAULTS
    unknown = set(params) - set(base)
    if unknown:
        raise ValueError(
            f"unknown multi-turn parameter(s) {sorted(unknown)}; known: {sorted(base)}"
        )
    p = {**base, **params}
    rate, turns, n_sys = float(p["session_rate"]), float(p["turns"]), int(p["systems"])
    system, first, user = int(p["system"]), float(p["first"]), float(p["user"])
    output, think, max_ctx = float(p["output"]), float(p["think"]), int(p["max_context"])
    duration = float(p["duration"])
    if min(rate, turns, first, user, output, duration) <= 0 or n_sys < 1 or system < 0:
        raise ValueError(f"bad multi-turn parameters {p}")
    if think < 0 or max_ctx < block_tokens:
        raise ValueError(f"bad multi-turn parameters {p}")
    rng = np.random.default_rng(int(p["seed"]))
    bt = block_tokens
    sys_blocks = system // bt
    popularity = 1.0 / np.arange(1, n_sys + 1)
    popularity /= popularity.sum()
    next_id = n_sys * sys_blocks
    out: list[TraceRecord] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            break
        g = int(rng.choice(n_sys, p=popularity))
        stream = list(range(g * sys_blocks, (g + 1) * sys_blocks))  # full blocks of the session
        length = system  # tokens so far (prompt and replies)
        n_turns = int(rng.geometric(1.0 / turns))
        at = t
        for k in range(n_turns):
            length += max(1, int(rng.exponential(first if k == 0 else user)))
            if length > max_ctx:
                break
            while len(stream) < length // bt:
                stream.append(next_id)
                next_id += 1
            ids = list(stream[: length // bt])
            if length % bt:
                ids.append(next_id)  # the partial tail: its content changes next turn
                next_id += 1
            reply = max(8, int(rng.exponential(output)))
            out.append(TraceRecord(at, length, reply, tuple(ids)))
            length += reply
            at += 0.03 * reply + rng.exponential(think) if think > 0 else 0.03 * reply
    out.sort(key=lambda r: r.arrival_s)
    return out


# long-document question answering with bursty arrivals
DOC_QA_DEFAULTS = {
    "docs": 200,  # distinct documents (Zipf-like popularity: a few are hot)
    "doc": 24000,  # median tokens of a document (log-normal, sigma 0.6)
    "max_doc": 100_000,  # documents are cut to this many tokens
    "questions": 4.0,  # mean questions per session (geometric, >= 1)
    "question": 200,  # mean tokens of a question (exponential)
    "output": 200,  # mean output tokens per answer (exponential, >= 8)
    "think": 20.0,  # mean seconds between an answer and the next question (exponential)
    "session_rate": 0.5,  # mean new sessions per second over a burst cycle
    "burst": 4.0,  # session rate in a burst / rate outside one
    "burst_period": 300.0,  # seconds per cycle; the first fifth of each is the burst
    "duration": 1200.0,  # seconds of session arrivals
    "seed": 0,
}
BURST_SHARE = 0.2  # of each burst cycle


def synthetic_doc_qa(block_tokens: int = TRACE_BLOCK_TOKENS, **params) -> list[TraceRecord]:
    """Sessions that each ask a few independent questions about one long document: every
    prompt is the whole document plus a new question (the document's blocks are the only
    shared prefix; earlier questions are not resent). Documents have Zipf-like popularity, so a
    few long prefixes are hot fleet-wide, and sessions arrive in bursts (``burst`` times the
    quiet rate for the first fifth of every ``burst_period``), the shape that piles many long
    prefills onto whichever engine holds a hot document."""
    p = {**DOC_QA_DEFAULTS, **params}
    unknown = set(params) - set(DOC_QA_DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown doc-qa parameter(s) {sorted(unknown)}; known: {sorted(DOC_QA_DEFAULTS)}"
        )
    n_docs, doc, max_doc = int(p["docs"]), float(p["doc"]), int(p["max_doc"])
    questions, question, output = float(p["questions"]), float(p["question"]), float(p["output"])
    think, rate, burst = float(p["think"]), float(p["session_rate"]), float(p["burst"])
    period, duration = float(p["burst_period"]), float(p["duration"])
    if min(n_docs, doc, questions, question, output, rate, period, duration) <= 0:
        raise ValueError(f"bad doc-qa parameters {p}")
    if burst < 1 or think < 0 or max_doc < block_tokens:
        raise ValueError(f"bad doc-qa parameters {p}")
    rng = np.random.default_rng(int(p["seed"]))
    bt = block_tokens
    lengths = np.clip(rng.lognormal(np.log(doc), 0.6, n_docs), bt, max_doc).astype(int)
    doc_blocks = lengths // bt  # full blocks; the partial tail is mixed with the question
    starts = np.concatenate([[0], np.cumsum(doc_blocks)[:-1]])
    next_id = int(doc_blocks.sum())
    popularity = 1.0 / np.arange(1, n_docs + 1)
    popularity /= popularity.sum()
    quiet = rate / (BURST_SHARE * burst + 1 - BURST_SHARE)  # keeps the cycle's mean at rate
    peak = quiet * burst
    out: list[TraceRecord] = []
    t = 0.0
    while True:
        t += rng.exponential(1.0 / peak)  # thinning: candidates at the peak rate
        if t > duration:
            break
        in_burst = (t % period) < BURST_SHARE * period
        if not in_burst and rng.random() > quiet / peak:
            continue
        d = int(rng.choice(n_docs, p=popularity))
        shared = list(range(int(starts[d]), int(starts[d]) + int(doc_blocks[d])))
        at = t
        for _ in range(int(rng.geometric(1.0 / questions))):
            length = int(lengths[d]) + max(1, int(rng.exponential(question)))
            tail = -(-length // bt) - len(shared)
            ids = shared + list(range(next_id, next_id + tail))
            next_id += tail
            reply = max(8, int(rng.exponential(output)))
            out.append(TraceRecord(at, length, reply, tuple(ids)))
            at += 0.03 * reply + (rng.exponential(think) if think > 0 else 0.0)
    out.sort(key=lambda r: r.arrival_s)
    return out


WORKLOADS = ("shared-prefix", "multi-turn", "agentic", "doc-qa")


def parse_workload(text: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRecord]:
    """``NAME[:key=value,...]`` -> records: ``shared-prefix`` (:func:`synthetic_shared_prefix`),
    ``multi-turn`` and ``agentic`` (:func:`synthetic_multi_turn` with chat or tool-loop
    defaults), ``doc-qa`` (:func:`synthetic_doc_qa`)."""
    name, _, rest = text.partition(":")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    params: dict[str, float] = {}
    for term in filter(None, (t.strip() for t in rest.split(","))):
        key, sep, raw = term.partition("=")
        try:
            params[key.strip()] = float(raw)
        except ValueError:
            raise ValueError(f"workload term {term!r} is not KEY=NUMBER") from None
        if not sep:
            raise ValueError(f"workload term {term!r} is not KEY=NUMBER")
    if name == "multi-turn":
        return synthetic_multi_turn(block_tokens, MULTI_TURN_DEFAULTS, **params)
    if name == "agentic":
        return synthetic_multi_turn(block_tokens, AGENTIC_DEFAULTS, **params)
    if name == "doc-qa":
        return synthetic_doc_qa(block_tokens, **params)
    return synthetic_shared_prefix(block_tokens, **params)

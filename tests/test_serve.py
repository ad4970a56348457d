"""``expertcache serve`` with real clients: the ``openai`` package (completions, chat, streaming), raw HTTP
for bad input, concurrent requests batched together with a greedy request's tokens equal to the model's
alone, a full queue, a client that leaves, metrics, and a real server process stopped by SIGTERM."""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import threading
import time

import engine_fixtures
import numpy as np
import openai
import pytest
import torch
from engine_fixtures import engine_load
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from expertcache.cli import main
from expertcache.config import SamplingConfig, ServeConfig
from expertcache.errors import ExpertcacheError
from expertcache.serve import batcher as batcher_module
from expertcache.serve.app import create_app

_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["hello world", "the quick brown fox", "jumps over", "a lazy dog"]
BASE = "http://localhost"  # a loopback Host name: the server refuses others by default


@pytest.fixture(scope="module")
def served(make_ckpt):
    """(model, TestClient, openai client) over a tiny Mixtral at 50% of its experts, no recording."""
    path = make_ckpt("mixtral")
    model = engine_load(path, 8, record=False)
    model.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(model, "tiny", ServeConfig(max_queue=8)), base_url=BASE) as http:
        client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", http_client=http)
        yield model, http, client
    model.close()


def _usage_at_once(client, prompts: list[str], max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, completion tokens) of each prompt, all asked at once (one thread each)."""
    usage: list[tuple[int, int]] = []

    def ask(p: str) -> None:
        u = client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens).usage
        usage.append((u.prompt_tokens, u.completion_tokens))

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return usage


def alone(model, prompt, n: int, chat: bool = False) -> list[int]:
    """The model's greedy tokens for one prompt, through generate_text on the same (warm) model."""
    return model.generate_text(prompt, n, chat=chat).tokens


def test_completion_and_chat_through_the_openai_client_equal_the_model_alone(served):
    model, http, client = served
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6)
    want = alone(model, PROMPTS[0], 6)
    assert r.choices[0].text == model.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(want) and r.model == "tiny"
    assert r.choices[0].finish_reason == ("length" if len(want) == 6 else "stop")
    hi = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model="tiny", messages=hi, max_tokens=5)
    want = alone(model, hi, 5, True)
    assert c.choices[0].message.content == model.tokenizer.decode(want, skip_special_tokens=True)
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens == len(want)
    assert client.models.list().data[0].id == "tiny"


def test_streaming_ends_with_done_and_adds_up_to_the_whole_text(served):
    model, http, client = served
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason is not None
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens >= 1
    with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                      "stream": True}) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_a_short_prompt_is_tokenised_on_the_loop_and_a_long_one_on_a_worker(served, monkeypatch):
    """A worker's handoff waits for the GIL the generation thread holds; a long prompt must not hold
    the event loop either. Both give the same answer."""
    import expertcache.serve.app as app_module

    model, http, client = served
    handed = []
    real = app_module.run_in_threadpool

    async def recorded(fn, *args):
        handed.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(app_module, "run_in_threadpool", recorded)
    short = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3).choices[0].text
    chat = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=chat, max_tokens=2)
    assert handed == []
    monkeypatch.setattr(app_module, "INLINE_CHARS", len(PROMPTS[0]) - 1)  # PROMPTS[0] is now "long"
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3).choices[0].text == short
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x" * 80}], max_tokens=2
    )
    assert len(handed) == 2


def test_concurrent_requests_are_batched_and_each_equals_the_model_alone(served):
    model, http, client = served
    want = {p: model.tokenizer.decode(alone(model, p, 10), skip_special_tokens=True) for p in PROMPTS}
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        got[p] = client.completions.create(model="tiny", prompt=p, max_tokens=10).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    metrics = http.get("/metrics").text
    assert 'expertcache_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "expertcache_cache_hits_total" in metrics and "expertcache_cache_layer_misses_total" in metrics
    assert "expertcache_ttft_seconds_count" in metrics
    if sys.platform == "linux":  # read from /proc
        assert float(_metric(metrics, "expertcache_memory_resident_bytes")) > 0
        assert float(_metric(metrics, "expertcache_memory_checkpoint_cached_bytes")) >= 0
    steps, tokens = (float(_metric(metrics, f"expertcache_{n}_total")) for n in ("steps", "step_tokens"))
    assert tokens > steps > 0  # some steps computed several requests' tokens


@pytest.mark.parametrize("schedule", ["fifo", "prompts-first"])
def test_prompts_first_runs_new_prompts_in_a_step_of_their_own_and_every_answer_is_the_same(
    make_ckpt, schedule
):
    """``--schedule prompts-first``: prompts that arrive while another request decodes get a step without
    the decodes, then everyone decodes; under ``fifo`` (transformers' order) they share the decode's
    step. Every request's tokens equal the model's alone either way.
    The generation thread is held in the long request's first decode step until the new prompts are
    queued, so what the scheduler sees does not depend on timing."""
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    long = next(
        p for p in ("once upon a time", "in the beginning", "x y z") if len(alone(model, p, 24)) == 24
    )
    want = {p: model.tokenizer.decode(alone(model, p, n), skip_special_tokens=True)
            for p, n in ((long, 24), *((p, 6) for p in PROMPTS))}  # fmt: skip
    steps: list[tuple[int, int]] = []  # (prompt tokens, decode tokens) of each step, as it begins
    queued, decoding = threading.Event(), threading.Event()
    told_by = model.engine.step_source

    config = ServeConfig(max_queue=8, schedule=schedule)
    with TestClient(create_app(model, "tiny", config), base_url=BASE) as http:
        batcher = http.app.state.batcher
        told_by = model.engine.step_source

        def spy():
            told = told_by()
            if told is not None:
                steps.append((int(told[1].sum()), int((~told[1]).sum())))
                if steps[-1] == (0, 1) and not queued.is_set():  # the long request's first decode step
                    decoding.set()
                    queued.wait(60)
            return told

        model.engine.step_source = spy
        client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", http_client=http)
        got: dict[str, str] = {}

        def ask(p: str, n: int) -> None:
            got[p] = client.completions.create(model="tiny", prompt=p, max_tokens=n).choices[0].text

        def ask_long() -> None:  # its first token comes out of the step the spy holds: not waited for here
            stream = client.completions.create(model="tiny", prompt=long, max_tokens=24, stream=True)
            got[long] = "".join(chunk.choices[0].text for chunk in stream)

        streaming = threading.Thread(target=ask_long)
        streaming.start()
        assert decoding.wait(60)  # out of the prefill, held in its first decode step
        threads = [threading.Thread(target=ask, args=(p, 6)) for p in PROMPTS]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while batcher.manager.input_queue.qsize() < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.01)
        queued.set()
        for t in [streaming, *threads]:
            t.join(120)
        scheduler = batcher.manager.batch_processor.scheduler
    model.engine.step_source = told_by
    model.close()
    assert got == want
    prompts = sum(len(model.tokenizer(p)["input_ids"]) for p in PROMPTS)
    joined = next(i for i, step in enumerate(steps) if step[0] == prompts)  # the step of the new prompts
    if schedule == "fifo":
        assert type(scheduler).__name__ == "FIFOScheduler"
        assert steps[joined] == (prompts, 1)  # beside the long request's next token
    else:
        assert type(scheduler).__name__ == "PromptsFirst" and scheduler.prompt_steps == 1
        assert steps[joined] == (prompts, 0)  # alone: the long request sits this step out
        assert steps[joined + 1] == (0, 5)  # then everyone's next token: the long request's and the four's


# batch: a margin that admits few experts, so that many-token misses stream (fills off: they, like
# prefetches, depend on the machine's timing)
@pytest.mark.parametrize("policy, miss", [("lru", "fetch"), ("tlfu:margin=8", "batch:fill=0")])
def test_a_served_run_is_recorded_token_by_token_and_replays_to_the_engines_counts(make_ckpt, policy, miss):
    """Under continuous batching the engine learns from the batcher whose each token is: the recorded
    trace holds every request's prompt and generated tokens in order, each step the tokens it ran
    (at most ``batch_tokens``), and the simulator's replay of it gives the engine's requests and misses
    per phase and layer (under batch-aware caching too: tlfu's token counts, admissions and bypasses).
    /metrics and the stats say the same per-phase counts."""
    from expertcache.cache.schedule import build_schedule
    from expertcache.costs import CostModel
    from expertcache.sim.replay import replay
    from expertcache.sim.timing import simulate_timing

    # one-token misses on the host, many-token ones over the link
    costs = CostModel(
        expert_s=1e-3, expert_token_s=1e-4, host_expert_s=2e-3, host_expert_token_s=1e-3,
        link_bandwidth=1e6, link_latency=0.0, expert_bytes=3000, chunk_bytes=None,
    )  # fmt: skip
    model = engine_load(make_ckpt("mixtral"), 8, policy, record=True, miss=miss, costs=costs)
    config = ServeConfig(max_queue=8, batch_tokens=12)
    with TestClient(create_app(model, "tiny", config), base_url=BASE) as http:
        client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", http_client=http)
        usage = _usage_at_once(client, PROMPTS * 2, 6)
        trace, stats, metrics = model.trace(), model.stats, http.get("/metrics").text
    model.close()
    assert len(usage) == 8 and len(set(trace.seq_id.tolist())) == 8
    prompts = {tuple(model.tokenizer(p)["input_ids"]) for p in PROMPTS}
    seen = []
    for seq in set(trace.seq_id.tolist()):
        rows = trace.seq_id == seq
        phase = trace.is_prefill[rows]
        prompt = int(phase.sum())
        assert (phase[:prompt] == 1).all() and (phase[prompt:] == 0).all()
        assert tuple(trace.token_id[rows][:prompt].tolist()) in prompts
        seen.append((prompt, int(rows.sum()) - prompt + 1))  # the last token sampled is never fed back
    assert sorted(seen) == sorted(usage)
    sizes = np.bincount(trace.step_id)
    assert (
        sizes.max() <= 12
        and len(sizes) == stats["phases"]["decode"]["steps"] + stats["phases"]["prefill"]["steps"]
    )
    # the run's own clock, a step at a time: each token carries its step's forward, steps one after another
    first = np.r_[0, np.cumsum(sizes)[:-1]]
    starts, ends = trace.step_start_s[first], trace.step_end_s[first]
    assert (trace.step_start_s == np.repeat(starts, sizes)).all()
    assert (trace.step_end_s == np.repeat(ends, sizes)).all()
    assert starts[0] == 0 and (ends >= starts).all() and (starts[1:] >= ends[:-1]).all()
    if miss == "fetch":
        sim = replay(build_schedule(trace, "layer"), policy, model.capacity)
        assert model.cache.stats.requests.tolist() == sim.layer_requests.tolist()
        assert model.cache.stats.misses.tolist() == sim.layer_misses.tolist()
    else:
        timed = simulate_timing(trace, 8, cache=policy, miss=miss, cost=costs)  # the budget, all parts
        for key in ("requests", "hits", "misses", "host_computed", "misses_by_layer", "part_misses"):
            assert stats[key] == timed.cache[key], key
        assert stats["host_computed"] > 0 and stats["part_misses"].get("stream", 0) > 0
        # the replay states the run's own times beside its own, request by request as it times its own
        rec = timed.recorded
        assert rec["requests_timed"] and rec["steps"] == len(sizes)
        assert rec["ttft_requests"]["requests"] == rec["tpot_requests"]["requests"] == 8
        assert rec["decode_step_s"] >= rec["decode_forward_s"] > 0
    prompt_tokens = int((trace.is_prefill == 1).sum())
    assert stats["phases"]["prefill"]["tokens"] == prompt_tokens == sum(p for p, _ in usage)
    assert stats["phases"]["decode"]["tokens"] == trace.num_tokens - prompt_tokens
    for phase, counts in stats["phases"].items():
        for name, key in (("cache_misses_by_phase", "misses"), ("cache_hits_by_phase", "hits"),
                          ("steps_by_phase", "steps"), ("step_tokens_by_phase", "tokens")):  # fmt: skip
            assert float(_metric(metrics, f'expertcache_{name}_total{{phase="{phase}"}}')) == counts[key]
    assert sum(c["misses"] for c in stats["phases"].values()) == stats["misses"]
    # each part's demand transfers (a new user's trial: batch's misses did not add up to the bytes moved)
    for part, count in stats["part_misses"].items():
        assert float(_metric(metrics, f'expertcache_cache_part_transfers_total{{part="{part}"}}')) == count
    moved = sum(stats["part_misses"].values()) + stats["prefetch_issued"] + stats["filled"]
    assert stats["bytes_transferred"] == moved * stats["expert_bytes"]
    accuracy = float(_metric(metrics, "expertcache_cache_prefetch_accuracy"))  # NaN: nothing predicted
    assert accuracy == stats["accuracy"] or (math.isnan(accuracy) and stats["accuracy"] is None)
    assert "# HELP expertcache_cache_prefetch_accuracy ProMoE's accuracy" in metrics


def test_a_request_paused_for_kv_space_is_not_a_prompt_again(make_ckpt):
    """A KV cache too small for two long requests: transformers pauses one (a soft reset: what it
    generated is folded into a new request's prompt) and restarts it. Its restart was recorded as a
    prompt step, and ``timing`` put its first token hundreds of steps late."""
    model = engine_load(make_ckpt("mixtral"), 8, record=True)
    with TestClient(
        create_app(model, "tiny", ServeConfig(max_queue=8, kv_tokens=300)), base_url=BASE
    ) as http:
        client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", http_client=http)
        usage = _usage_at_once(client, PROMPTS[:2], 400)
        trace, stats, metrics = model.trace(), model.stats, http.get("/metrics").text
    model.close()
    prompts, generated = sum(p for p, _ in usage), sum(n for _, n in usage)
    assert len(usage) == 2 and generated > 512  # more than the KV cache holds: one was paused
    phases = stats["phases"]
    assert phases["decode"]["tokens"] > generated - 2  # the restarted request's tokens, computed again
    assert int(trace.is_prefill.sum()) == phases["prefill"]["tokens"] == prompts
    assert float(_metric(metrics, "expertcache_prompt_tokens_total")) == prompts
    assert float(_metric(metrics, "expertcache_generated_tokens_total")) == generated
    restarts = float(_metric(metrics, "expertcache_kv_restarted_requests_total"))
    assert 1 <= restarts <= generated // 300  # once a restart, not once a step of its prompt
    for seq in set(trace.seq_id.tolist()):  # each request's prompt steps come first, then never again
        phase = trace.is_prefill[trace.seq_id == seq]
        first = int(phase.sum())
        assert (phase[:first] == 1).all() and (phase[first:] == 0).all()


def test_a_prompt_token_is_one_of_a_request_that_has_generated_nothing():
    from transformers.generation.continuous_batching.requests import RequestState

    state = RequestState(request_id="run-3", initial_tokens=[5, 6, 7], max_new_tokens=8)
    assert batcher_module._in_prompt(state)
    state.generated_tokens += [9, 10]
    assert not batcher_module._in_prompt(state)  # decoding, or restored from the CPU after a pause
    restarted = state.create_equivalent_initial_request()  # a soft reset: [5, 6, 7, 9, 10] to compute
    assert not restarted.generated_tokens and not batcher_module._in_prompt(restarted)
    fresh = RequestState(request_id="run-4", initial_tokens=[5], max_new_tokens=8)
    again = fresh.create_equivalent_initial_request()  # paused before its first token: still its prompt
    assert batcher_module._in_prompt(again)


def test_stop_strings_and_sampling(served):
    model, http, client = served
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10).choices[0].text
    stop = whole[3:5]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, stop=[stop])
    assert r.choices[0].text == whole[: whole.find(stop)] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.5, top_p=0.9)
    assert s.usage.completion_tokens >= 1


def test_a_seeded_request_equals_generate_with_its_seed_alone_or_under_concurrency(served):
    model, http, client = served
    kw = {"temperature": 1.3, "top_p": 0.95, "top_k": 40}

    def want(prompt: str, seed: int) -> str:
        g = model.generate_text(prompt, 12, sampling=SamplingConfig(seed=seed, **kw))
        return model.tokenizer.decode(g.tokens, skip_special_tokens=True)

    # the batching thread seeds torch's global generator when it starts: let it start before generate
    # draws from that generator below
    client.completions.create(model="tiny", prompt="x", max_tokens=1)
    cells = [(p, seed) for p in PROMPTS[:2] for seed in (1, 2, 3)]
    expected = {c: want(*c) for c in cells}
    assert len({expected[(PROMPTS[0], s)] for s in (1, 2, 3)}) > 1  # the seed matters
    got: dict[tuple[str, int], str] = {}

    def ask(cell) -> None:
        r = client.completions.create(
            model="tiny", prompt=cell[0], max_tokens=12, seed=cell[1], temperature=1.3, top_p=0.95,
            extra_body={"top_k": 40},
        )  # fmt: skip
        got[cell] = r.choices[0].text

    ask(cells[0])  # alone
    assert got[cells[0]] == expected[cells[0]]
    # streamed: random bytes split characters across tokens; the pieces still add up to the whole text
    stream = client.completions.create(
        model="tiny", prompt=cells[1][0], max_tokens=12, seed=cells[1][1], temperature=1.3, top_p=0.95,
        extra_body={"top_k": 40}, stream=True,
    )  # fmt: skip
    assert "".join(ch.choices[0].text for ch in stream) == expected[cells[1]]
    threads = [threading.Thread(target=ask, args=(c,)) for c in cells]
    unseeded = [threading.Thread(target=client.completions.create, kwargs={"model": "tiny", "prompt": p,
                "max_tokens": 12, "temperature": 1.3}) for p in PROMPTS]  # fmt: skip
    for t in threads + unseeded:
        t.start()
    for t in threads + unseeded:
        t.join(120)
    assert got == expected  # unseeded neighbours drawing from the shared stream change nothing


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "nope", "prompt": "x"}, 404, "is not served here"),
        ({"model": "tiny"}, 400, "prompt: Field required"),
        ({"model": "tiny", "prompt": ""}, 400, "one non-empty prompt"),
        ({"model": "tiny", "prompt": ["a", "b"]}, 400, "one non-empty prompt"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "temperature": 1, "seed": 2**64}, 400, "seed: Input should be"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400, "exceeds the model's context"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n: not supported by this server"),
        ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs: not supported by this server"),
        # a completion's logprobs counts alternatives: 0 still asks for the chosen token's own
        ({"model": "tiny", "prompt": "x", "logprobs": 0}, 400, "logprobs: not supported by this server"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"model": "tiny", "prompt": "x", "stop": ""}, 400, "stop: an empty stop string"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": "5"},
            400,
            "max_tokens: Input should be a valid integer",
        ),
        # the vocabulary bounds top_k (4097 and 2**63 used to kill the generation loop)
        ({"model": "tiny", "prompt": "x", "temperature": 1, "top_k": 301}, 400, "top_k: at most the vocab"),
        ({"model": "tiny", "prompt": "x", "temperature": 1, "top_k": 2**63}, 400, "top_k: at most the vocab"),
        # fields accepted and ignored before: refused unless they ask for nothing
        (
            {"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        (
            {"model": "tiny", "prompt": "x", "tool_choice": "auto"},
            400,
            "tool_choice: not supported by this server",
        ),
        ({"model": "tiny", "prompt": "x", "function_call": "auto"}, 400, "function_call"),
        ({"model": "tiny", "prompt": "x", "parallel_tool_calls": True}, 400, "parallel_tool_calls"),
        ({"model": "tiny", "prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
        ({"model": "tiny", "prompt": "x", "min_tokens": 3}, 400, "min_tokens"),
        ({"model": "tiny", "prompt": "x", "ignore_eos": True}, 400, "ignore_eos"),
        (
            {"model": "tiny", "prompt": "x", "no_such_field": 1},
            400,
            "no_such_field: not a field this server takes",
        ),
        # a lone surrogate: 400, not a 500 from the tokenizer
        ({"model": "tiny", "prompt": "a\ud800b"}, 400, "prompt: not valid Unicode text: a lone surrogate"),
        ({"model": "tiny", "prompt": "x", "stop": ["\udfff"]}, 400, "lone surrogate"),
        # a stop string that made every step rescan it (quadratic in its length): bounded
        ({"model": "tiny", "prompt": "x", "stop": [" " * 1001]}, 400, "at most 1000 characters"),
        (
            {"model": "tiny", "prompt": "x", "stream_options": {"foo": 1}},
            400,
            "stream_options.foo: not a field",
        ),
        # null is the field left out, as the openai client sends it for None
        (
            {"model": "tiny", "prompt": "x", "max_tokens": 1, "temperature": None, "n": None, "top_p": None},
            200,
            "",
        ),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(served, body, status, words):
    model, http, client = served
    raw = json.dumps(body).encode()  # json.dumps escapes a lone surrogate as JSON allows
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:
        return
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    if err["code"] == "invalid_value" and ":" in err["message"]:  # a field: OpenAI's param names it
        field = err["message"].split(":")[0]
        assert err["param"] == (None if field == "body" else field)
    assert (
        http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


def test_chat_fields_nobody_defined_and_two_limits_are_refused(served):
    model, http, client = served
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    for body, words in (
        ({"messages": [{"role": "user", "content": [part]}]}, "no other keys"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 5},
            "give one",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "speaker names"),
    ):
        r = http.post("/v1/chat/completions", json={"model": "tiny", **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_content_part_that_is_not_text_is_named_as_the_field_it_is(served):
    """An image part was a 400 with ``param: null``, and ``"content": []`` an empty message."""
    model, http, client = served
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for content, words in (
        ([{"type": "text", "text": "hi"}, image], "part 1 is of type 'image_url'"),
        ([{"type": "text", "text": "a", "x": 1}], "part 0 is a text part with other keys (x)"),
        ([{"type": "text", "text": 5}], "part 0 is a text part whose text is not a string"),
        ([{"text": "a"}], "part 0 is without a type"),
        ([], "no content parts"),
    ):
        body = {
            "model": "tiny",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}],
        }
        err = http.post("/v1/chat/completions", json=body).json()["error"]
        assert err["param"] == "messages.1.content" and err["message"].startswith("messages.1.content: ")
        assert words in err["message"], err
    parts = [{"type": "text", "text": "def "}, {"type": "text", "text": "add("}]

    def chat(content):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        return http.post("/v1/chat/completions", json=body)

    r, plain = chat(parts), chat("def add(")
    assert r.status_code == 200 and r.json()["choices"] == plain.json()["choices"]


def test_sampling_fields_on_a_greedy_request_are_refused_not_ignored(served):
    """``top_p`` or ``top_k`` without a temperature came back greedy with a 200 (the command line refuses
    --top-p without --temperature); the values that ask for nothing, and a seed, are taken."""
    model, http, client = served
    for extra, field in (
        ({"top_p": 0.5}, "top_p"),
        ({"top_k": 5}, "top_k"),
        ({"top_p": 0.9, "temperature": 0}, "top_p"),
    ):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "this request is greedy" in err["message"]
    for extra in ({"top_p": 1.0}, {"top_k": 1}, {"seed": 5}, {"top_p": 0.5, "temperature": 0.7, "seed": 1}):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, **extra})
        assert r.status_code == 200, (extra, r.text)
    err = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stop": 5}).json()["error"]
    assert err["param"] == "stop"  # not pydantic's "stop.str"


def test_openai_s_own_values_and_types_are_taken_or_refused_as_openai_does(served):
    """A new user's trial with the openai SDK: chat took ``logprobs: 0`` (a boolean there), and
    completions' ``best_of`` and ``suffix``; ``stream_options`` without a stream was taken; ``seed: -1``,
    ``top_p: 0`` and ``store: false``, all OpenAI's, were refused; ``models.retrieve`` was a 404."""
    model, http, client = served
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for extra, status, words in (
        ({"logprobs": 0}, 400, "logprobs: Input should be a valid boolean"),
        ({"logprobs": True}, 400, "logprobs: not supported by this server"),
        ({"logprobs": False}, 200, ""),
        ({"best_of": 1}, 400, "not a field this server takes"),
        ({"suffix": ""}, 400, "not a field this server takes"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options: is for streaming"),
        ({"store": True}, 400, "store: not supported by this server"),
        ({"store": False}, 200, ""),
        ({"seed": -1, "temperature": 0.8}, 200, ""),
    ):
        r = http.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == status and words in r.text, (extra, r.text)
    prompt = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 6}
    greedy = http.post("/v1/completions", json=prompt).json()["choices"][0]["text"]
    nucleus = http.post("/v1/completions", json={**prompt, "temperature": 1.0, "top_p": 0.0, "seed": 3})
    assert nucleus.json()["choices"][0]["text"] == greedy  # top_p 0: the most likely token alone
    assert client.models.retrieve("tiny").id == "tiny"
    assert client.models.list().data[0].created > 0
    r = http.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_body_that_is_not_utf8_is_named_as_such(served):
    model, http, client = served
    raw = b'{"model": "tiny", "prompt": "\xff\xfe"}'
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "the body is not valid JSON (not UTF-8 text: byte 0xff at "
    )


def test_the_door_refuses_compressed_bodies_and_two_keys_and_answers_head(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    try:
        with TestClient(create_app(model, "tiny", ServeConfig(api_key="k")), base_url=BASE) as http:
            body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1})
            gz = {"content-type": "application/json", "content-encoding": "gzip", "authorization": "Bearer k"}
            r = http.post("/v1/completions", content=body, headers=gz)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding"
            two = [("authorization", "Bearer wrong"), ("authorization", "Bearer k")]
            assert http.get("/v1/models", headers=two).status_code == 401
            assert http.head("/health").status_code == 200
            r = http.get("/v1/nothing", headers={"authorization": "Bearer k"})
            assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
            r = http.get("/v1/completions", headers={"authorization": "Bearer k"})  # a POST route
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            assert r.json()["error"]["message"] == "GET is not allowed on /v1/completions; use POST"
            metrics = http.get("/metrics", headers={"authorization": "Bearer k"}).text
            assert 'expertcache_requests_total{endpoint="/v1/completions",status="405"} 1.0' in metrics
            assert 'expertcache_requests_total{endpoint="other",status="404"} 1.0' in metrics
    finally:
        model.close()


def test_malformed_json_bad_messages_and_unknown_routes(served):
    model, http, client = served
    r = http.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'
    for headers, said in (
        ({"content-type": "application/x-www-form-urlencoded"}, "this request's is"),
        ({}, "none"),
    ):
        r = http.post("/v1/completions", content=body, headers=headers)  # curl -d's default, or none
        message = r.json()["error"]["message"]
        assert r.status_code == 415 and "Content-Type: application/json" in message and said in message
    for kind in ("text/json", "application/jsonl", "text/plain; charset=utf-8"):  # not read as JSON
        r = http.post("/v1/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 415 and kind in r.json()["error"]["message"]
    for kind in ("Application/JSON; charset=utf-8", "application/vnd.api+json"):  # read as JSON
        r = http.post("/v1/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 200, r.text
    r = http.post("/v1/completions", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "no body" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b"")
    assert r.status_code == 400 and "no body" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "colour": "blue", "aroma": 1})
    error = r.json()["error"]
    assert (
        r.status_code == 400
        and error["param"] == "aroma"
        and "aroma, colour: not a field" in error["message"]
    )
    r = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400
    assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()
    assert http.get("/health").json() == {"status": "ok"}


def test_a_key_given_twice_is_refused_not_guessed(served):
    model, http, client = served
    headers = {"content-type": "application/json"}
    for raw, key in (
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "max_tokens": 3}', "max_tokens"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "a", "content": "b"}]}', "content"),
    ):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = http.post(path, content=raw, headers=headers)
        err = r.json()["error"]
        assert (
            r.status_code == 400 and err["message"] == f"the body gives {key!r} twice" and err["param"] == key
        )
        assert r.content.startswith(b'{"error":{"message":')  # written as every other error (a trial)
    assert (
        http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


def test_a_body_nested_too_deep_and_two_different_limits_are_named(served):
    """A new user's trial: a body nested 100 000 deep got Starlette's "There was an error parsing the
    body"; max_tokens and max_completion_tokens that differ named no field."""
    model, http, client = served
    deep = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = http.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the body is not valid JSON (nested deeper than this server reads)"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "max_completion_tokens": 3})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens"
    assert err["message"] == "max_completion_tokens: differs from max_tokens (2): give one of them"
    r = http.post("/v1/chat/completions", json={**chat, "max_tokens": 2, "max_completion_tokens": 2})
    assert r.status_code == 200


def test_a_client_that_leaves_cancels_its_request(served):
    model, http, client = served
    totals = ("expertcache_prompt_tokens_total", "expertcache_generated_tokens_total")
    before = [float(_metric(http.get("/metrics").text, name)) for name in totals]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while "expertcache_cancelled_requests_total 0.0" in http.get("/metrics").text and time.time() < deadline:
        time.sleep(0.1)
    assert "expertcache_cancelled_requests_total 0.0" not in http.get("/metrics").text
    left = 'expertcache_requests_total{endpoint="/v1/completions",status="499"}'
    while left not in http.get("/metrics").text and time.time() < deadline:  # counted as it went
        time.sleep(0.1)
    assert left in http.get("/metrics").text
    # what the model read and generated for it counts (a cancelled request added nothing)
    after = [float(_metric(http.get("/metrics").text, name)) for name in totals]
    assert after[0] - before[0] == len(model.tokenizer(PROMPTS[2])["input_ids"]) and after[1] > before[1]


def test_a_full_queue_answers_503_with_retry_after(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    try:
        with TestClient(create_app(model, "tiny", ServeConfig(max_queue=1)), base_url=BASE) as http:
            http.app.state.batcher.jobs["someone"] = None  # one request running: the queue is full
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
            del http.app.state.batcher.jobs["someone"]
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
    finally:
        model.close()


def test_the_key_guards_everything_but_health_and_docs_are_off(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    key = {"Authorization": "Bearer s3cret"}
    try:
        with TestClient(create_app(model, "tiny", ServeConfig(api_key="s3cret")), base_url=BASE) as http:
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/v1/models", headers=key).status_code == 200
            assert http.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
            assert http.get("/v1/models", headers={"Authorization": "BEARER  s3cret "}).status_code == 200
            assert http.get("/v1/models?api_key=s3cret").status_code == 401  # only the header counts
            assert http.get("/health").status_code == 200  # health stays open
            for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/nothing"):
                r = http.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert http.get("/metrics", headers=key).status_code == 200
            for path in ("/docs", "/redoc", "/openapi.json"):  # off unless --docs
                assert http.get(path, headers=key).status_code == 404
            assert http.get("/health", headers={"host": "rebound.example:8000"}).status_code == 400
        config = ServeConfig(api_key="s3cret", metrics_open=True, docs=True, allowed_hosts=("box.lan",))
        with TestClient(create_app(model, "tiny", config), base_url="http://box.lan:8000") as http:
            assert http.get("/metrics").status_code == 200  # --metrics-open
            assert http.get("/openapi.json").status_code == 401
            assert http.get("/openapi.json", headers=key).status_code == 200  # --docs, behind the key
            assert http.get("/docs", headers=key).status_code == 200
            r = http.get("/health", headers={"host": "other.lan"})
            assert r.status_code == 400 and "--allowed-host" in r.json()["error"]["message"]
    finally:
        model.close()


def test_a_tiny_temperature_is_greedy_and_developer_is_a_system_message(served):
    model, http, client = served
    greedy = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6).choices[0].text
    for t in (1e-300, 1e-45, 1e-6):  # 1e-300 and 1e-45 overflowed the logits and killed the loop
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=t, seed=3)
        assert r.choices[0].text == greedy
    as_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = client.chat.completions.create(model="tiny", messages=as_system, max_tokens=5)
    as_developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = client.chat.completions.create(model="tiny", messages=as_developer, max_tokens=5)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_lengths_are_checked_against_the_kv_cache_and_the_default_fits(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    model.tokenizer.chat_template = TEMPLATE
    try:
        with TestClient(create_app(model, "tiny", ServeConfig(kv_tokens=200)), base_url=BASE) as http:
            assert http.app.state.batcher.kv_tokens == 256  # whole pages
            assert float(_metric(http.get("/metrics").text, "expertcache_kv_cache_tokens")) == 256
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 40, "max_tokens": 250})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert err["param"] == "prompt"  # as OpenAI names the field: messages for a chat
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "x " * 40}], "max_tokens": 250}
            assert http.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "messages"
            assert "the server's KV cache (--kv-cache-tokens) of 256 tokens" in err["message"]
            # without max_tokens the answer is as long as fits (it used to ask for 256 and fail)
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 40})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] <= 256
            # a prompt that fills the cache, without max_tokens: the message names no max_tokens of its own
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 300})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and "+ a token to generate (max_tokens not given) exceeds" in message
            # too long a prompt is refused by its characters, before it is tokenised
            limits_chars = 2048 * max(len(t) for t in model.tokenizer.get_vocab())
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "y" * (limits_chars + 1)})
            assert r.status_code == 400 and "cannot fit the model's context of 2048" in r.text
    finally:
        model.close()


def test_an_exception_in_a_route_is_a_json_500_without_its_text(served, monkeypatch):
    model, http, client = served

    def broken(*a, **k):
        raise RuntimeError("raw torch text that must not reach a client")

    monkeypatch.setattr("expertcache.serve.app.render", broken)
    r = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert "incident" in err["message"] and "raw torch" not in r.text and err["type"] == "server_error"
    monkeypatch.undo()
    assert (
        http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


def test_an_exception_inside_a_stream_ends_it_with_an_error_event(served, monkeypatch):
    model, http, client = served
    batcher = http.app.state.batcher

    async def broken(job):
        yield batcher_module.Piece("partial", 1)
        raise RuntimeError("raw text that must not reach a client")

    monkeypatch.setattr(batcher, "pieces", broken)
    lines = _ask(http, stream=True)
    assert '"error"' in lines[-2] and "incident" in lines[-2] and lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2].removeprefix("data: "))["error"]  # OpenAI's error object, every key
    assert set(event) == {"message", "type", "param", "code"} and event["type"] == "server_error"
    assert "raw text" not in "".join(lines)
    for job in list(batcher.jobs.values()):  # the request the broken stream left behind, if running
        batcher.cancel(job)
    monkeypatch.undo()
    assert _ask(http, 1).status_code == 200


@pytest.fixture
def watched(make_ckpt):
    """A server of its own for the watchdog tests (they break its loop)."""
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    with TestClient(create_app(model, "tiny", ServeConfig(max_queue=8)), base_url=BASE) as http:
        yield model, http
    model.close()


def _ask(http, n: int = 4, stream: bool = False):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": n, "stream": stream}
    if not stream:
        return http.post("/v1/completions", json=body)
    with http.stream("POST", "/v1/completions", json=body) as r:
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_an_exception_in_a_step_fails_its_requests_and_the_loop_goes_on(watched):
    model, http = watched
    want = _ask(http).json()["choices"][0]["text"]
    fired = []

    def explode(module, args):
        if not fired:
            fired.append(1)
            raise RuntimeError("injected failure in a step")

    hook = model.model.register_forward_pre_hook(explode)
    try:
        r = _ask(http)
        assert r.status_code == 500 and "incident" in r.json()["error"]["message"]
        assert "injected" not in r.text  # the log has it, the client does not
        # the 500 can reach its client before the dispatcher has started the loop again (a request then
        # hears "starting again", a 503): wait for the restart, not for a time
        batcher, deadline = http.app.state.batcher, time.monotonic() + 60
        while not (batcher.restarts and batcher.state == "running") and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = _ask(http, stream=True)  # the loop was started again: served as before
        assert lines[-1] == "data: [DONE]" and "error" not in lines[-2]
        assert _ask(http).json()["choices"][0]["text"] == want
    finally:
        hook.remove()
    assert http.get("/health").json() == {"status": "ok"}
    assert len(http.app.state.batcher.restarts) == 1
    assert "expertcache_requests_in_flight 0.0" in http.get("/metrics").text


def test_a_request_whose_logits_are_not_finite_ends_with_an_error_not_token_0_for_ever(watched):
    """The engine's own guard is off under continuous batching (padding rows may be NaN by construction):
    a served request whose scores went NaN streamed token 0 to its last token, status 200."""
    model, http = watched
    want = _ask(http).json()["choices"][0]["text"]

    def nan(module, args, output):
        output.logits.fill_(float("nan"))
        return output

    hook = model.model.register_forward_hook(nan)
    try:
        r = _ask(http)
        assert r.status_code == 500 and "the model's outputs are not finite" in r.json()["error"]["message"]
        lines = _ask(http, stream=True)
        assert "the model's outputs are not finite" in lines[-2] and lines[-1] == "data: [DONE]", lines
    finally:
        hook.remove()
    assert _ask(http).json()["choices"][0]["text"] == want  # the loop and the other requests go on
    assert http.get("/health").json() == {"status": "ok"}
    assert not http.app.state.batcher.sampler.bad and not http.app.state.batcher.sampler.live


def test_an_exception_in_the_dispatching_loop_ends_running_streams_with_an_error(watched, monkeypatch):
    model, http = watched
    batcher = http.app.state.batcher
    real = batcher.manager.get_result
    calls = []

    def flaky(*a, **k):
        out = real(*a, **k)
        if out is not None and not calls:  # fails while a request is running
            calls.append(out)
            raise RuntimeError("injected failure in the dispatcher")
        return out

    monkeypatch.setattr(batcher.manager, "get_result", flaky)
    lines = _ask(http, n=50, stream=True)
    assert calls and '"error"' in lines[-2] and "incident" in lines[-2] and lines[-1] == "data: [DONE]"
    assert _ask(http).status_code == 200 and http.get("/health").status_code == 200


def test_a_loop_that_keeps_failing_fails_fast_instead_of_hanging(watched, monkeypatch):
    model, http = watched
    monkeypatch.setattr(batcher_module, "MAX_RESTARTS", 1)

    def explode(module, args):
        raise RuntimeError("injected failure in every step")

    hook = model.model.register_forward_pre_hook(explode)
    try:
        assert _ask(http).status_code == 500  # restarted once
        assert _ask(http).status_code == 500  # and given up on
        # the request's 500 can reach its client before the dispatcher has seen the loop die (a request
        # then meanwhile hears "starting again"): wait for the verdict, not for a time
        deadline = time.monotonic() + 60
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503 and "failed 2 times" in health.json()["reason"]
        r = _ask(http)
        assert r.status_code == 503 and r.headers["retry-after"] and "restart the server" in r.text
    finally:
        hook.remove()


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


def test_a_port_taken_while_the_model_loaded_is_one_line_and_exit_2(make_ckpt, capsys, monkeypatch):
    """A new user's trial: two servers started together on one port both found it free; the second
    loaded its model, then exited 3 with uvicorn's error and transformers' warning about a loop that never
    ran. It is now the one line and exit 2 of every error, after uvicorn's own log line."""
    import logging

    from expertcache.cli import serve as cli_serve

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        monkeypatch.setattr(cli_serve, "_check_port", lambda host, port: None)  # free when checked
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger("ContinuousBatchingLogger").addHandler(handler)
        try:
            busy.listen()  # taken as the model loads
            code = main(
                ["serve", "--model", str(make_ckpt("mixtral")), "--device", "cpu", "--port", str(port)]
            )
        finally:
            logging.getLogger("ContinuousBatchingLogger").removeHandler(handler)
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"expertcache: error: cannot listen on 127.0.0.1:{port}"
    )
    assert not any("not initialized" in m for m in seen), seen


class _Shapes:
    """A model as ``kv_size`` sees it: Granite-3.1-1B's attention (24 layers, 8 KV heads of 64) in float32,
    98 304 bytes of keys and values a token."""

    def __init__(self) -> None:
        from transformers import GraniteMoeConfig

        self.config = GraniteMoeConfig(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                                       num_key_value_heads=8, max_position_embeddings=131072)  # fmt: skip
        self.dtype = torch.float32


def test_the_kv_cache_default_shrinks_to_what_fits_and_a_size_that_cannot_fit_is_an_error(monkeypatch):
    batcher = batcher_module
    model, per_token = _Shapes(), 24 * 2 * 8 * 64 * 4
    assert batcher.kv_bytes_per_token(model.config, model.dtype) == per_token
    monkeypatch.setattr(batcher, "batching_memory", lambda: 64 * 2048 * per_token * 4)  # room to spare
    assert batcher.kv_size(model, 64) == (64 * 2048, None)
    monkeypatch.setattr(batcher, "batching_memory", lambda: 5 * 2**30)  # 5 GiB: 2.5 GiB for the cache
    tokens, note = batcher.kv_size(model, 64)
    assert tokens == 2.5 * 2**30 // per_token // 256 * 256 == 27136
    assert note.startswith("note: the KV cache holds 27136 tokens") and "--kv-cache-tokens" in note
    assert batcher.kv_size(model, 64, kv_tokens=40000) == (40192, None)  # asked for: all of the room
    with pytest.raises(ExpertcacheError, match=r"--kv-cache-tokens 60000 needs 5.5 GiB .* more than the 5"):
        batcher.kv_size(model, 64, kv_tokens=60000)
    monkeypatch.setattr(batcher, "batching_memory", lambda: 20 * 2**20)
    with pytest.raises(ExpertcacheError, match="no room for a KV cache"):
        batcher.kv_size(model, 64)
    monkeypatch.setattr(batcher, "batching_memory", lambda: None)  # transformers cannot say: as asked
    assert batcher.kv_size(model, 4) == (4 * 2048, None)


def test_serve_refuses_a_kv_cache_that_cannot_fit_in_one_line_before_serving(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["serve", "--port", str(port), "--kv-cache-tokens", str(2**40), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--kv-cache-tokens {2**40} needs" in err[0] and "lower it" in err[0]
    # without --quiet too: no "serving ..." line before the refusal (a new user saw one)
    assert main(["serve", "--port", str(port), "--kv-cache-tokens", str(2**40)]) == 2
    err = capsys.readouterr().err
    assert "serving " not in err and f"--kv-cache-tokens {2**40} needs" in err.strip().splitlines()[-1]


def test_serve_refuses_a_model_continuous_batching_cannot_cache_in_one_line_before_loading(ckpt, capsys):
    """transformers' continuous batching pages attention layers' keys and values only: a hybrid with
    linear-attention (or Mamba) layers is refused before it loads, and through the API before serving."""
    from expertcache.serve import run

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for family, kinds in (("nemotron_h", "linear_attention"), ("lara_mini", "linear_attention")):
        assert main(["serve", "--model", str(ckpt(family)), "--port", str(port), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{family}'s layers include {kinds} ones" in err[0], err
        assert "'expertcache generate' runs it" in err[0]
    with (
        engine_load(ckpt("lara_mini")) as model,
        pytest.raises(ExpertcacheError, match="attention layers only"),
    ):
        run(model, "lara", ServeConfig(port=port))


def test_serve_bad_options_are_one_line(capsys):
    for argv, words in (
        [["serve", "--port", "0"], "--port"],
        [["serve", "--miss", "teleport"], "unknown miss"],
        [["serve", "--plan", "plan.json", "--policy", "lfu"], "--plan sets the expert memory"],
        [["serve", "--max-body", "lots"], "--max-body 'lots' is not a size"],
        [["serve", "--max-body", "100B"], "--max-body must be at least 1KiB"],
        [["serve", "--header-timeout", "0s"], "--header-timeout must be longer than 0"],
        [["serve", "--header-timeout", "-3s"], "--header-timeout must be longer than 0, got '-3s'"],
        [["serve", "--served-model-name", " "], "--served-model-name is empty"],
        [["serve", "--body-timeout", "soon"], "--body-timeout 'soon' is not a duration"],
        [["serve", "--max-connections", "0"], "--max-connections must be at least 1"],
        [["serve", "--allowed-host", ""], "--allowed-host needs a host name"],
        [["serve", "--kv-cache-tokens", "0"], "--kv-cache-tokens must be at least 1"],
        [["serve", "--schedule", "sjf"], "--schedule must be one of fifo, prompts-first, got 'sjf'"],
        [["serve", "--api-key", ""], "--api-key is empty"],  # an empty key was no key: every endpoint open
        [["serve", "--api-key", " "], "--api-key is empty"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]


def test_an_empty_key_in_the_environment_is_refused_and_a_given_one_wins(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("EXPERTCACHE_API_KEY", "")
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EXPERTCACHE_API_KEY is set but empty" in err[0]
    assert (
        main(["serve", "--api-key", "k", "--model", str(tmp_path / "none")]) == 2
    )  # past the key: the model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none" in err[0] and "API_KEY" not in err[0]


def test_serve_config_values_of_the_wrong_type_are_named():
    """``ServeConfig(port="8000")`` ended in a TypeError from ``<``; ``allowed_hosts="box.lan"`` was read
    as the names b, o, x, ..."""
    for kwargs, words in (
        ({"port": "8000"}, "ServeConfig port must be a whole number, got '8000'"),
        ({"port": True}, "ServeConfig port must be a whole number, got True"),
        (
            {"allowed_hosts": "box.lan"},
            "ServeConfig allowed_hosts must be a list of host names, got 'box.lan'",
        ),
        ({"allowed_hosts": ("a", 3)}, "ServeConfig allowed_hosts must be names"),
        ({"metrics_open": 1}, "ServeConfig metrics_open must be True or False"),
        ({"api_key": ""}, "api_key is empty"),  # in Python its name (a new user's trial)
        ({"kv_tokens": "300"}, "ServeConfig kv_tokens must be a whole number or None"),
    ):
        with pytest.raises(ExpertcacheError, match=re.escape(words)):
            ServeConfig(**kwargs)
    assert ServeConfig(allowed_hosts=["box.lan"]).allowed_hosts == ("box.lan",)
    port = ServeConfig(port=np.int64(8001)).port
    assert port == 8001 and type(port) is int  # numpy's integers, as Python's for the server


def test_stats_give_the_engines_counts_and_every_answer_is_counted(served):
    model, http, client = served
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    stats = http.get("/stats").json()
    assert stats["misses"] == model.stats["misses"] and set(stats["phases"]) == {"decode", "prefill"}
    before = http.get("/metrics").text
    assert http.get("/v1/models").status_code == 200
    after = http.get("/metrics").text
    label = 'expertcache_requests_total{endpoint="/v1/models",status="200"}'

    def count(text: str) -> float:
        return float(next((ln.split()[-1] for ln in text.splitlines() if ln.startswith(label)), "0"))

    assert count(after) == count(before) + 1
    assert 'expertcache_requests_total{endpoint="/metrics",status="200"}' in after


def _metric(text: str, name: str) -> str:
    return next(line.split()[1] for line in text.splitlines() if line.startswith(name + " "))


def test_the_connection_cap_stays_below_the_open_file_limit():
    from expertcache.serve.connections import connection_cap, raise_file_limit

    assert connection_cap(None, None) == 4096 and connection_cap(100, None) == 100
    assert connection_cap(None, 1024) == 1024 - 256 and connection_cap(5000, 20000) == 5000
    limit = raise_file_limit()
    assert limit is None or connection_cap(None, limit) < limit


def test_a_repeated_loop_error_is_logged_once_per_interval(caplog):
    import asyncio

    from expertcache.serve.connections import quiet_accept_errors

    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop, interval=3600)
        flood = OSError(24, "Too many open files")
        with caplog.at_level("ERROR", logger="expertcache.serve"):
            for _ in range(1000):  # what 20 000 connections over the open-file limit did to the log
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": flood}
                )
            loop.call_exception_handler({"message": "something else"})
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "Too many open files" in lines[0] and lines[1] == "something else"
    finally:
        loop.close()


@given(
    text=st.text(alphabet="ab ", max_size=40),
    stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_the_stop_finder_equals_searching_the_whole_text_each_time(text, stops, cuts):
    """Fed the text in pieces, the streaming finder answers what a search of the whole text would."""
    from expertcache.engine.generation import StopFinder, held_back

    finder = StopFinder(stops)
    for end in [*sorted(cuts), len(text)]:
        seen = text[:end]
        found, held = finder.feed(seen)
        hits = [i for s in stops if (i := seen.find(s)) >= 0]
        assert found == (min(hits) if hits else None)
        if not hits:
            assert held == held_back(seen, stops)
        if found is not None:
            break


def _cb_warpers(vocab: int):
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    )
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    return (
        ContinuousBatchingTopKLogitsWarper(TopKLogitsWarper(top_k=vocab)),
        ContinuousBatchingTopPLogitsWarper(TopPLogitsWarper(top_p=0.5)),
    )


@given(st.integers(0, 2**31 - 1), st.integers(1, 12))
def test_the_server_s_top_k_and_top_p_equal_transformers_bit_for_bit(seed, rows):
    """serve.warpers: every row of every kind (greedy, top-k, whole vocabulary, top-p below and at 1,
    ties, -inf scores) comes out as transformers' own sorting processors give it."""
    from expertcache.serve import warpers

    g = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(2, 300, (1,), generator=g))
    scores = torch.randn(rows, vocab, generator=g) * 3
    scores = torch.round(scores * 4) / 4  # ties
    scores[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    scores[torch.rand(rows, vocab, generator=g) < 0.05] = -200.0  # a probability of 0 in float32: top-p at 1
    scores[:, 0] = scores[:, 0].nan_to_num(neginf=0.0)  # every row keeps a finite score
    choices = torch.tensor([1, 1, 2, 5, vocab - 1, vocab, vocab + 7])
    k = choices[torch.randint(0, len(choices), (rows,), generator=g)].clamp(min=1).to(torch.int32)
    p = torch.tensor([1.0, 1.0, 0.95, 0.5, 0.1])[torch.randint(0, 5, (rows,), generator=g)]
    k_arg, p_arg = k.clone(), p.clone().view(torch.int32)
    top_k, top_p = _cb_warpers(vocab)
    want = top_p(top_k(scores.clone(), k_arg), p_arg)
    seen: dict = {}
    got = warpers.TopP(top_p, seen)(warpers.TopK(top_k, seen)(scores.clone(), k_arg), p_arg)
    assert torch.equal(got, want)
    alone = warpers.TopP(top_p, {})(scores.clone(), p_arg)  # no top-k before it: transformers' own
    assert torch.equal(alone, top_p(scores.clone(), p_arg))


def test_the_server_wraps_transformers_top_k_and_top_p(make_ckpt):
    from expertcache.serve import warpers

    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    try:
        batcher = batcher_module.Batcher(model, max_queue=4)
        try:
            kinds = [type(p) for p in batcher.manager.logit_processor.logits_processor]
            assert warpers.TopK in kinds and warpers.TopP in kinds
            assert kinds.index(warpers.TopK) < kinds.index(warpers.TopP)  # top-p reads top-k's k
        finally:
            batcher.close()
    finally:
        model.close()


def test_sdpa_without_cudnn_is_served_as_sdpa_with_cudnn_off_and_equals_the_model_alone(make_ckpt):
    """transformers' continuous batching refuses attention implementations it does not know by name (a
    new user's traceback at start): the server runs sdpa with cuDNN's attention off in its process, the
    same computation, and says sdpa_no_cudnn ran."""
    path = make_ckpt("mixtral")
    model = engine_load(path, 8, record=False, attention="sdpa_no_cudnn")
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        want = alone(model, PROMPTS[1], 6)
        with TestClient(create_app(model, "tiny", ServeConfig(max_queue=4)), base_url=BASE) as http:
            client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", http_client=http)
            r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6)
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert r.choices[0].text == model.tokenizer.decode(want, skip_special_tokens=True)
        assert (
            model.stats["attention"] == "sdpa_no_cudnn" and model.model.config._attn_implementation == "sdpa"
        )
        assert alone(model, PROMPTS[1], 6) == want  # generate after serving: the same tokens
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
        model.close()


def test_metrics_open_without_a_key_says_it_changes_nothing(capsys, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["serve", "--metrics-open", "--model", str(tmp_path / "none"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "note: --metrics-open changes nothing without an API key" in err


def test_serves_start_line_says_how_many_requests_a_small_kv_cache_holds_at_once(monkeypatch, capsys):
    """A new user's `--kv-cache-tokens 512` let 2 requests run at once (a 256-token page each, at least),
    the rest waiting, and nothing said so. The start line says it where the pages are fewer than the queue."""
    import expertcache.serve

    monkeypatch.setattr(expertcache.serve, "run", lambda model, name, config: True)  # no loop: the line
    assert main(["serve", "--port", "1", "--kv-cache-tokens", "512"]) == 0
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("serving ")]
    assert (
        line
        and "KV cache 512 tokens (2 pages of 256: at most 2 requests at once, the others wait)" in line[0]
    )
    assert main(["serve", "--port", "1", "--kv-cache-tokens", "512", "--max-queue", "2"]) == 0
    assert "requests at once" not in capsys.readouterr().err  # no more than it holds

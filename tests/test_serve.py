"""``expertcache serve`` with real clients: the ``openai`` package (completions, chat, streaming), raw HTTP
for bad input, concurrent requests batched together with a greedy request's tokens equal to the model's
alone, a full queue, a client that leaves, metrics, and a real server process stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import engine_fixtures
import openai
import pytest
from engine_fixtures import engine_load
from fastapi.testclient import TestClient

from expertcache.cli import main
from expertcache.config import SamplingConfig
from expertcache.serve.app import create_app

_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = ["hello world", "the quick brown fox", "jumps over", "a lazy dog"]


@pytest.fixture(scope="module")
def served(make_ckpt):
    """(model, TestClient, openai client) over a tiny Mixtral at 50% of its experts, no recording."""
    path = make_ckpt("mixtral")
    model = engine_load(path, 8, record=False)
    model.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(model, "tiny", max_queue=8)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
        yield model, http, client
    model.close()


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
        ({"model": "tiny", "prompt": "x", "temperature": 1, "seed": -1}, 400, "seed: Input should be"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400, "exceeds the model's context"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n:"),
        ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "not supported by this server: logprobs"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": "5"},
            400,
            "max_tokens: Input should be a valid integer",
        ),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(served, body, status, words):
    model, http, client = served
    r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    if err["code"] == "invalid_value" and ":" in err["message"]:  # a field: OpenAI's param names it
        field = err["message"].split(":")[0]
        assert err["param"] == (None if field == "body" else field)
    assert (
        http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


def test_malformed_json_bad_messages_and_unknown_routes(served):
    model, http, client = served
    r = http.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400
    assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()
    assert http.get("/health").json() == {"status": "ok"}


def test_a_client_that_leaves_cancels_its_request(served):
    model, http, client = served
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while "expertcache_cancelled_requests_total 0.0" in http.get("/metrics").text and time.time() < deadline:
        time.sleep(0.1)
    assert "expertcache_cancelled_requests_total 0.0" not in http.get("/metrics").text


def test_a_full_queue_answers_503(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    try:
        with TestClient(create_app(model, "tiny", max_queue=1)) as http:
            http.app.state.batcher.jobs["someone"] = None  # one request running: the queue is full
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
            del http.app.state.batcher.jobs["someone"]
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
    finally:
        model.close()


def test_an_api_key_is_required_when_set(make_ckpt):
    model = engine_load(make_ckpt("mixtral"), 8, record=False)
    try:
        with TestClient(create_app(model, "tiny", api_key="s3cret")) as http:
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert http.get("/health").status_code == 200  # health and metrics stay open
    finally:
        model.close()


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


def test_serve_bad_options_are_one_line(capsys):
    for argv, words in (
        [["serve", "--port", "0"], "--port"],
        [["serve", "--miss", "teleport"], "unknown miss"],
        [["serve", "--plan", "plan.json", "--policy", "lfu"], "--plan sets the expert memory"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]


def _metric(text: str, name: str) -> str:
    return next(line.split()[1] for line in text.splitlines() if line.startswith(name + " "))


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_server_answers_the_openai_client_and_stops_on_sigterm(ckpt):
    port = _free_port()
    cmd = [sys.executable, "-m", "expertcache.cli", "serve", "--model", str(ckpt("mixtral")),
           "--device", "cpu", "--port", str(port), "--expert-memory", "50%", "--quiet"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.time() + 120
        while True:
            try:
                name = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
                time.sleep(0.5)
        r = client.completions.create(model=name, prompt="hello", max_tokens=3)
        assert r.usage.completion_tokens >= 1
        impatient = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=0.3
        )
        with pytest.raises(openai.APITimeoutError):  # a plain request whose client leaves is cancelled
            impatient.completions.create(model=name, prompt="hello", max_tokens=900)
        metrics = f"http://127.0.0.1:{port}/metrics"
        deadline = time.time() + 30
        while "expertcache_cancelled_requests_total 1.0" not in _get(metrics) and time.time() < deadline:
            time.sleep(0.2)
        assert "expertcache_cancelled_requests_total 1.0" in _get(metrics)
        stream = iter(client.completions.create(model=name, prompt="hello", max_tokens=900, stream=True))
        next(stream)  # a request in flight when the signal comes
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):  # not a quiet, seemingly finished end
            for _ in stream:
                pass
        proc.wait(timeout=15)
        assert time.time() - start < 10 and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.dumps(name)

"""``raykv serve`` through real HTTP clients: the official ``openai`` client and ``curl``.
One server (one replica, an API key) for the module, on the session's Ray."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from raykv.config import load_config  # noqa: E402

KEY = "test-key-0123456789"
PORT = 8123


@pytest.fixture(scope="module")
def server(ray_session, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from raykv.serve.app import ServeOptions, Server

    pool_dir = tmp_path_factory.mktemp("shards")
    cfg = load_config(
        None,
        [
            f"model.path={tiny_chat_model}",
            "model.dtype=float32",
            "cache.num_gpu_blocks=96",
            "cache.block_size=16",
            f"offload.shared_pool_dir={pool_dir}",
        ],
    )
    srv = Server(cfg, ServeOptions(port=PORT, replicas=1, api_key=KEY)).start()
    srv.pool_dir = pool_dir
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, tiny_chat_model: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_chat_model.name]


def test_chat_streamed_and_whole_give_the_same_greedy_answer(client) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = {"model": model_id(client), "messages": messages, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = whole.usage
    assert 0 < usage.completion_tokens <= 12 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens  # the usage chunk


def test_completions_take_token_ids_and_report_logprobs(client) -> None:
    out = client.completions.create(
        model=model_id(client), prompt=[1, 2, 3, 4, 5], max_tokens=6, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 6
    assert "".join(lp.tokens) == choice.text
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4) or token not in top
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_a_stop_string_ends_the_text_before_it(client) -> None:
    kwargs = {"model": model_id(client), "prompt": "Once upon a time", "temperature": 0}
    full = client.completions.create(**kwargs, max_tokens=24).choices[0].text
    # a stop string from the middle of the greedy answer
    stop = next((full[i : i + 3] for i in range(3, len(full) - 3) if full[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip(f"the answer {full!r} has no usable stop string")
    cut = full[: full.index(stop)]
    for stream in (False, True):
        out = client.completions.create(**kwargs, max_tokens=24, stop=[stop], stream=stream)
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_a_repeated_prompt_reports_its_cached_tokens(client) -> None:
    prompt = "The history of the city begins " * 12  # several blocks of 16 tokens
    first = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=2)
    again = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    details = again.usage.prompt_tokens_details
    cached = details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens
    # raykv's own keys say where they came from: no disk tier here, so GPU and CPU alone
    where = details.model_extra
    assert where["disk_tier_tokens"] == 0
    assert where["gpu_cache_tokens"] + where["cpu_tier_tokens"] == cached


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "temperature": 3}, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),  # a token id outside the vocabulary
        ({"prompt": "hi " * 3000, "max_tokens": 4}, "prompt"),  # longer than the pool holds
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(client, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id(client), **body)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_a_chat_message_with_a_bad_role_names_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id(client), messages=[{"role": "robot", "content": "x"}]
        )
    assert info.value.body["param"] == "messages"
    assert "messages[0].role" in info.value.body["message"]


def test_a_wrong_or_missing_key_is_a_401_and_an_unknown_model_a_404(server, client) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert KEY not in json.dumps(info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_streams_server_sent_events(server, client) -> None:
    body = {"model": model_id(client), "prompt": "Hello", "max_tokens": 4, "stream": True}
    done = subprocess.run(
        [
            "curl", "-sS", "-N", f"{server.url}/v1/completions",
            "-H", f"Authorization: Bearer {KEY}",
            "-H", "Content-Type: application/json",
            "-d", json.dumps(body),
        ],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    events = [line[6:] for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    health = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"{server.url}/health"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert health.stdout == "200"
    unauthorized = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"{server.url}/v1/models"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    payload, code = unauthorized.stdout.rsplit("\n", 1)
    assert code == "401" and json.loads(payload)["error"]["type"] == "authentication_error"


def test_each_replicas_metrics_carry_its_id(client, ray_session) -> None:
    import re
    import time
    import urllib.request

    answer = client.completions.create(model=model_id(client), prompt="Metrics", max_tokens=2)
    replica = answer.system_fingerprint.removeprefix("raykv-")
    pattern = re.compile(rf'^ray_raykv_prompt_tokens_total\{{[^}}]*replica="{replica}"[^}}]*\}} ')
    deadline = time.monotonic() + 90  # Ray exports every ~10 s
    while time.monotonic() < deadline:
        body = urllib.request.urlopen(ray_session.metrics_url, timeout=10).read().decode()
        if any(pattern.match(line) for line in body.splitlines()):
            return
        time.sleep(2)
    raise AssertionError(f"no raykv_prompt_tokens series labelled replica={replica!r}")


def test_while_serving_nothing_listens_beyond_loopback(server) -> None:
    """Everything raykv and Ray start listens on loopback, the HTTP server too, and Ray Serve's
    inter-deployment gRPC server in each replica, which Serve 2.60 binds to ``[::]:0`` in its
    own code: raykv's deployments bind it to the node's address (``serve/grpc_bind.py``); it
    listened on every interface before."""
    from tests.listeners import exposed_listeners

    pytest.importorskip("psutil")
    exposed = exposed_listeners()
    assert not exposed, f"listening beyond loopback: {exposed}"

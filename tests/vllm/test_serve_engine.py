"""``raykv serve --engine vllm``: two vLLM replicas (each vLLM's ``AsyncLLM`` with raykv's CPU
tier as its offloading spec, its engine core a process of its own, one core each) behind
raykv's ingress and KV-aware router, asked through the official openai client on loopback.

vLLM's own prefix cache is off here, so every cached prompt token comes from raykv's tier, the
split per tier in ``usage.prompt_tokens_details`` is the manager's own report, and the router's
only knowledge of where a prompt is comes from the tier's events in vLLM's KV event stream."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt_text

openai = pytest.importorskip("openai")


from raykv.config import load_config  # noqa: E402
from tests.serve.test_replicas import engine_handle, kill_replica  # noqa: E402

PORT = 8131
KEYS = "alpha-key,beta-key"
RESTART_S = 180.0


def served(model: Path, *extra: str) -> list[str]:
    """The overrides of a small vLLM replica with raykv's CPU tier, vLLM's prefix cache off."""
    return [
        f"model.path={model}",
        "serve.engine=vllm",
        "serve.vllm.dtype=float32",
        "serve.vllm.enforce_eager=true",
        "serve.vllm.max_model_len=2048",
        "serve.vllm.kv_cache_memory_bytes=64MiB",
        "serve.vllm.enable_prefix_caching=false",
        "offload.enabled=true",
        "offload.cpu_bytes=48MiB",
        "offload.events=true",
        "offload.take_hits=always",
        # below the ingress's own limit (20): a request between the two reaches vLLM's check
        "serve.vllm.max_logprobs=5",
        *extra,
    ]


@pytest.fixture(scope="module")
def server(ray_session, vllm_model: Path):
    from raykv.serve.app import ServeOptions, Server

    cfg = load_config(None, served(vllm_model))
    options = ServeOptions(port=PORT, replicas=2, router="kv", api_key=KEYS)
    srv = Server(cfg, options).start()
    yield srv
    srv.stop()


def client_of(server, key: str = "alpha-key"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def client(server):
    return client_of(server)


def chat(client, messages, **kwargs):
    model = client.models.list().data[0].id
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)


def replica_infos(tries: int = 40) -> dict[str, dict]:
    handle = engine_handle()
    out = {}
    for _ in range(tries):
        info = handle.info.remote().result(timeout_s=60)
        out[info["replica"]] = info
    return out


def test_each_replica_runs_vllm_on_a_core_of_its_own(server) -> None:
    infos = replica_infos()
    assert len(infos) == 2
    assert all(info["engine"] == "vllm" for info in infos.values())
    cores = [tuple(info["cores"]) for info in infos.values()]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores


def test_the_openai_client_streams_and_gets_logprobs_and_the_tier_split(client) -> None:
    messages = [{"role": "user", "content": prompt_text(1, words=300)}]
    first = chat(client, messages, logprobs=True, top_logprobs=3)
    choice = first.choices[0]
    assert first.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    tokens = choice.logprobs.content
    assert len(tokens) == first.usage.completion_tokens == 8
    for token in tokens:
        assert len(token.top_logprobs) == 3  # within vLLM's max_logprobs (5)
        ranked = [t.logprob for t in token.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        assert token.logprob <= ranked[0] + 1e-4  # greedy: the sampled token is the top one
        assert token.logprob >= ranked[0] - 1e-4
    assert "".join(t.token for t in tokens) == choice.message.content
    # the same prompt again, streamed: its whole blocks come from raykv's CPU tier (vLLM's
    # prefix cache is off), and the answer is the same
    time.sleep(1)  # the store lands as the engine steps on
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == choice.message.content
    details = usage.prompt_tokens_details
    whole = (usage.prompt_tokens - 1) // 128 * 128
    assert details.cached_tokens == whole
    assert details.model_extra["cpu_tier_tokens"] == whole
    assert details.model_extra["gpu_cache_tokens"] == 0


def test_a_repeated_conversation_turn_goes_to_the_replica_whose_tier_holds_it(client) -> None:
    conversations = [
        [{"role": "system", "content": prompt_text(10 + i, words=200)}] for i in range(4)
    ]
    served_by: dict[int, str] = {}
    for turn in range(2):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Question {turn} for helper {i}?"})
            answer = chat(client, messages)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            replica = answer.system_fingerprint
            if turn == 0:
                served_by[i] = replica
                continue
            assert replica == served_by[i], f"conversation {i} moved"
            cpu = answer.usage.prompt_tokens_details.model_extra["cpu_tier_tokens"]
            assert cpu >= 128, f"conversation {i}: {cpu} tokens from the CPU tier"
        time.sleep(1)  # the stores land and their events reach the router
    assert len(set(served_by.values())) == 2  # the router spread the new conversations


def test_another_tenant_gets_nothing_of_the_first_tenants_cache(server) -> None:
    alpha, beta = client_of(server, "alpha-key"), client_of(server, "beta-key")
    messages = [{"role": "user", "content": prompt_text(30, words=300)}]
    chat(alpha, messages)
    time.sleep(1)
    again = chat(alpha, messages)
    assert again.usage.prompt_tokens_details.cached_tokens >= 128
    other = chat(beta, messages)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    # a cache_salt of the request's own isolates within one tenant too
    salted = chat(alpha, messages, extra_body={"cache_salt": "another-salt"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_what_vllm_refuses_is_a_400_naming_the_field(client) -> None:
    # 8 passes the ingress (20 at most) and the replica's vLLM refuses it (max_logprobs 5)
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=8)
    assert caught.value.body["param"] == "top_logprobs"
    assert "max_logprobs" in str(caught.value)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="hi", max_tokens=2, logprobs=8)
    assert caught.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": prompt_text(2, words=200)}], max_tokens=4000)
    assert "max_tokens" in str(caught.value)
    # and the replica serves on
    assert chat(client, [{"role": "user", "content": "still there?"}]).choices[0].message


def test_a_killed_replica_ends_its_stream_in_an_error_and_the_other_serves_on(client) -> None:
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT

    engine_cores = {info["replica"]: info["engine_core"] for info in replica_infos().values()}
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count from one to one thousand."}],
        max_tokens=1500,
        temperature=0,
        stream=True,
    )
    victim, received = None, 0
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received += 1
            if victim is None and chunk.system_fingerprint:
                victim = chunk.system_fingerprint.removeprefix("raykv-")
                kill_replica(victim)
    assert victim is not None and received < 1500
    for i in range(3):
        answer = chat(client, [{"role": "user", "content": f"After the loss, question {i}."}])
        assert answer.system_fingerprint != f"raykv-{victim}"
    # the killed replica's engine core does not outlive it
    deadline = time.monotonic() + 30
    while _alive(engine_cores[victim]):
        assert time.monotonic() < deadline, "the killed replica's engine core lives on"
        time.sleep(0.5)
    deadline = time.monotonic() + RESTART_S
    while (
        serve.status()
        .applications[APP_NAME]
        .deployments[ENGINE_DEPLOYMENT]
        .replica_states.get("RUNNING", 0)
        < 2
    ):
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(1)
    # a process killed outright leaves what vLLM's engine core had in /dev/shm (its
    # semaphores): nothing alive maps them any more
    from raykv.serve.vllm_replica import sweep_orphan_shared_memory

    sweep_orphan_shared_memory(0, prefixes=("psm_", "sem.mp-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_health_tells_the_truth(server) -> None:
    import urllib.request

    with urllib.request.urlopen(server.url + "/health", timeout=30) as answer:
        assert answer.status == 200

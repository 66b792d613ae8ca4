"""``raykv serve --engine vllm`` across a stop and with the shared tier: a replica's stop (what
SIGTERM of ``raykv serve`` does: ``Server.stop``) leaves its CPU tier's chunks in the disk tier
(written through), and the next replica on that path answers a repeated prompt from there;
two replicas sharing the cluster's tier (a Mooncake master) load each other's chunks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.vllm.conftest import prompt_text
from tests.vllm.test_serve_engine import served

openai = pytest.importorskip("openai")

from raykv.config import load_config  # noqa: E402

PORT = 8132


def ask(server, prompt: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)


def test_a_stopped_replica_leaves_its_chunks_on_disk_and_the_next_answers_from_there(
    ray_session, vllm_model: Path, tmp_path: Path
) -> None:
    from raykv.serve.app import ServeOptions, Server

    disk = tmp_path / "disk"
    sets = served(
        vllm_model,
        "serve.vllm.enable_prefix_caching=true",
        "offload.disk.enabled=true",
        f"offload.disk.path={disk}",
        "offload.disk.capacity=64MiB",
    )
    prompt = prompt_text(40, words=300)
    server = Server(load_config(None, sets), ServeOptions(port=PORT)).start()
    try:
        first = ask(server, prompt)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(2)  # the through-writes land
    finally:
        server.stop()
    assert list(disk.rglob("*.kv")), "the stop left nothing on disk"
    server = Server(load_config(None, sets), ServeOptions(port=PORT)).start()
    try:
        again = ask(server, prompt)
    finally:
        server.stop()
    details = again.usage.prompt_tokens_details
    whole = (again.usage.prompt_tokens - 1) // 128 * 128
    assert details.model_extra["disk_tier_tokens"] == details.cached_tokens == whole
    assert again.choices[0].text == first.choices[0].text


def test_with_the_shared_tier_the_other_replica_loads_what_one_published(
    ray_session, vllm_model: Path, shared_store: str
) -> None:
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT, ServeOptions, Server

    sets = served(
        vllm_model,
        "offload.shared.enabled=true",
        f"offload.shared.master={shared_store}",
        "offload.shared.mount=false",
        "offload.shared.segment=64MiB",
    )
    # power of two choices: the KV router would keep the prompt where its CPU tier holds it
    options = ServeOptions(port=PORT, replicas=2, router="pow2")
    server = Server(load_config(None, sets), options).start()
    try:
        prompt = prompt_text(41, words=300)
        first = ask(server, prompt)
        time.sleep(2)  # the publish lands
        # each replica asked directly (no router between): the one that did not compute it
        # loads it from the store
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        seen = {}
        for _ in range(40):
            info = handle.info.remote().result(timeout_s=60)
            seen[info["replica"]] = info
        (other,) = [r for r in seen if f"raykv-{r}" != first.system_fingerprint]
        answer = None
        for _ in range(20):  # until pow2 sends the prompt to the other replica
            answer = ask(server, prompt)
            if answer.system_fingerprint == f"raykv-{other}":
                break
        assert answer is not None and answer.system_fingerprint == f"raykv-{other}"
        details = answer.usage.prompt_tokens_details
        assert details.model_extra["shared_tier_tokens"] >= 128
        assert answer.choices[0].text == first.choices[0].text
    finally:
        server.stop()

"""Two replicas on two Ray nodes behind the KV-aware router: each replica on a node of its own
(a one-per-node resource places them), conversations kept where their KV is, and a replica
killed mid-stream: its stream ends in an error (not retried: part of the answer is out), the
other replica goes on serving at once, and Serve brings a new one up. With the shared tier on
(where Mooncake Store starts here): one store actor per node, and a conversation whose replica
was killed goes on at the other node's replica, which loads its history from the store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

import ray  # noqa: E402

from raykv.config import load_config  # noqa: E402
from tests.serve.nodes import add_node, remove_node  # noqa: E402

PORT = 8125
SLOT = "raykv-test-replica-slot"
RESTART_S = 120.0


def _shared_tier() -> list[str]:
    from raykv.transfer.shared_store import mooncake_problem

    if mooncake_problem() is not None:
        return []
    # every hit loaded: the store's part is tested, not the scheduler's choice of it
    return [
        "offload.shared.enabled=true",
        "offload.shared.segment=128MiB",
        "offload.take_hits=always",
    ]


SHARED = _shared_tier()


@pytest.fixture(scope="module")
def nodes(ray_session):
    added = []
    try:
        for _ in range(2):
            added.append(add_node(num_cpus=2, resources={SLOT: 1}))
        yield added
    finally:
        for node in added:
            remove_node(node)


@pytest.fixture(scope="module")
def server(nodes, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from raykv.serve.app import ServeOptions, Server

    cfg = load_config(
        None,
        [
            f"model.path={tiny_chat_model}",
            "model.dtype=float32",
            "cache.num_gpu_blocks=96",
            f"offload.shared_pool_dir={tmp_path_factory.mktemp('shards')}",
            *SHARED,
        ],
    )
    options = ServeOptions(port=PORT, replicas=2, router="kv", replica_resources={SLOT: 1})
    srv = Server(cfg, options).start()
    yield srv
    srv.stop()
    if SHARED:  # before the nodes go: their store actors would wait for them to come back
        from raykv.cluster.shared_store import stop_shared_store

        stop_shared_store()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def engine_handle():
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)


def replicas_seen(tries: int = 40) -> dict[str, str]:
    """Replica id -> node id, from calls that go by power of two choices (no prompt)."""
    handle = engine_handle()
    out = {}
    for _ in range(tries):
        info = handle.info.remote().result(timeout_s=60)
        out[info["replica"]] = info["node"]
    return out


def chat(client, messages: list[dict[str, str]], **kwargs):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, **kwargs
    )


def test_the_replicas_run_on_two_nodes_of_their_own(server, nodes) -> None:
    where = replicas_seen()
    assert len(where) == 2
    assert set(where.values()) == {node.node_id for node in nodes}


def test_conversations_stay_with_the_replica_that_holds_their_kv(client) -> None:
    conversations = [
        [{"role": "system", "content": f"You answer as helper {i}. " * 12}] for i in range(4)
    ]
    served_by: dict[int, str] = {}
    for turn in range(3):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Question {turn} for helper {i}?"})
            answer = chat(client, messages)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            replica = answer.system_fingerprint
            assert replica and replica.startswith("raykv-")
            if turn == 0:
                served_by[i] = replica
                continue
            # each later turn extends the one before: the router sends it back to that KV
            assert replica == served_by[i], f"conversation {i} turn {turn} moved"
            cached = answer.usage.prompt_tokens_details.cached_tokens
            assert cached >= 16, f"conversation {i} turn {turn}: {cached} cached tokens"


def test_issue28_3_a_killed_kv_feed_is_replaced_and_conversations_keep_their_replica(
    client,
) -> None:
    from raykv.serve.kv_router import EXPECTED_S

    conversations = [
        [{"role": "system", "content": f"You answer as reviewer {i}. " * 12}] for i in range(6)
    ]
    served_by = {}
    for i, messages in enumerate(conversations):
        messages.append({"role": "user", "content": f"First question for reviewer {i}?"})
        answer = chat(client, messages)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        served_by[i] = answer.system_fingerprint.removeprefix("raykv-")
    victim = served_by[0]
    (feed,) = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("raykv-kv-feed:") and a["name"].endswith(victim)
    ]
    dead = ray.get_actor(feed["name"], namespace=feed["namespace"])
    ray.kill(dead, no_restart=True)
    deadline = time.monotonic() + RESTART_S
    while True:  # the replica makes a new feed under the same name
        try:
            fresh = ray.get_actor(feed["name"], namespace=feed["namespace"])
            if fresh._actor_id != dead._actor_id:
                break
        except ValueError:
            pass
        assert time.monotonic() < deadline, "the killed feed was not replaced"
        time.sleep(0.2)
    time.sleep(EXPECTED_S + 1)  # what the router expected from its own routing has expired
    for i, messages in enumerate(conversations):
        messages.append({"role": "user", "content": f"Second question for reviewer {i}?"})
        answer = chat(client, messages)
        # the router mirrors the victim again: each conversation goes back to its KV
        assert answer.system_fingerprint == f"raykv-{served_by[i]}", f"conversation {i} moved"
        assert answer.usage.prompt_tokens_details.cached_tokens >= 16


def test_a_killed_replica_ends_its_stream_in_an_error_and_the_other_serves_on(client) -> None:
    messages = [{"role": "user", "content": "Count slowly from one to one thousand."}]
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1200, temperature=0, stream=True
    )
    victim = None
    received = 0
    with pytest.raises(openai.APIError):  # the SSE error event the ingress sends
        for chunk in stream:
            received += 1
            if victim is None and chunk.system_fingerprint:
                victim = chunk.system_fingerprint.removeprefix("raykv-")
                kill_replica(victim)
    assert victim is not None and received < 1200
    # at once: another conversation is answered, by the replica that lives
    for i in range(3):
        answer = chat(client, [{"role": "user", "content": f"After the loss, question {i}."}])
        assert answer.system_fingerprint != f"raykv-{victim}"
    # and Serve replaces the dead one: two replicas again, the new one serving
    wait_for_two_replicas(victim)


def test_a_conversation_whose_replica_died_loads_its_history_from_the_store(client, nodes) -> None:
    if not SHARED:
        pytest.skip("the shared tier's store cannot start here")
    from raykv.cluster.runtime import NAMESPACE
    from raykv.cluster.shared_store import STORE_PREFIX

    stores = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == NAMESPACE
    }
    assert {STORE_PREFIX + node.node_id for node in nodes} <= stores  # one per node
    messages = [
        {"role": "system", "content": "You answer as the archivist. " * 16},
        {"role": "user", "content": "Where are the old maps kept?"},
    ]
    first = chat(client, messages)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "And the letters?"})
    time.sleep(2)  # its stores, and their publishes to the store, land
    victim = first.system_fingerprint.removeprefix("raykv-")
    kill_replica(victim)
    second = chat(client, messages)  # the KV router's choice is gone: the other replica
    assert second.system_fingerprint != first.system_fingerprint
    details = second.usage.prompt_tokens_details
    from_store = int((details.model_extra or {}).get("shared_tier_tokens", 0))
    assert from_store >= 64, f"{from_store} tokens from the store"
    wait_for_two_replicas(victim)


def wait_for_two_replicas(victim: str) -> None:
    """Until Serve replaced the killed replica and this process's handle routes to it."""
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT

    deadline = time.monotonic() + RESTART_S
    while True:
        status = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {status}"
        time.sleep(1)
    while len(where := replicas_seen()) < 2:  # until this process's handle has it too
        assert time.monotonic() < deadline, f"the new replica is not routed to: {where}"
        time.sleep(1)
    assert victim not in where


def kill_replica(unique_id: str) -> None:
    (named,) = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if unique_id in a["name"] and a["name"].startswith("SERVE_REPLICA")
    ]
    ray.kill(ray.get_actor(named["name"], namespace=named["namespace"]), no_restart=True)

"""A server's end: stopping it takes its replica, the replica's rank actors and their CPU-pool
shard files with it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from raykv.config import load_config  # noqa: E402
from raykv.transfer.pool_files import process_alive  # noqa: E402

PORT = 8124


def test_stopping_the_server_leaves_no_rank_process_and_no_shard_file(
    ray_session, tiny_chat_model: Path, tmp_path: Path
) -> None:
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT, ServeOptions, Server

    cfg = load_config(
        None,
        [
            f"model.path={tiny_chat_model}",
            "model.dtype=float32",
            "cache.num_gpu_blocks=64",
            "parallel.tensor_parallel_size=2",
            f"offload.shared_pool_dir={tmp_path}",
        ],
    )
    server = Server(cfg, ServeOptions(port=PORT)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(
            model=tiny_chat_model.name, prompt="Hi", max_tokens=3, temperature=0
        )
        assert out.usage.completion_tokens == 3
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME)
        pids = handle.rank_processes.remote().result(timeout_s=60)
        assert len(pids) == 2 and all(process_alive(p) for p in pids)
        assert len(list(tmp_path.iterdir())) == 2  # one shard file per rank
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(process_alive(p) for p in pids)
    assert list(tmp_path.iterdir()) == []

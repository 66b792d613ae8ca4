"""raykv inside real vLLM (its CPU build), in this process: vLLM's engine, its scheduler and its
worker all run here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one engine at a time, on a tiny
random Llama with SmolLM2's real tokenizer (vLLM's CPU attention wants heads of 32 or more)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serve.conftest import tiny_llama

pytest.importorskip("vllm", reason="vLLM is not installed (make vllm installs its CPU build)")

from raykv.vllm.local import transfer_config  # after the skip: it imports vllm

# one process; one OpenMP thread (more oversubscribe the 2 cores: 30x slower, measured)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")

BLOCK_TOKENS = 128  # what vLLM's CPU attention picks for these models


@pytest.fixture(scope="package", autouse=True)
def _private_temp_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A temporary directory of these tests' own for what vLLM leaves there (its engines' IPC
    sockets, torch.distributed's ``vllm_dist_*`` rendezvous files), removed when they end:
    nothing another process keeps in the system's is touched. pytest's own directory is fixed
    first, in the system's, so the tests' files outlive it as pytest keeps them."""
    tmp_path_factory.getbasetemp()
    private = tempfile.mkdtemp(prefix="raykv-vllm-tests-")
    before = (tempfile.tempdir, os.environ.get("TMPDIR"), os.environ.get("VLLM_RPC_BASE_PATH"))
    tempfile.tempdir = private
    os.environ["TMPDIR"] = os.environ["VLLM_RPC_BASE_PATH"] = private
    try:
        yield
    finally:
        tempfile.tempdir = before[0]
        for name, value in (("TMPDIR", before[1]), ("VLLM_RPC_BASE_PATH", before[2])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory, smollm2_hf_tokenizer) -> Path:
    """Random two-layer Llama weights (heads of 32) with SmolLM2's tokenizer, as vLLM reads a
    Hugging Face directory."""
    out = tmp_path_factory.mktemp("vllm-tiny-llama")
    return tiny_llama(out, smollm2_hf_tokenizer, context=4096, seed=0, hidden_size=128)


@contextlib.contextmanager
def engine(
    model: Path,
    raykv: dict[str, Any] | None,
    prefix_caching: bool = True,
    connector: dict[str, Any] | None = None,
    **overrides: Any,
) -> Iterator:
    """A vLLM engine on ``model`` with raykv's tiers configured by ``raykv``; shut down after.
    ``connector``: more of ``kv_connector_extra_config`` (raykv's faults); ``overrides``: other
    arguments of ``LLM`` (the KV cache's size, the longest prompt)."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    arguments: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory_bytes": 64 << 20,
        "max_model_len": 2048,
        "seed": 0,
        # no torch.compile: 7 s less per engine, and the tiers move the same bytes (the
        # benchmark measures the compiled engine)
        "enforce_eager": True,
    }
    if raykv is not None and "take_hits" not in raykv:
        # every hit loaded: the tiers are tested, not the choice (test_worth.py tests that)
        raykv = {**raykv, "take_hits": "always"}
    llm = LLM(
        model=str(model),
        kv_transfer_config=transfer_config(raykv, **(connector or {})),
        enable_prefix_caching=prefix_caching,
        **{**arguments, **overrides},
    )
    try:
        yield llm
    finally:
        del llm
        ensure_kv_transfer_shutdown()  # vLLM's worker connector is process-global
        cleanup_dist_env_and_memory()
        gc.collect()


def manager_of(llm):
    """raykv's manager inside ``llm``'s scheduler (one process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager


def worker_of(llm):
    """raykv's worker inside ``llm``'s (only) worker (one process)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def prompt_text(seed: int, words: int = 170) -> str:
    """A prompt of real words (about 2.7 tokens a word with SmolLM2's tokenizer)."""
    vocabulary = [
        *("river", "stone", "lantern", "quiet", "orbit", "maple", "copper", "signal", "harbor"),
        *("violet", "thunder", "meadow", "saddle", "glacier", "ember", "puzzle", "falcon"),
        *("cinder", "willow", "beacon"),
    ]
    return " ".join(
        f"{vocabulary[(seed * 7 + i * 3) % len(vocabulary)]}{(seed + i) % 11}" for i in range(words)
    )


def answers(
    llm, prompts: list[str], max_tokens: int = 4
) -> list[tuple[list[int], list[float], int]]:
    """Per prompt (all in one batch, so their lookups, loads and stores interleave): greedy
    tokens, each one's logprob, and the prompt tokens vLLM did not compute."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    found = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = list(out.outputs[0].token_ids)
        steps = out.outputs[0].logprobs
        logprobs = [step[token].logprob for step, token in zip(steps, tokens, strict=True)]
        found.append((tokens, logprobs, out.num_cached_tokens or 0))
    return found


def answer(llm, prompt: str, max_tokens: int = 4) -> tuple[list[int], list[float], int]:
    """Greedy tokens, each one's logprob, and the prompt tokens vLLM did not compute."""
    return answers(llm, [prompt], max_tokens)[0]


def settle(llm) -> None:
    """Run one more request: a store is submitted the step after its blocks fill, and lands
    while a later step runs."""
    from vllm import SamplingParams

    llm.generate(["settle " * 40], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.generate(["again " * 40], SamplingParams(max_tokens=2), use_tqdm=False)


def drain(llm, timeout_s: float = 60.0) -> None:
    """Step until no store of raykv's is in flight (``local.stores_landed``: each tier's writes
    land only as later steps poll them; the disk's run on threads of the lowest priority)."""
    from raykv.vllm.local import stores_landed

    if not stores_landed(llm, lambda i: [100 + i % 50], timeout_s, pause_s=0.01):
        raise AssertionError("raykv's stores did not land")

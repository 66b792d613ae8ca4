"""A vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with raykv's spec or
without, for the benchmark and the tests: its scheduler, its worker and raykv's halves all
live here, so both halves can be read directly."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

SPEC = {"spec_name": "RaykvOffloadingSpec", "spec_module_path": "raykv.vllm"}


def one_process() -> None:
    """vLLM's engine core in this process (set before vLLM starts one)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def connector_config(raykv: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """vLLM's connector config, as the dictionary ``--kv-transfer-config`` takes, with raykv's
    spec and settings ``raykv`` (``extra``: more of ``kv_connector_extra_config``); a failed
    load is recomputed."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**SPEC, "raykv": raykv, **extra},
    }


def transfer_config(raykv: dict[str, Any] | None, **extra: Any) -> Any:
    """``connector_config`` as vLLM's ``KVTransferConfig`` (None: no offloading)."""
    from vllm.config import KVTransferConfig

    if raykv is None:
        return None
    return KVTransferConfig(**connector_config(raykv, **extra))


@contextlib.contextmanager
def local_engine(
    model: str, raykv: dict[str, Any] | None, extra: dict[str, Any] | None = None, **kwargs: Any
) -> Iterator[Any]:
    """vLLM's ``LLM`` on ``model`` in this process with raykv's tiers as ``raykv`` configures
    them (None: vLLM alone); ``kwargs`` go to ``LLM``. Shut down after, so the next may start
    (vLLM's connector and distributed state are global to the process)."""
    one_process()
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm = LLM(model=model, kv_transfer_config=transfer_config(raykv, **(extra or {})), **kwargs)
    try:
        yield llm
    finally:
        del llm
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
        gc.collect()


def manager_of(llm: Any) -> Any:
    """raykv's manager inside ``llm``'s scheduler."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager


def worker_of(llm: Any) -> Any:
    """raykv's worker inside ``llm``'s (only) worker."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def generate_s(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds ``llm`` takes to answer these token-id prompts, ``max_tokens`` each (greedy,
    past any end-of-sequence token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def stores_landed(
    llm: Any,
    prompt_of: Callable[[int], list[int]],
    timeout_s: float = 60.0,
    pause_s: float = 0.0,
) -> bool:
    """Step ``llm`` with one-token requests (``prompt_of(i)``: the i-th, too short to store)
    until no store of raykv's is being written: a store lands only as later steps poll it.
    False where some still are after ``timeout_s``."""
    tiers = [tier for _, tier, _ in manager_of(llm)._tiers()]
    deadline = time.monotonic() + timeout_s
    i = 0
    while not all(tier.stats().writing == 0 for tier in tiers):
        if time.monotonic() > deadline:
            return False
        if i and pause_s:  # between two steps (none after the one that found them landed)
            time.sleep(pause_s)
        generate_s(llm, [prompt_of(i)], 1)
        i += 1
    return True

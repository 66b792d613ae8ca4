"""Shared test settings."""

from __future__ import annotations

import os
import shutil
import tempfile
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
def ray_session():
    """One local Ray for the whole test session (starting it costs seconds; actors cost more),
    shared by the cluster and the serving tests."""
    from raykv.cluster.runtime import connect

    handle = connect(num_cpus=8)
    yield handle
    handle.shutdown()

"""One local Ray for the whole test session (starting it costs seconds; actors cost more)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    from raykv.cluster.runtime import connect

    handle = connect(num_cpus=8)
    yield handle
    handle.shutdown()

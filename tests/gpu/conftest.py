"""GPU tests: skipped, all of them, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)"
    )
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)

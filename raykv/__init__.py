"""raykv: a Ray-native KV-cache offloading engine for multi-GPU LLM serving.

The package's face: :func:`load_config` reads and validates a YAML config, :class:`RequestSpec`
is a request before it enters the engine, and :class:`RaykvClient` starts a deployment on Ray and
runs or serves requests. ``import raykv`` imports neither ray nor torch: ``RaykvClient`` (and
with it ray) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raykv.config import load_config
from raykv.workload.requests import RequestSpec

if TYPE_CHECKING:
    from raykv.cluster.client import RaykvClient

__version__ = "0.1.0"

__all__ = ["RaykvClient", "RequestSpec", "__version__", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "RaykvClient":
        from raykv.cluster.client import RaykvClient

        globals()[name] = RaykvClient
        return RaykvClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The YAML configuration: pydantic models with strict validation.

Unknown keys are errors, and every error names the offending key path and the value found there,
e.g. ``offload.cpu_bytes: not a size ... (got '2XB')``. Sizes accept plain integers (bytes) or a
number with a unit: ``512KiB``, ``2GiB``, ``1.5GB``.
"""

from raykv.config.base import ByteSize, ConfigError, parse_size
from raykv.config.loading import RaykvConfig, apply_overrides, load_config
from raykv.config.sections import (
    CacheConfig,
    EngineConfig,
    GroupConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    RouterWeightsConfig,
    SchedulePolicy,
    ServeConfig,
    WorkloadConfig,
)

__all__ = [
    "ByteSize",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "GroupConfig",
    "ModelConfig",
    "OffloadConfig",
    "ParallelConfig",
    "RaykvConfig",
    "RouterWeightsConfig",
    "SchedulePolicy",
    "ServeConfig",
    "WorkloadConfig",
    "apply_overrides",
    "load_config",
    "parse_size",
]

"""raykv's settings inside vLLM: its ``offload`` section, read from vLLM's connector config.

``kv_connector_extra_config`` holds either ``"raykv": {...}`` (the keys of ``raykv run``'s
``offload`` section, with the same defaults and checks) or ``"raykv_config": "<file>.yaml"`` (a
raykv config file whose ``offload`` section is used). Errors name the key as ``raykv.<key>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from raykv.config import ConfigError
from raykv.config.loading import error_lines, load_config
from raykv.config.sections import OffloadConfig

# where raykv's settings sit in kv_connector_extra_config
INLINE = "raykv"
FILE = "raykv_config"
# what vLLM decides itself inside vLLM, with the key of vLLM's that does
DECIDED_BY_VLLM = {
    "enabled": "the kv_transfer_config itself",
    "blocks_per_chunk": "kv_connector_extra_config's block_size (tokens per offloaded chunk)",
    "load_in_step": "vLLM's scheduler (a load always lands before its request runs)",
}
# what raykv's engine has and the spec does not, with why
NOT_INSIDE_VLLM = {
    ("shared", "publish", "back"): "the shared tier publishes as the CPU tier stores (through): "
    "vLLM's manager hands its CPU evictions over without a job that could publish them first",
}


def offload_settings(extra_config: Mapping[str, Any]) -> OffloadConfig:
    """raykv's offload section from vLLM's ``kv_connector_extra_config`` (``ConfigError``
    naming the key at fault)."""
    inline, path = extra_config.get(INLINE), extra_config.get(FILE)
    if inline is not None and path is not None:
        raise ConfigError(f"kv_connector_extra_config: set {INLINE} or {FILE}, not both")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{FILE}: expected the path of a raykv YAML file (got {path!r})")
        settings = load_config(path).offload
        tree = settings.model_dump(exclude_unset=True)
    else:
        if inline is None:
            inline = {}
        if not isinstance(inline, Mapping):
            raise ConfigError(f"{INLINE}: expected a mapping of offload keys (got {inline!r})")
        try:
            settings = OffloadConfig.model_validate(dict(inline))
        except ValidationError as exc:
            raise ConfigError("; ".join(error_lines(exc, f"{INLINE}."))) from None
        tree = dict(inline)
    for key, decider in DECIDED_BY_VLLM.items():
        if key in tree:
            raise ConfigError(f"{INLINE}.{key}: decided by {decider} inside vLLM; leave it out")
    for (section, key, value), why in NOT_INSIDE_VLLM.items():
        part = getattr(settings, section)
        if part.enabled and getattr(part, key) == value:
            raise ConfigError(
                f"{INLINE}.{section}.{key}: {value} is not available inside vLLM; {why}"
            )
    if settings.cpu_bytes is None and settings.cpu_slots is None:
        raise ConfigError(f"{INLINE}.cpu_bytes: set the CPU tier's size (e.g. 4GiB)")
    return settings

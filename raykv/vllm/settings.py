"""raykv's settings inside vLLM: its ``offload`` section, read from vLLM's connector config.

``kv_connector_extra_config`` holds either ``"raykv": {...}`` (the keys of ``raykv run``'s
``offload`` section, with the same defaults and checks) or ``"raykv_config": "<file>.yaml"`` (a
raykv config file whose ``offload`` section is used). Errors name the key as ``raykv.<key>``.

Faults (``raykv/faults/specs.py``) come as ``"raykv_faults": [...]`` beside the inline section,
or as the file's own ``faults`` list: the same specs as ``raykv run``'s, for what a spec inside
vLLM has (its copies, its tiers' I/O, the embedded master); what vLLM owns (its workers, its
scheduler, their messages) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from raykv.config import ConfigError
from raykv.config.loading import error_lines, load_config
from raykv.config.sections import OffloadConfig
from raykv.config.shared import EMBEDDED
from raykv.faults import DISK_KINDS, SHARED_KINDS, Fault, FaultSpecError, parse_fault

# where raykv's settings sit in kv_connector_extra_config
INLINE = "raykv"
FILE = "raykv_config"
FAULTS = "raykv_faults"
# the faults a spec inside vLLM can suffer: its copies, its tiers' I/O and the embedded master
# (a step is one of vLLM's scheduler steps); vLLM's workers, scheduler and messages are vLLM's
FAULTS_INSIDE_VLLM = ("fail-copy", "corrupt-cpu", *DISK_KINDS, *SHARED_KINDS, "kill-shared-master")
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


def fault_settings(
    extra_config: Mapping[str, Any], world_size: int, settings: OffloadConfig
) -> list[Fault]:
    """The faults ``kv_connector_extra_config`` asks for (``raykv_faults``, or the
    ``raykv_config`` file's ``faults``) of an engine of ``world_size`` workers with raykv's
    ``settings``; ``ConfigError`` naming the spec at fault."""
    path, listed = extra_config.get(FILE), extra_config.get(FAULTS)
    if path is not None and listed is not None:
        raise ConfigError(f"{FAULTS}: with {FILE}, list the faults in that file's faults")
    where = FAULTS
    if path is not None:
        listed, where = load_config(path).faults, "faults"
    if listed is None:
        return []
    if not isinstance(listed, list) or not all(isinstance(item, str) for item in listed):
        raise ConfigError(f"{where}: expected a list of fault specs (got {listed!r})")
    faults = []
    for i, text in enumerate(listed):
        try:
            fault = parse_fault(text)
        except FaultSpecError as exc:
            raise ConfigError(f"{where}[{i}]: {exc}") from None
        if fault.kind not in FAULTS_INSIDE_VLLM:
            raise ConfigError(
                f"{where}[{i}]: {fault.kind} is not available inside vLLM (vLLM owns its "
                f"workers, its scheduler and their messages; available: "
                f"{', '.join(FAULTS_INSIDE_VLLM)})"
            )
        if fault.rank is not None and fault.rank >= world_size:
            raise ConfigError(
                f"{where}[{i}]: rank {fault.rank} does not exist with {world_size} "
                f"worker{'s' if world_size > 1 else ''}"
            )
        embedded = settings.shared.enabled and settings.shared.master == EMBEDDED
        if fault.kind == "kill-shared-master" and not embedded:
            raise ConfigError(
                f"{where}[{i}]: kill-shared-master needs the shared tier with its embedded "
                "master (raykv.shared.enabled, raykv.shared.master: embedded)"
            )
        faults.append(fault)
    return faults

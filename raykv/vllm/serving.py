"""vLLM's ``AsyncLLM`` as the engine of a ``raykv serve --engine vllm`` replica.

The replica (``raykv/serve/vllm_replica.py``, the Ray side) hands this module token ids,
raykv's ``SamplingSpec`` and a cache salt, and gets back plain ``VllmDelta`` records: new token
ids with their log-probabilities, then the finish reason and where the prompt's cached tokens
came from. Text is the replica's business (the same ``TextStream`` as raykv's engine: one way
to decode, one way to stop), so vLLM's detokenizer is off.

The engine runs raykv's tiers as its offloading spec (configured from raykv's ``offload``
section, as ``raykv run`` reads it), publishes its KV events on a ZeroMQ socket of the
replica's own (``ipc://``: nothing listens beyond the machine), and its manager reports each
load's tier split on another (``raykv.vllm.load_report``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from raykv.config import ConfigError
from raykv.config.sections import OffloadConfig
from raykv.core.step import SamplingSpec, TokenLogprobs
from raykv.vllm.load_report import REPORTS_KEY
from raykv.vllm.local import connector_config
from raykv.vllm.settings import DECIDED_BY_VLLM, INLINE, offload_settings

# vLLM's engine arguments raykv sets itself, with what sets them
OWNED_BY_RAYKV = {
    "model": "--model (model.path)",
    "kv_transfer_config": "raykv's offload section",
    "kv_events_config": "the replica (its KV event stream feeds the router)",
    "disable_log_stats": "the replica",
}
# the KV cache's size on vLLM's CPU platform where serve.vllm does not set it (vLLM refuses to
# start there without a cap)
CPU_KV_CACHE_BYTES = 1 << 30
TOPIC = "kv"
# how long a replica's stop waits for vLLM's engine core to end before it is killed
SHUTDOWN_S = 30.0
# raykv's CPU tier per replica where offload sets no size (the spec wants one)
DEFAULT_CPU_TIER = "1GiB"


class RequestNotServable(ValueError):
    """A request vLLM refuses (a sampling value it does not take, a prompt past its context):
    ``field`` names the request's parameter at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class VllmDelta:
    """What one request's stream brought since the last: new tokens (and their logprobs when
    asked), and at the end the finish reason and vLLM's count of cached prompt tokens."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0


def _engine_settings(
    section: Mapping[str, Any], offload: OffloadConfig, cpu_platform: bool, **spec_extra: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """vLLM's engine arguments of ``serve.vllm`` (None values left to vLLM; on the CPU
    platform the KV cache capped) and the connector config of raykv's spec with ``offload``
    (None: offloading off), what a replica and vLLM's own server both run."""
    check_section(section)
    arguments = {k: v for k, v in section.items() if v is not None}
    if cpu_platform:
        arguments.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    if not offload.enabled:
        return arguments, None
    raykv = spec_settings(offload)
    chunk = arguments["block_size"] * offload.blocks_per_chunk
    return arguments, connector_config(raykv, block_size=chunk, **spec_extra)


def engine_arguments(
    model: str,
    section: Mapping[str, Any],
    offload: OffloadConfig,
    *,
    events_endpoint: str | None,
    reports_endpoint: str | None,
    cpu_platform: bool,
) -> Any:
    """vLLM's ``AsyncEngineArgs`` for a replica: ``section`` is ``serve.vllm`` (vLLM's names),
    ``offload`` raykv's tiers (off: vLLM alone); its KV events (self-describing, raykv's tiers
    among them) on ``events_endpoint``, its loads' tier split to ``reports_endpoint``."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec_extra: dict[str, Any] = {"self_describing_kv_events": True}
    if reports_endpoint:
        spec_extra[REPORTS_KEY] = reports_endpoint
    arguments, connector = _engine_settings(section, offload, cpu_platform, **spec_extra)
    if connector is not None:
        arguments["kv_transfer_config"] = KVTransferConfig(**connector)
    if events_endpoint:
        arguments["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, topic=TOPIC
        )
    return AsyncEngineArgs(model=model, disable_log_stats=False, **arguments)


def spec_settings(offload: OffloadConfig) -> dict[str, Any]:
    """raykv's settings for its spec inside vLLM from the ``offload`` section (its keys as
    ``raykv run`` reads them, less what vLLM decides inside it), checked as the spec will
    check them: ConfigError naming the ``offload.`` key at fault."""
    raykv = offload.model_dump(mode="json", exclude_unset=True)
    for key in DECIDED_BY_VLLM:
        raykv.pop(key, None)
    if offload.cpu_bytes is None and offload.cpu_slots is None:
        raykv["cpu_bytes"] = DEFAULT_CPU_TIER  # the spec has no size of its own to fall back on
    try:
        offload_settings({INLINE: raykv})
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"{INLINE}.", "offload.")) from None
    return raykv


def cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def api_server_command(
    model: str, section: Mapping[str, Any], offload: OffloadConfig, port: int, cpu_platform: bool
) -> list[str]:
    """The command line of vLLM's own OpenAI server with the settings a replica of
    ``serve.vllm`` and ``offload`` runs (the baseline of ``raykv bench serve --router vllm``):
    the same engine arguments, raykv's tiers as its offloading spec, on loopback."""
    import json
    import sys

    arguments, connector = _engine_settings(section, offload, cpu_platform)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"]
    command += ["--disable-uvicorn-access-log"]
    for key, value in arguments.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            command += [flag, json.dumps(value)]
        else:
            command += [flag, str(value)]
    if connector is not None:
        command += ["--kv-transfer-config", json.dumps(connector)]
    return command


def check_section(section: Mapping[str, Any]) -> None:
    """ConfigError naming the first key of ``serve.vllm`` that is no engine argument of the
    installed vLLM, or one raykv sets itself."""
    from vllm import __version__
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for key in section:
        if key in OWNED_BY_RAYKV:
            raise ConfigError(f"serve.vllm.{key}: set by {OWNED_BY_RAYKV[key]}; leave it out")
        if key not in known:
            raise ConfigError(f"serve.vllm.{key}: not an engine argument of vLLM {__version__}")


def sampling_params(sampling: SamplingSpec, max_tokens: int | None) -> Any:
    """vLLM's ``SamplingParams`` for raykv's ``sampling`` (RequestNotServable naming the
    field vLLM refuses, in vLLM's own words)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            seed=sampling.seed,
            logprobs=sampling.logprobs,
            max_tokens=max_tokens,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, TypeError) as exc:
        raise RequestNotServable(f"vLLM refuses this request: {exc}", _field_of(str(exc))) from None


def _field_of(message: str) -> str:
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "max_tokens"):
        if name in message:
            return name
    return "sampling"


class VllmEngine:
    """One ``AsyncLLM`` (its engine core a process of its own)."""

    def __init__(self, engine_args: Any) -> None:
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(
            engine_args, usage_context=UsageContext.OPENAI_API_SERVER
        )
        config = self.llm.vllm_config
        self.max_model_len: int = config.model_config.max_model_len
        self.block_size: int = config.cache_config.block_size
        self.max_logprobs: int = config.model_config.max_logprobs

    def check(self, num_prompt: int, sampling: SamplingSpec, max_tokens: int | None) -> None:
        """RequestNotServable where vLLM would refuse the request, in the API's words."""
        if num_prompt >= self.max_model_len:
            raise RequestNotServable(
                f"the prompt's {num_prompt} tokens leave no room for an answer in the model's "
                f"context of {self.max_model_len} tokens",
                "prompt",
            )
        if max_tokens is not None and num_prompt + max_tokens > self.max_model_len:
            raise RequestNotServable(
                f"max_tokens {max_tokens}: the prompt's {num_prompt} tokens and the answer "
                f"exceed the model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
        if sampling.logprobs is not None and sampling.logprobs > self.max_logprobs:
            raise RequestNotServable(
                f"{sampling.logprobs} top log-probabilities asked; this vLLM engine reports at "
                f"most {self.max_logprobs} (its max_logprobs)",
                "logprobs",
            )

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingSpec,
        max_tokens: int | None,
        cache_salt: str | None,
    ) -> AsyncIterator[VllmDelta]:
        """The request's stream of deltas (the last has its finish reason)."""
        from vllm.inputs import TokensPrompt

        params = sampling_params(sampling, max_tokens)
        prompt = TokensPrompt(prompt_token_ids=token_ids)
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        wanted = sampling.logprobs is not None
        async for output in self.llm.generate(prompt, params, request_id):
            completion = output.outputs[0]
            delta = VllmDelta(list(completion.token_ids))
            if wanted:
                delta.logprobs = _logprobs(
                    completion.token_ids, completion.logprobs, sampling.logprobs or 0
                )
            if output.finished:
                delta.finish_reason = completion.finish_reason or "stop"
                delta.cached_tokens = output.num_cached_tokens or 0
            yield delta

    def engine_core_pids(self) -> list[int]:
        """The process ids of vLLM's engine core processes (empty where vLLM hides them)."""
        try:
            manager = self.llm.engine_core.resources.engine_manager
            return [process.pid for process in manager.processes if process.pid]
        except AttributeError:
            return []

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    @property
    def errored(self) -> bool:
        return bool(self.llm.errored)

    def shutdown(self) -> None:
        # long enough for the engine core to end on its own: force-killed (vLLM's default
        # after 5 s) it leaves its semaphores and shared memory in /dev/shm
        self.llm.shutdown(timeout=SHUTDOWN_S)


def _logprobs(token_ids: Any, positions: Any, top_n: int) -> list[TokenLogprobs]:
    """vLLM's per-position log-probabilities as raykv's: the sampled token's, and the ``top_n``
    most likely (vLLM adds the sampled token past them; it is not one of them)."""
    out = []
    for token_id, entries in zip(token_ids, positions or [], strict=False):
        sampled = entries.get(token_id)
        top = {t: lp.logprob for t, lp in entries.items() if (lp.rank or 0) <= top_n}
        out.append(TokenLogprobs(sampled.logprob if sampled is not None else 0.0, top))
    return out

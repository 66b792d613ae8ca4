"""``raykv generate``: prompts through a real model on the paged KV cache, texts out.

Prompts are texts, chat messages (through the model's chat template, with the generation
prompt) or token ids. All arrive at once, or with ``sequential`` one after the other finished,
so a later prompt can reuse an earlier one's KV from the GPU prefix cache or the CPU tier.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from raykv.config import ConfigError, RaykvConfig
from raykv.core.hashing import check_cache_salt
from raykv.core.request import REJECTED, RequestStatus
from raykv.core.step import SEED_MAX, SEED_MIN, SamplingSpec, TokenLogprobs
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.error_text import reason, shown
from raykv.model.checkpoint import configure, with_stop_tokens
from raykv.model.tokenizer import Tokenizer, missing_tokenizer
from raykv.runs.driver import Driver
from raykv.runs.report import RunReport
from raykv.workload.requests import RequestSpec


@dataclass(slots=True)
class Prompt:
    """One input: exactly one of text, chat messages or token ids."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None
    source: str | None = None  # where it was read ("file:line"): errors found later name it
    cache_salt: str | None = None  # its cache's tenant (None: the run's, if any)


@dataclass(slots=True)
class Output:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS), "length" (max tokens), "error" or "rejected"
    error: str | None = None  # why it was refused, or failed
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked for

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.logprobs is not None:
            out["logprobs"] = [
                {
                    "token_id": t,
                    "logprob": lp.logprob,
                    "top": {str(k): v for k, v in lp.top.items()},
                }
                for t, lp in zip(self.token_ids, self.logprobs, strict=True)
            ]
        return out


def read_prompt_file(path: str) -> list[Prompt]:
    """A JSONL file, one ``{"prompt": text}``, ``{"messages": [...]}`` or
    ``{"prompt_token_ids": [...]}`` per line, each with an optional ``"cache_salt"``; errors
    name the file and line (and the message or token at fault)."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompt-file {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # a number of too many digits, too deep a nest
            raise ConfigError(f"{where}: not JSON ({reason(exc)})") from None
        prompts.append(_prompt(item, where))
    if not prompts:
        raise ConfigError(f"--prompt-file {path}: no prompts")
    return prompts


def _prompt(item: object, where: str) -> Prompt:
    """One prompt file line's prompt, refused by what is at fault (checked here, so the chat
    template or the engine never meets a message without a role or a token id that is a bool)."""
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object")
    keys = [k for k in ("prompt", "messages", "prompt_token_ids") if k in item]
    if len(keys) != 1:
        raise ConfigError(f"{where}: give exactly one of prompt, messages, prompt_token_ids")
    key, value = keys[0], item[keys[0]]
    wanted = {"prompt": "a string", "messages": "a list of messages"}.get(key, "a list of ids")
    if not isinstance(value, str if key == "prompt" else list):
        raise ConfigError(
            f"{where}: {key} has the wrong type: it must be {wanted}, got {type(value).__name__}"
        )
    if not value:
        raise ConfigError(f"{where}: {key} is empty")
    salt = item.get("cache_salt")
    if salt is not None:
        try:
            check_cache_salt(salt)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if key == "prompt":
        return Prompt(text=value, source=where, cache_salt=salt)
    if key == "messages":
        for index, message in enumerate(value):
            _check_message(message, f"{where}: messages[{index}]")
        return Prompt(messages=value, source=where, cache_salt=salt)
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(
                f"{where}: prompt_token_ids[{index}] must be a token id (an integer >= 0), "
                f"got {shown(token)}"
            )
    return Prompt(token_ids=list(value), source=where, cache_salt=salt)


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, dict):
        raise ConfigError(
            f"{where}: expected an object with role and content, got {type(message).__name__}"
        )
    for field in ("role", "content"):
        if field not in message:
            raise ConfigError(f"{where}: missing {field!r}")
    role, content = message["role"], message["content"]
    if not isinstance(role, str) or not role:
        raise ConfigError(f"{where}: 'role' must be a non-empty string, got {shown(role)}")
    if not isinstance(content, str):
        raise ConfigError(f"{where}: 'content' must be a string, got {shown(content)}")


@dataclass(slots=True)
class Generation:
    """Prompts made ready for an engine: the served config (the checkpoint's geometry), the
    tokenizer, and one request spec per prompt, numbered by its place (``str(index)``)."""

    cfg: RaykvConfig
    tokenizer: Tokenizer | None
    specs: list[RequestSpec]
    logprobs: bool  # whether outputs carry logprobs

    def output(
        self,
        index: int,
        tokens: list[int],
        status: str,
        error: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> Output:
        """Prompt ``index``'s output from what the engine answered (``status``: a request
        status value, or ``rejected`` with ``error``)."""
        prompt = list(self.specs[index].prompt)
        if error is not None:
            return Output(index, prompt, [], "", REJECTED, error)
        reason = "stop" if status == RequestStatus.FINISHED_STOPPED.value else "length"
        failed = None
        if status == RequestStatus.FINISHED_ERROR.value:  # its sampling raised on a rank
            reason, failed = "error", "the engine could not compute this prompt's next token"
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        kept = list(logprobs or []) if self.logprobs else None
        return Output(index, prompt, list(tokens), text, reason, failed, kept)


def prepare(
    cfg: RaykvConfig,
    prompts: list[Prompt],
    max_tokens: int,
    sampling: SamplingSpec | None = None,
    cache_salt: str | None = None,
) -> Generation:
    """Configure ``cfg`` for its checkpoint and turn the prompts into request specs, each with
    ``sampling`` (greedy by default; a seed is offset by the prompt's index, so prompts differ
    and a rerun repeats) and its cache salt (the prompt's own, else ``cache_salt``). Bad
    sampling parameters and salts are refused by name before anything loads."""
    if cache_salt is not None:
        try:
            check_cache_salt(cache_salt)
        except ValueError as exc:
            raise ConfigError(f"--cache-salt: {exc}") from None
    spec_in = sampling or SamplingSpec()
    spec_in.check()
    cfg, _, path = configure(cfg)
    context = cfg.model.max_positions
    if context is not None and max_tokens >= context:  # no prompt leaves room for it
        raise ConfigError(
            f"max_tokens {max_tokens} (--max-tokens): the model's context is {context} tokens, "
            "prompt included"
        )
    tokenizer = Tokenizer.of(path, cfg.model.cache_dir)
    if tokenizer is not None:
        cfg = with_stop_tokens(cfg, [tokenizer.eos_token_id])
    specs = [
        RequestSpec(
            str(i),
            tuple(_token_ids(tokenizer, p, path)),
            max_tokens,
            0.0,
            _for_prompt(spec_in, i),
            cache_salt=p.cache_salt if p.cache_salt is not None else cache_salt,
        )
        for i, p in enumerate(prompts)
    ]
    return Generation(cfg, tokenizer, specs, spec_in.logprobs is not None)


def generate(
    cfg: RaykvConfig,
    prompts: list[Prompt],
    max_tokens: int,
    sequential: bool = False,
    sampling: SamplingSpec | None = None,
    cache_salt: str | None = None,
) -> tuple[list[Output], RunReport]:
    """Run every prompt to the end on the one-process engine (the real model at TP 1); see
    ``prepare``. With ``sequential`` each prompt is submitted once the previous finished."""
    gen = prepare(cfg, prompts, max_tokens, sampling, cache_salt)
    cfg = gen.cfg
    outputs: dict[int, Output] = {}
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        core = EngineCore(cfg, workers)
        driver = Driver(core)
        for batch in [[s] for s in gen.specs] if sequential else [gen.specs]:
            driver.submit(batch)
            while driver.has_work():
                driver.step()
            for req in driver.take_finished():
                index = int(req.req_id)
                outputs[index] = gen.output(
                    index, req.output, req.status.value, logprobs=req.logprobs
                )
        report = driver.report()
        core.stop()  # the CPU tier to the disk tier: the next run starts warm
    for refused in report.rejected:  # this prompt is at fault; the others ran
        index = int(refused["request"])
        outputs[index] = gen.output(index, [], REJECTED, refused["error"])
    report.engine = "local"
    return [outputs[i] for i in range(len(gen.specs))], report


def _for_prompt(spec: SamplingSpec, index: int) -> SamplingSpec:
    if spec.seed is None:
        return spec
    # wrapped within the 64 bits a seed travels in: the last prompts of a seed near the top
    # of the range take seeds from the bottom
    span = SEED_MAX - SEED_MIN + 1
    return replace(spec, seed=(spec.seed + index - SEED_MIN) % span + SEED_MIN)


def _token_ids(tokenizer: Tokenizer | None, prompt: Prompt, path: Path) -> list[int]:
    if prompt.token_ids is not None:
        return prompt.token_ids
    if tokenizer is None:
        raise ConfigError(f"{missing_tokenizer(path)}: give prompt_token_ids instead")
    if prompt.messages is not None:
        if not tokenizer.has_chat_template:  # a base model: the messages' text as it is
            return tokenizer.encode("\n".join(str(m.get("content", "")) for m in prompt.messages))
        try:
            return tokenizer.chat(prompt.messages)
        except ValueError as exc:  # the template refused these messages: name their line
            if prompt.source is None:
                raise
            raise ConfigError(f"{prompt.source}: {exc}") from None
    assert prompt.text is not None
    ids = tokenizer.encode(prompt.text)
    if not ids:
        raise ConfigError(
            f"{prompt.source}: an empty prompt" if prompt.source else "an empty prompt"
        )
    return ids

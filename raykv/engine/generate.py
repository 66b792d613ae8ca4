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
from raykv.core.request import REJECTED, RequestStatus
from raykv.core.step import SamplingSpec, TokenLogprobs
from raykv.engine.core import EngineCore
from raykv.engine.run import Driver
from raykv.engine.run_report import RunReport
from raykv.engine.workers import LocalWorkerGroup
from raykv.model.checkpoint import configure, with_stop_tokens
from raykv.model.sampling import SamplingParams
from raykv.model.tokenizer import Tokenizer
from raykv.workload.requests import RequestSpec


@dataclass(slots=True)
class Prompt:
    """One input: exactly one of text, chat messages or token ids."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = None


@dataclass(slots=True)
class Output:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS), "length" (max tokens) or "rejected"
    error: str | None = None  # why it was refused
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
    ``{"prompt_token_ids": [...]}`` per line; errors name the file and line."""
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
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected an object")
        keys = [k for k in ("prompt", "messages", "prompt_token_ids") if k in item]
        if len(keys) != 1:
            raise ConfigError(f"{where}: give exactly one of prompt, messages, prompt_token_ids")
        value = item[keys[0]]
        if keys[0] == "prompt" and isinstance(value, str):
            prompts.append(Prompt(text=value))
        elif keys[0] == "messages" and isinstance(value, list) and value:
            prompts.append(Prompt(messages=value))
        elif keys[0] == "prompt_token_ids" and value and all(isinstance(t, int) for t in value):
            prompts.append(Prompt(token_ids=list(value)))
        else:
            raise ConfigError(f"{where}: {keys[0]} has the wrong type")
    if not prompts:
        raise ConfigError(f"--prompt-file {path}: no prompts")
    return prompts


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
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        kept = list(logprobs or []) if self.logprobs else None
        return Output(index, prompt, list(tokens), text, reason, None, kept)


def prepare(
    cfg: RaykvConfig,
    prompts: list[Prompt],
    max_tokens: int,
    sampling: SamplingSpec | None = None,
) -> Generation:
    """Configure ``cfg`` for its checkpoint and turn the prompts into request specs, each with
    ``sampling`` (greedy by default; a seed is offset by the prompt's index, so prompts differ
    and a rerun repeats). Bad sampling parameters are refused by name before anything loads."""
    spec_in = sampling or SamplingSpec()
    SamplingParams(
        spec_in.temperature, spec_in.top_p, spec_in.top_k, logprobs=spec_in.logprobs or 0
    )
    cfg, _, path = configure(cfg)
    tokenizer = Tokenizer.of(path, cfg.model.cache_dir)
    if tokenizer is not None:
        cfg = with_stop_tokens(cfg, [tokenizer.eos_token_id])
    specs = [
        RequestSpec(
            str(i), tuple(_token_ids(tokenizer, p)), max_tokens, 0.0, _for_prompt(spec_in, i)
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
) -> tuple[list[Output], RunReport]:
    """Run every prompt to the end on the one-process engine (the real model at TP 1); see
    ``prepare``. With ``sequential`` each prompt is submitted once the previous finished."""
    gen = prepare(cfg, prompts, max_tokens, sampling)
    cfg = gen.cfg
    outputs: dict[int, Output] = {}
    with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
        driver = Driver(EngineCore(cfg, workers))
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
    for refused in report.rejected:  # this prompt is at fault; the others ran
        index = int(refused["request"])
        outputs[index] = gen.output(index, [], REJECTED, refused["error"])
    report.engine = "local"
    return [outputs[i] for i in range(len(gen.specs))], report


def _for_prompt(spec: SamplingSpec, index: int) -> SamplingSpec:
    return spec if spec.seed is None else replace(spec, seed=spec.seed + index)


def _token_ids(tokenizer: Tokenizer | None, prompt: Prompt) -> list[int]:
    if prompt.token_ids is not None:
        return prompt.token_ids
    if tokenizer is None:
        raise ConfigError("this model has no tokenizer: give prompt_token_ids")
    if prompt.messages is not None:
        if not tokenizer.has_chat_template:  # a base model: the messages' text as it is
            return tokenizer.encode("\n".join(str(m.get("content", "")) for m in prompt.messages))
        return tokenizer.chat(prompt.messages)
    assert prompt.text is not None
    ids = tokenizer.encode(prompt.text)
    if not ids:
        raise ConfigError("an empty prompt")
    return ids

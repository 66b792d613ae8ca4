"""OpenAI's answer shapes for one request: whole (a completion or chat completion object) or as
server-sent events (chunks, the usage chunk, ``[DONE]``, an ``error`` event mid-stream), built
from a replica's ``EngineUpdate``s."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from raykv.serve.messages import EngineUpdate, TokenInfo
from raykv.serve.protocol import ApiError

log = logging.getLogger(__name__)

INTERNAL_ERROR = "internal server error (the server's log has the details)"


def update_error(update: EngineUpdate, params: dict[str, str]) -> ApiError:
    param = params.get(update.param, update.param) if update.param is not None else None
    return ApiError(update.status, update.error or INTERNAL_ERROR, param)


class AnswerShape:
    """One request's answer, whole or as chunks."""

    def __init__(self, request_id: str, model: str, chat: bool, logprobs: bool) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.logprobs = logprobs  # the request asked for them
        self.created = int(time.time())
        self.offset = 0  # characters of text so far (completions' text_offset)

    def _envelope(self, kind: str, update: EngineUpdate | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        if update is not None and update.replica:  # which replica answered, as OpenAI's field
            out["system_fingerprint"] = f"raykv-{update.replica}"
        return out

    def whole(self, pieces: list[EngineUpdate]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        infos = [i for p in pieces for i in p.logprobs or []] if self.logprobs else None
        last = pieces[-1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprob_shape(infos) if infos is not None else None
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, last), "choices": [choice], "usage": usage_of(last)}

    async def events(
        self,
        first: EngineUpdate,
        rest: AsyncIterator[EngineUpdate],
        include_usage: bool,
        params: dict[str, str],
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:  # the role comes first, as OpenAI sends it
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            yield sse({**self._envelope(kind), "choices": [{**role, "finish_reason": None}]})
        update: EngineUpdate | None = first
        last = first
        try:
            while update is not None:
                if update.error is not None:
                    yield sse(update_error(update, params).body())
                    return
                last = update
                if update.text or update.finish_reason is not None or update.token_ids:
                    chunk = {**self._envelope(kind, update), "choices": [self._chunk(update)]}
                    yield sse(chunk)
                update = await anext(rest, None)
        except ApiError as exc:  # a replica that died mid-stream
            yield sse(exc.body())
            return
        except Exception:
            log.exception("a stream failed mid-answer")
            yield sse(ApiError(500, INTERNAL_ERROR).body())
            return
        if include_usage:
            yield sse({**self._envelope(kind), "choices": [], "usage": usage_of(last)})
        yield "data: [DONE]\n\n"

    def _chunk(self, update: EngineUpdate) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": update.finish_reason}
        if self.chat:
            choice["delta"] = {"content": update.text} if update.text else {}
        else:
            choice["text"] = update.text
        infos = update.logprobs if self.logprobs else None
        choice["logprobs"] = self._logprob_shape(infos) if infos else None
        return choice

    def _logprob_shape(self, infos: list[TokenInfo]) -> dict[str, Any]:
        if self.chat:
            return {
                "content": [
                    {
                        "token": i.text,
                        "logprob": i.logprob,
                        # the token's own bytes: a split character's halves each carry theirs
                        "bytes": list(i.raw or i.text.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(raw or t.encode())}
                            for _, t, v, raw in i.top
                        ],
                    }
                    for i in infos
                ]
            }
        # each token's text is what it added to the answer's, so the offsets index that text
        offsets = []
        for i in infos:
            offsets.append(self.offset)
            self.offset += len(i.text)
        return {
            "tokens": [i.text for i in infos],
            "token_logprobs": [i.logprob for i in infos],
            "top_logprobs": [{t: v for _, t, v, _ in i.top} for i in infos],
            "text_offset": offsets,
        }


def usage_of(last: EngineUpdate) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        # OpenAI's cached_tokens, and (raykv's own) where they came from
        "prompt_tokens_details": {
            "cached_tokens": last.cached_tokens,
            "gpu_cache_tokens": last.cached_tokens
            - last.cpu_tier_tokens
            - last.disk_tier_tokens
            - last.shared_tier_tokens,
            "cpu_tier_tokens": last.cpu_tier_tokens,
            "disk_tier_tokens": last.disk_tier_tokens,
            "shared_tier_tokens": last.shared_tier_tokens,
        },
    }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"

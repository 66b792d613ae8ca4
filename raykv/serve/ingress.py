"""The HTTP ingress: OpenAI's endpoints on FastAPI, as a Ray Serve deployment.

It parses and checks each request (a bad field is a 400 naming it), turns the prompt into
token ids (chat messages through the model's template), hands an ``EngineRequest`` to the
engine deployment through its handle (whose request router picks the replica) and answers in
OpenAI's shapes, streamed as server-sent events when asked.

No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations at
run time to inject the ``Request``, and Serve's class-based views do not resolve strings.
"""

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from raykv.core.step import SamplingSpec
from raykv.model.tokenizer import Tokenizer
from raykv.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from raykv.serve.replica import EngineRequest, EngineUpdate, TokenInfo

# how long /health and the first request wait for a replica to answer before a 503
READY_WAIT_S = 2.0


class OpenAIIngress:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health``.

    ``ingress_deployment`` routes a FastAPI app to it and makes it a Serve deployment; this
    class stays a plain module-level one, which Ray pickles by reference (its replicas import
    this module), while the routed subclass travels by value with its app."""

    def __init__(
        self,
        engine: Any,
        model_name: str,
        model_file: str,
        api_key: str | None = None,
        text_prompts: bool = False,
        cache_dir: str | None = None,
    ) -> None:
        """``text_prompts``: give a token-id prompt its text too (the text-prefix router reads
        nothing else); ``cache_dir``: where a GGUF file's tokenizer is kept converted."""
        self.engine = engine
        self._text_prompts = text_prompts
        self.model_name = model_name
        self.tokenizer = Tokenizer.of(model_file, cache_dir)
        self._key = api_key.encode() if api_key else None
        self._ready = False
        self.created = int(time.time())

    # ---- endpoints --------------------------------------------------------------------------

    # each raises ApiError for an error answer (the app's handler turns it into OpenAI's shape)

    async def health(self) -> Response:
        await self._wait_ready()
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "raykv",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse(CompletionRequest, await _json(request))
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            text, ids = body.prompt, self._encode(body.prompt)
        else:
            ids = list(body.prompt)
            text = self._decode(ids) if self._text_prompts else ""
        sampling = SamplingSpec(body.temperature, body.top_p, 0, body.seed, body.logprobs)
        engine_request = EngineRequest(
            _request_id("cmpl"), ids, body.max_tokens, sampling, body.stop_strings(), text
        )
        return await self._answer(engine_request, body, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = parse(ChatCompletionRequest, await _json(request))
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        ids = self.tokenizer.chat(messages)
        sampling = SamplingSpec(body.temperature, body.top_p, 0, body.seed, body.logprobs_wanted())
        engine_request = EngineRequest(
            _request_id("chatcmpl"),
            ids,
            body.output_limit(),
            sampling,
            body.stop_strings(),
            "".join(m["content"] for m in messages),
        )
        return await self._answer(engine_request, body, chat=True)

    # ---- the answer -------------------------------------------------------------------------

    async def _answer(self, engine_request: EngineRequest, body: Any, chat: bool) -> Response:
        await self._wait_ready()
        updates = self.engine.options(stream=True).generate.remote(engine_request)
        logprobs = engine_request.sampling.logprobs is not None
        shape = _Shape(engine_request.request_id, self.model_name, chat, logprobs)
        stream = _updates(updates)
        first = await _first(stream, "messages" if chat else "prompt")
        if body.stream:
            return StreamingResponse(
                shape.events(first, stream, body.include_usage()),
                media_type="text/event-stream",
            )
        pieces = [first]
        async for update in stream:
            pieces.append(update)
        last = pieces[-1]
        if last.error is not None:
            raise ApiError(last.status, last.error)
        return JSONResponse(shape.whole(pieces))

    # ---- checks -----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # constant time: how much of a wrong key matched must not show in the answer's timing
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here ({self.model_name})", "model")

    def _decode(self, ids: list[int]) -> str:
        try:
            if self.tokenizer is not None:
                return self.tokenizer.decode(ids)
        except Exception:  # an id out of range: the engine refuses it by name later
            pass
        return ",".join(map(str, ids))  # the ids as text: prefixes stay prefixes

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", "prompt")
        return self.tokenizer.encode(text)

    async def _wait_ready(self) -> None:
        """503 unless a replica answers (once one has, later requests queue for a replica as
        Serve does)."""
        if self._ready:
            return
        try:
            await asyncio.wait_for(self.engine.ping.remote(), READY_WAIT_S)
        except Exception:
            raise ApiError(503, "no replica is ready yet; retry shortly") from None
        self._ready = True


# ---- answers in OpenAI's shapes ---------------------------------------------------------------


class _Shape:
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
        return {**self._envelope(kind, last), "choices": [choice], "usage": _usage(last)}

    async def events(
        self, first: EngineUpdate, rest: AsyncIterator[EngineUpdate], include_usage: bool
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:  # the role comes first, as OpenAI sends it
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            yield _sse({**self._envelope(kind), "choices": [{**role, "finish_reason": None}]})
        update: EngineUpdate | None = first
        last = first
        try:
            while update is not None:
                if update.error is not None:
                    yield _sse(ApiError(update.status, update.error).body())
                    return
                last = update
                if update.text or update.finish_reason is not None or update.token_ids:
                    chunk = {**self._envelope(kind, update), "choices": [self._chunk(update)]}
                    yield _sse(chunk)
                update = await anext(rest, None)
        except ApiError as exc:  # a replica that died mid-stream
            yield _sse(exc.body())
            return
        if include_usage:
            yield _sse({**self._envelope(kind), "choices": [], "usage": _usage(last)})
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
                        "bytes": list(i.text.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())}
                            for _, t, v in i.top
                        ],
                    }
                    for i in infos
                ]
            }
        offsets = []
        for i in infos:
            offsets.append(self.offset)
            self.offset += len(i.text)
        return {
            "tokens": [i.text for i in infos],
            "token_logprobs": [i.logprob for i in infos],
            "top_logprobs": [{t: v for _, t, v in i.top} for i in infos],
            "text_offset": offsets,
        }


def _usage(last: EngineUpdate) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        # OpenAI's cached_tokens, and (raykv's own) where they came from
        "prompt_tokens_details": {
            "cached_tokens": last.cached_tokens,
            "gpu_cache_tokens": last.cached_tokens - last.cpu_tier_tokens,
            "cpu_tier_tokens": last.cpu_tier_tokens,
        },
    }


async def _updates(responses: Any) -> AsyncIterator[EngineUpdate]:
    """The replica's updates; a replica lost on the way is a 503 (the request is not retried:
    part of its answer may already be out)."""
    try:
        async for update in responses:
            yield update
    except Exception as exc:
        message = f"the replica serving this request failed: {type(exc).__name__}"
        raise ApiError(503, message) from exc


async def _first(stream: AsyncIterator[EngineUpdate], param: str) -> EngineUpdate:
    """The first update, before any answer goes out: a refusal is a proper HTTP error."""
    first = await anext(stream, None)
    if first is None:
        raise ApiError(503, "the replica ended the request without an answer")
    if first.error is not None:
        raise ApiError(first.status, first.error, param if first.status == 400 else None)
    return first


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not JSON") from None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def ingress_deployment() -> Any:
    """``OpenAIIngress`` as a Serve deployment behind a FastAPI app of its own."""
    app = FastAPI(title="raykv", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @serve.deployment
    @serve.ingress(app)
    class RaykvIngress(OpenAIIngress):
        @app.get("/health")
        async def get_health(self) -> Response:
            return await self.health()

        @app.get("/v1/models")
        async def get_models(self, request: Request) -> Response:
            return await self.models(request)

        @app.post("/v1/completions")
        async def post_completions(self, request: Request) -> Response:
            return await self.completions(request)

        @app.post("/v1/chat/completions")
        async def post_chat_completions(self, request: Request) -> Response:
            return await self.chat_completions(request)

    return RaykvIngress

"""The HTTP ingress: OpenAI's endpoints on FastAPI, as a Ray Serve deployment.

It reads each body (413 past ``serve.max_request_bytes``), parses and checks it against what
the engine can carry and compute (a bad field is a 400 naming it), turns the prompt into token
ids (chat messages through the model's template) and hands an ``EngineRequest`` to the engine
deployment through its handle (whose request router picks the replica), then answers in
OpenAI's shapes, streamed as server-sent events when asked. Parsing and tokenizing run in
threads of the ingress's: one client's megabyte prompt never stalls the event loop every other
request shares. A prompt that cannot fit the model's context is refused from its length before
it is encoded whole. Every endpoint but ``/health`` needs the API key when one is set, the
API's own description (``/openapi.json``) too. No client ever reads an internal error's text
(a traceback, a path, an address): the server logs it and answers a 500 saying so.

No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations at
run time to inject the ``Request``, and Serve's class-based views do not resolve strings.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from raykv.core.step import SamplingError, SamplingSpec
from raykv.error_text import reason
from raykv.model.tokenizer import ChatTemplateError, Tokenizer
from raykv.serve.answers import INTERNAL_ERROR, AnswerShape, update_error
from raykv.serve.grpc_bind import bind_replica_grpc_to_node
from raykv.serve.messages import EngineRequest, EngineUpdate
from raykv.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from raykv.serve.tenants import SaltRequired, api_keys, request_salt, tenant_tag

log = logging.getLogger(__name__)

# how long /health and the first request wait for a replica to answer before a 503
READY_WAIT_S = 2.0
# threads that parse and tokenize bodies: the tokenizer releases the GIL while it encodes, so a
# few long prompts encode side by side and the event loop stays free
PREPARE_THREADS = 4


@dataclass(slots=True, frozen=True)
class IngressLimits:
    """What the ingress checks a request against before any replica sees it: the model's
    context (``max_positions``; None: no limit but the GPU pool's), its vocabulary, and the
    largest body it reads."""

    max_positions: int | None = None
    vocab_size: int | None = None
    max_request_bytes: int = 4 * 2**20


class OpenAIIngress:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/openapi.json`` and
    ``/health``.

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
        limits: dict[str, Any] | None = None,
        cache_isolation: str = "per_key",
        hashing: tuple[str, str | None] | None = None,
    ) -> None:
        """``api_key``: one key, or several separated by commas; ``text_prompts``: give a
        token-id prompt its text too (the text-prefix router reads nothing else);
        ``cache_dir``: where a GGUF file's tokenizer is kept converted; ``limits``: an
        ``IngressLimits`` as a dict; ``cache_isolation``: ``serve.cache_isolation``;
        ``hashing``: vLLM's block hash (algorithm, seed) where the KV router hashes prompts as
        vLLM replicas do (imported here, before the ingress serves: the router is made in this
        process on the first request, and would route by load alone while it imported)."""
        bind_replica_grpc_to_node()  # before Serve starts it, once this returns
        if hashing is not None:
            from raykv.vllm.block_hashes import warm

            warm(*hashing)
        self.engine = engine
        self._text_prompts = text_prompts
        self.model_name = model_name
        self.tokenizer = Tokenizer.of(model_file, cache_dir)
        self.limits = IngressLimits(**(limits or {}))
        # each key with its tenant's tag (a hash of the key: the salt a replica sees, logs or
        # reports names no key)
        self._keys = [(key.encode(), tenant_tag(key)) for key in api_keys(api_key)]
        self._isolation = cache_isolation
        self._ready = False
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="raykv-prepare")
        self.created = int(time.time())

    # ---- endpoints --------------------------------------------------------------------------

    # each raises ApiError for an error answer (the app's handler turns it into OpenAI's shape)

    async def health(self) -> Response:
        """200 while a replica serves, else 503: a replica is asked every time (one whose
        engine stopped says so at once, and Serve replaces it); where the ask waits behind
        replicas busy with their full share of requests, Serve's own view of them (each
        replica's ``check_health``) decides."""
        serving = await self._ping()
        if serving is None:
            serving = await asyncio.to_thread(self._replicas_running)
        if not serving:
            raise ApiError(503, "no replica is serving yet; retry shortly")
        return JSONResponse({"status": "ok"})

    async def _ping(self) -> bool | None:
        """What a replica answers when asked whether it serves; None when no answer came
        within ``READY_WAIT_S`` (False when the ask failed)."""
        try:
            return bool(await asyncio.wait_for(self.engine.ping.remote(), READY_WAIT_S))
        except asyncio.TimeoutError:
            return None
        except Exception:
            return False

    def _replicas_running(self) -> bool:
        """Whether Serve counts a replica of the engine deployment as running (healthy)."""
        try:
            status = serve.status().applications[self.engine.app_name]
            engines = status.deployments[self.engine.deployment_name]
        except Exception:
            return False
        return engines.replica_states.get("RUNNING", 0) > 0

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
        tenant = self._authorize(request)
        raw = await self._body(request)
        engine_request, body = await self._in_thread(self._completion_request, raw)
        engine_request.cache_salt = self._cache_salt(tenant, body.cache_salt)
        return await self._answer(engine_request, body, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._authorize(request)
        raw = await self._body(request)
        engine_request, body = await self._in_thread(self._chat_request, raw)
        engine_request.cache_salt = self._cache_salt(tenant, body.cache_salt)
        return await self._answer(engine_request, body, chat=True)

    def _cache_salt(self, tenant: str | None, given: str | None) -> str | None:
        """The salt a request's blocks are hashed under (``serve/tenants.py``); a 400 naming
        ``cache_salt`` where one is required and none was given."""
        try:
            return request_salt(self._isolation, tenant, given)
        except SaltRequired as exc:
            raise ApiError(400, str(exc), "cache_salt") from None

    # ---- requests, in a thread of ``_prepare`` ----------------------------------------------

    def _completion_request(self, raw: bytes) -> tuple[EngineRequest, CompletionRequest]:
        body = parse(CompletionRequest, _json(raw))
        self._check_model(body.model)
        self._check_output(body.max_tokens, "max_tokens")
        if isinstance(body.prompt, str):
            text = body.prompt
            ids = self._encode(text, "prompt")
            self._check_prompt(ids, body.max_tokens, "prompt", "max_tokens")
        else:
            ids = list(body.prompt)
            self._check_prompt(ids, body.max_tokens, "prompt", "max_tokens")  # before decoding
            text = self._decode(ids) if self._text_prompts else ""
        sampling = SamplingSpec(body.temperature, body.top_p, 0, body.seed, body.logprobs)
        _check_sampling(sampling, {})
        engine_request = EngineRequest(
            _request_id("cmpl"), ids, body.max_tokens, sampling, body.stop_strings(), text
        )
        return engine_request, body

    def _chat_request(self, raw: bytes) -> tuple[EngineRequest, ChatCompletionRequest]:
        body = parse(ChatCompletionRequest, _json(raw))
        self._check_model(body.model)
        limit, limit_param = body.output_limit(), _output_param(body)
        self._check_output(limit, limit_param)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        try:
            rendered = self.tokenizer.render_chat(messages)
        except ChatTemplateError as exc:
            raise ApiError(400, f"messages: {exc}", "messages") from None
        ids = self._encode(rendered, "messages")
        self._check_prompt(ids, limit, "messages", limit_param)
        sampling = SamplingSpec(body.temperature, body.top_p, 0, body.seed, body.logprobs_wanted())
        _check_sampling(sampling, {"logprobs": "top_logprobs"})
        engine_request = EngineRequest(
            _request_id("chatcmpl"),
            ids,
            limit,
            sampling,
            body.stop_strings(),
            "".join(m["content"] for m in messages),
        )
        return engine_request, body

    # ---- the answer -------------------------------------------------------------------------

    async def _answer(self, engine_request: EngineRequest, body: Any, chat: bool) -> Response:
        await self._wait_ready()
        updates = self.engine.options(stream=True).generate.remote(engine_request)
        logprobs = engine_request.sampling.logprobs is not None
        shape = AnswerShape(engine_request.request_id, self.model_name, chat, logprobs)
        params = _chat_params(body) if chat else {}
        stream = _updates(updates)
        first = await _first(stream, params)
        if body.stream:
            return StreamingResponse(
                shape.events(first, stream, body.include_usage(), params),
                media_type="text/event-stream",
            )
        pieces = [first]
        async for update in stream:
            pieces.append(update)
        last = pieces[-1]
        if last.error is not None:
            raise update_error(last, params)
        return JSONResponse(shape.whole(pieces))

    # ---- checks -----------------------------------------------------------------------------

    def _authorize(self, request: Request) -> str | None:
        """The tenant of the request's API key (None: the server asks for none); a 401 where
        the key is missing or none of the server's."""
        if not self._keys:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # constant time, every key compared: neither how much of a wrong key matched nor which
        # key it came near shows in the answer's timing
        tenant = None
        for key, tag in self._keys:
            if hmac.compare_digest(token.encode(), key):
                tenant = tag
        if scheme.lower() != "bearer" or tenant is None:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return tenant

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here ({self.model_name})", "model")

    def _check_output(self, max_tokens: int | None, param: str) -> None:
        """A ``max_tokens`` that no prompt leaves room for, by its size alone."""
        context = self.limits.max_positions
        if max_tokens is not None and context is not None and max_tokens >= context:
            raise ApiError(
                400,
                f"{param} {max_tokens}: the model's context is {context} tokens, prompt included",
                param,
            )

    def _check_prompt(
        self, ids: list[int], max_tokens: int | None, param: str, output_param: str
    ) -> None:
        """The prompt's token ids against the vocabulary and, with ``max_tokens``, the
        context (the replica checks the GPU pool)."""
        vocab = self.limits.vocab_size
        if vocab is not None:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"{param}: token id {bad} outside [0, {vocab})", param)
        context = self.limits.max_positions
        if context is None:
            return
        if len(ids) >= context:
            raise ApiError(
                400,
                f"{param}: {len(ids)} tokens leave no room to generate in the model's context "
                f"of {context} tokens",
                param,
            )
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise ApiError(
                400,
                f"{output_param} {max_tokens}: with the prompt's {len(ids)} tokens it exceeds "
                f"the model's context of {context} tokens",
                output_param,
            )

    def _decode(self, ids: list[int]) -> str:
        try:
            if self.tokenizer is not None:
                return self.tokenizer.decode(ids)
        except Exception:  # an id out of range: refused by name later
            pass
        return ",".join(map(str, ids))  # the ids as text: prefixes stay prefixes

    def _encode(self, text: str, param: str) -> list[int]:
        """``text``'s token ids; a text too long for the model's context is refused from its
        length first (no token stands for more than so many characters), not encoded."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param)
        context = self.limits.max_positions
        if context is not None:
            least = self.tokenizer.min_tokens(text)
            if least >= context:
                raise ApiError(
                    400,
                    f"{param}: {len(text)} characters make at least {least} tokens; the "
                    f"model's context is {context} tokens",
                    param,
                )
        return self.tokenizer.encode(text)

    async def _body(self, request: Request) -> bytes:
        """The body, read no further than ``max_request_bytes`` (413 beyond)."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {int(declared)} bytes; at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _in_thread(self, work: Callable[[bytes], Any], raw: bytes) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._prepare, work, raw)

    async def _wait_ready(self) -> None:
        """503 unless a replica answers (once one has, later requests queue for a replica as
        Serve does)."""
        if self._ready:
            return
        if not await self._ping():
            raise ApiError(503, "no replica is ready yet; retry shortly")
        self._ready = True


def _check_sampling(sampling: SamplingSpec, params: dict[str, str]) -> None:
    """The engine's own check of what it can carry (a seed past 64 bits, ...): a 400 naming
    the body's field (``params`` maps the engine's names to the endpoint's)."""
    try:
        sampling.check()
    except SamplingError as exc:
        param = params.get(exc.field, exc.field)
        raise ApiError(400, f"{param}: {exc}", param) from None


def _output_param(body: ChatCompletionRequest) -> str:
    return "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"


def _chat_params(body: ChatCompletionRequest) -> dict[str, str]:
    """What a chat request calls the fields a replica names."""
    return {"prompt": "messages", "max_tokens": _output_param(body), "logprobs": "top_logprobs"}


async def _updates(responses: Any) -> AsyncIterator[EngineUpdate]:
    """The replica's updates; a replica lost on the way is a 503 (the request is not retried:
    part of its answer may already be out)."""
    try:
        async for update in responses:
            yield update
    except Exception as exc:
        log.warning("the replica serving a request failed: %r", exc)
        raise ApiError(503, "the replica serving this request failed; retry") from None


async def _first(stream: AsyncIterator[EngineUpdate], params: dict[str, str]) -> EngineUpdate:
    """The first update, before any answer goes out: a refusal is a proper HTTP error."""
    first = await anext(stream, None)
    if first is None:
        raise ApiError(503, "the replica ended the request without an answer")
    if first.error is not None:
        raise update_error(first, params)
    return first


def _json(raw: bytes) -> Any:
    """The body as JSON. Python's parser takes NaN and Infinity: the fields refuse them by
    name (a float field allows finite numbers only, an int field ints only)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not JSON") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply") from None
    except ValueError as exc:  # a number of more digits than Python converts
        raise ApiError(400, f"the request body is not JSON: {reason(exc)}") from None


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _guarded(answer: Any) -> Response:
    """An endpoint's answer; an error that is not an ``ApiError`` is logged here and its
    client gets a 500 without its text."""
    try:
        return await answer
    except ApiError:
        raise
    except Exception:
        log.exception("unexpected error answering a request")
        raise ApiError(500, INTERNAL_ERROR) from None


def ingress_deployment() -> Any:
    """``OpenAIIngress`` as a Serve deployment behind a FastAPI app of its own."""
    # no unauthenticated description of the API: /openapi.json is a route of its own, below
    app = FastAPI(title="raykv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @serve.deployment
    @serve.ingress(app)
    class RaykvIngress(OpenAIIngress):
        @app.get("/health")
        async def get_health(self) -> Response:
            return await _guarded(self.health())

        @app.get("/openapi.json", include_in_schema=False)
        async def get_openapi(self, request: Request) -> Response:
            self._authorize(request)
            return JSONResponse(app.openapi())

        @app.get("/v1/models")
        async def get_models(self, request: Request) -> Response:
            return await _guarded(self.models(request))

        @app.post("/v1/completions")
        async def post_completions(self, request: Request) -> Response:
            return await _guarded(self.completions(request))

        @app.post("/v1/chat/completions")
        async def post_chat_completions(self, request: Request) -> Response:
            return await _guarded(self.chat_completions(request))

    return RaykvIngress

"""The OpenAI API's request bodies as pydantic models, and its error shape.

Only what raykv serves is accepted; fields a client may send that change nothing here (``user``,
``frequency_penalty`` at 0, ...) are ignored, fields whose value raykv cannot honour (``n`` > 1,
``echo``) are refused by name. Errors are OpenAI's: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status that goes with them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from raykv.core.hashing import MAX_SALT_CHARS
from raykv.core.step import MAX_LOGPROBS as ENGINE_MAX_LOGPROBS
from raykv.core.step import SEED_MAX, SEED_MIN

MAX_STOP_STRINGS = 4
# A longer stop string no longer makes matching slower, but a stream holds back up to a stop
# string's length of text that may begin it (the client sees it late) and keeps a table that long
# per stop string: 1,000 characters is far beyond any delimiter a client stops on, and bounds both.
MAX_STOP_CHARS = 1_000
MAX_LOGPROBS = ENGINE_MAX_LOGPROBS
# no context is longer: a bigger max_tokens is refused by its size alone, before any other check
MAX_OUTPUT_TOKENS = 2**31 - 1


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``status`` (400, 401, 404, 503...), ``param`` the
    field at fault (None when no field is)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or _KINDS.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    # the engine's step message carries a seed as a 64-bit int
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)  # one choice per request
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)
    # as vLLM's server takes it: requests with different salts share no cached KV
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string must be at most {MAX_STOP_CHARS} characters")
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt or token ids (one prompt per request)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("one prompt per request")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text (content parts of type ``text`` joined)."""
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_wanted(self) -> int | None:
        """How many top log-probabilities per token (None: no logprobs)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return self.top_logprobs or 0


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` as ``model``, or a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"]
        param = str(loc[0]) if loc else None
        where = "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}"
            for p in loc[1:]
            if isinstance(p, int)
            or (
                p.isidentifier()  # not a union's type tag (list[int])
                and p not in _TYPE_TAGS
            )
        )
        raise ApiError(400, f"{param}{where}: {first['msg']}", param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}

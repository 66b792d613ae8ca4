"""What travels between the ingress and a replica: a request (``EngineRequest``: token ids,
already through the chat template) and the stream of updates that answers it
(``EngineUpdate``, with each generated token's ``TokenInfo`` when logprobs were asked for).
Plain records, pickled by Ray Serve; the KV-aware router reads a request's token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.core.step import SamplingSpec


@dataclass(slots=True)
class EngineRequest:
    """A request as the ingress hands it to a replica. ``prompt`` is the prompt as text (what
    a text-prefix router such as Ray Serve LLM's ``PrefixCacheAffinityRouter`` reads);
    ``max_tokens`` None: as many as the context and the GPU pool allow."""

    request_id: str
    token_ids: list[int]
    max_tokens: int | None
    sampling: SamplingSpec
    stop: list[str] = field(default_factory=list)
    prompt: str = ""
    # its cache's tenant (the request's ``cache_salt``, and its API key's where the server
    # isolates tenants by key): requests with other salts share no cached block with it
    cache_salt: str | None = None


@dataclass(slots=True)
class TokenInfo:
    """One generated token with its log-probability and the top alternatives (id, text,
    logprob, bytes). ``text`` is what the token added to the answer's text (a character split
    over two tokens comes whole with the second, the first adds ""), so the tokens' texts join
    into the text; ``raw`` is the bytes the token itself stands for (each half its own)."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float, bytes]] = field(default_factory=list)
    raw: bytes = b""


@dataclass(slots=True)
class EngineUpdate:
    """A piece of one request's stream. The last has ``finish_reason`` (stop, length, abort) or
    ``error`` with its HTTP ``status`` and, for a 400, the request's ``param`` at fault."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt: from the GPU prefix cache and the tiers
    cpu_tier_tokens: int = 0  # of those, from the CPU tier
    disk_tier_tokens: int = 0  # ... promoted from the disk tier
    shared_tier_tokens: int = 0  # ... and read from the shared tier (Mooncake Store)
    error: str | None = None
    status: int = 200
    param: str | None = None
    replica: str = ""  # the Serve replica that answered

"""A real multi-turn chat for a real model: conversations whose answers feed their next turn.

Each conversation is a topic with a few questions asked one after the other. A turn's prompt is
the whole conversation so far through the model's chat template: earlier questions, the model's
own answers to them (decoded text), and the new question. So a conversation's next prompt
extends its previous prompt and answer (a prefix the GPU cache or the CPU tier may still hold),
and a turn can only be sent once the previous one has been answered: the workload is driven by
the answers (``ChatSession.answered``), not replayed from a list. Several conversations are open
at once, so they take turns at the engine and push each other's KV out of the GPU pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raykv.workload.requests import RequestSpec

Messages = list[dict[str, Any]]

TOPICS: tuple[tuple[str, ...], ...] = (
    (
        "What is the capital of France?",
        "What is it famous for?",
        "Which river runs through it?",
        "Name one museum there.",
    ),
    (
        "What is photosynthesis?",
        "Which part of the plant does it happen in?",
        "Why are leaves green?",
        "What do plants release into the air?",
    ),
    (
        "Give me a short tip for writing clean Python code.",
        "What is a list comprehension?",
        "Show a one-line example.",
        "When should I avoid one?",
    ),
    (
        "What causes rain?",
        "What is a cloud made of?",
        "Why is the sky blue?",
        "What is a rainbow?",
    ),
    (
        "Suggest a healthy breakfast.",
        "Why is it healthy?",
        "How long does it take to make?",
        "Suggest a drink to go with it.",
    ),
    (
        "What is the largest planet in the solar system?",
        "How many moons does it have?",
        "What is its Great Red Spot?",
        "Could a person stand on it?",
    ),
    (
        "How do I boil an egg?",
        "How do I know when it is done?",
        "How should I store boiled eggs?",
        "Name a dish that uses them.",
    ),
    (
        "What is the speed of light?",
        "Why can nothing go faster?",
        "How long does light take to reach us from the Sun?",
        "What is a light-year?",
    ),
)


@dataclass(slots=True)
class Conversation:
    topic: int
    number: int
    messages: Messages = field(default_factory=list)
    asked: int = 0  # questions sent so far


@dataclass(slots=True)
class Exchange:
    """One answered turn, for the samples a run prints."""

    conversation: int
    question: str
    answer: str


class ChatSession:
    """``num_requests`` turns over conversations of ``turns`` questions each, ``concurrent``
    open at once. ``start`` gives the first turns; ``answered`` takes each finished turn's
    tokens and gives the turns it unblocks (its conversation's next, or a new conversation's
    first). ``chat_ids(messages)`` is the model's chat template with the generation prompt;
    ``decode(token ids)`` its detokenizer."""

    def __init__(
        self,
        num_requests: int,
        *,
        chat_ids: Callable[[Messages], list[int]],
        decode: Callable[[Sequence[int]], str],
        max_tokens: int,
        concurrent: int = 4,
        turns: int = 4,
        seed: int = 0,
    ) -> None:
        self.chat_ids, self.decode = chat_ids, decode
        self.max_tokens = max_tokens
        self.turns = max(1, min(turns, min(len(t) for t in TOPICS)))
        self._left = num_requests  # turns not yet handed out
        self._concurrent = max(1, concurrent)
        self._seed = seed
        self._open: dict[str, Conversation] = {}  # by the request id of its turn in flight
        self._started = 0
        self.exchanges: list[Exchange] = []

    def start(self) -> list[RequestSpec]:
        return [s for s in (self._new_conversation() for _ in range(self._concurrent)) if s]

    def answered(self, req_id: str, tokens: Sequence[int]) -> list[RequestSpec]:
        """The turn ``req_id`` was answered (or refused: no tokens); the turns that follow."""
        conv = self._open.pop(req_id, None)
        if conv is None:
            return []
        answer = self.decode(tokens) if tokens else ""
        question = conv.messages[-1]["content"]
        self.exchanges.append(Exchange(conv.number, question, answer))
        if tokens and conv.asked < self.turns:
            conv.messages.append({"role": "assistant", "content": answer})
            follow = self._ask(conv)
            if follow is not None:
                return [follow]
        follow = self._new_conversation()
        return [follow] if follow is not None else []

    def _new_conversation(self) -> RequestSpec | None:
        # topics in turn (from the seed's), so that a run's conversations differ
        conv = Conversation((self._seed + self._started) % len(TOPICS), self._started)
        self._started += 1
        return self._ask(conv)

    def _ask(self, conv: Conversation) -> RequestSpec | None:
        if self._left <= 0:
            return None
        self._left -= 1
        conv.messages.append({"role": "user", "content": TOPICS[conv.topic][conv.asked]})
        conv.asked += 1
        req_id = f"chat-{conv.number}-{conv.asked}"
        self._open[req_id] = conv
        return RequestSpec(req_id, tuple(self.chat_ids(conv.messages)), self.max_tokens, 0.0)

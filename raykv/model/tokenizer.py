"""The tokenizer and chat template of a checkpoint, through transformers' ``AutoTokenizer``:
from a Hugging Face directory or from the metadata of a GGUF file (converted once and kept in
the weights cache: the conversion reads the whole vocabulary, seconds for a 49k-token one)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raykv.model.spec import UnsupportedModel
from raykv.model.weights import gguf_identity

log = logging.getLogger(__name__)


class Tokenizer:
    """Text to token ids and back, and chat messages through the model's template.
    ``cache_dir`` (the config's ``model.cache_dir``) keeps a GGUF file's tokenizer
    converted, in transformers' own format; None converts it on every start."""

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        from transformers import AutoTokenizer

        file = Path(path)
        if file.is_file() and file.suffix == ".gguf":
            self._tok = _gguf_tokenizer(file, cache_dir)
        elif file.is_dir():
            present = _tokenizer_files(file)
            if not present:  # transformers would guess a class from config.json
                raise UnsupportedModel(missing_tokenizer(file))
            try:
                self._tok = AutoTokenizer.from_pretrained(str(file))
            except Exception as exc:  # its own classes too: it checks all of config.json
                raise UnsupportedModel(
                    f"{file}: its tokenizer ({', '.join(present)}) cannot be loaded: "
                    f"{_one_line(exc)}"
                ) from exc
        else:
            raise UnsupportedModel(f"{file}: neither a model directory nor a .gguf file")

    @classmethod
    def of(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none (token ids only;
        ``missing_tokenizer`` says what is missing)."""
        try:
            return cls(path, cache_dir)
        except (OSError, ValueError, TypeError, KeyError):  # KeyError: a GGUF without tokens
            return None

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` in the chat template, with the generation prompt."""
        return self.encode(self.render_chat(messages))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """``messages`` through the chat template, with the generation prompt, as text (what
        ``chat`` encodes, as transformers does: without adding special tokens).
        ``ChatTemplateError`` when the template refuses them (Mistral's and Llama 2's raise on
        roles that do not alternate)."""
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        if not self._tok.chat_template:
            raise UnsupportedModel("this model has no chat template: send a prompt instead")
        try:
            return self._tok.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except TemplateSyntaxError:
            raise  # the checkpoint's template is broken: not the messages' fault
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary string's length (a
        byte-level token's string has one character per byte, a SentencePiece token's one per
        character, a byte-fallback token's several for one)."""
        return max(map(len, self._tok.get_vocab()))

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` from the text's length alone, so a prompt
        that cannot fit a context is refused without encoding it: no token stands for more
        than ``max_token_chars`` characters of the text, or of the normalized text where the
        tokenizer normalizes first (Unicode composition shortens a text by up to about a
        third: counted with room to spare)."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None
        per_token = self.max_token_chars * (NORMALIZED_SHRINK if normalizes else 1)
        return -(-len(text) // per_token)


# how many times shorter normalization may make a text, at most, for ``min_tokens``
NORMALIZED_SHRINK = 4


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages; the message is the template's."""


# the files transformers builds a tokenizer from: a directory with none of them ships none
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tekken.json",
)


def _tokenizer_files(directory: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (directory / name).is_file()]


def missing_tokenizer(path: str | Path) -> str:
    """What the checkpoint at ``path`` lacks where ``Tokenizer.of`` found no tokenizer in it,
    naming the checkpoint (one line, to start an error message)."""
    file = Path(path)
    if not file.is_dir():
        return f"{file}: no tokenizer in its GGUF metadata"
    present = _tokenizer_files(file)
    if not present:
        return f"{file}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])} or the like)"
    try:  # only on the way to an error: loading it again says why it failed
        Tokenizer(file)
    except UnsupportedModel as exc:
        return str(exc)
    except Exception as exc:
        return f"{file}: its tokenizer ({', '.join(present)}) cannot be loaded: {_one_line(exc)}"
    return f"{file}: its tokenizer ({', '.join(present)}) could not be loaded"


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line: its first, and the next where the first ends in a
    colon (transformers' validation errors put the field there and the fault below)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _gguf_tokenizer(file: Path, cache_dir: str | Path | None) -> Any:
    from transformers import AutoTokenizer

    if not cache_dir:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    target = Path(cache_dir) / "tokenizers" / f"{file.stem}-{gguf_identity(file)}"
    if target.is_dir():
        return AutoTokenizer.from_pretrained(str(target))
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(partial))
        os.rename(partial, target)  # whole or absent; a process that got there first keeps its
    except OSError as exc:
        if not target.is_dir():
            log.warning("cannot cache the tokenizer in %s (%s)", target.parent, exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer

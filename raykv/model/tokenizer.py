"""The tokenizer and chat template of a checkpoint, through transformers' ``AutoTokenizer``:
from a Hugging Face directory or from the metadata of a GGUF file (converted once and kept in
the weights cache: the conversion reads the whole vocabulary, seconds for a 49k-token one)."""

from __future__ import annotations

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
            self._tok = AutoTokenizer.from_pretrained(str(file))
        else:
            raise UnsupportedModel(f"{file}: neither a model directory nor a .gguf file")

    @classmethod
    def of(cls, path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships none (token ids only)."""
        try:
            return cls(path, cache_dir)
        except (OSError, ValueError, TypeError):
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
        if not self._tok.chat_template:
            raise UnsupportedModel("this model has no chat template: send a prompt instead")
        ids = self._tok.apply_chat_template(list(messages), add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])


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

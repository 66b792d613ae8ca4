"""The tokenizer and chat template of a checkpoint, through transformers' ``AutoTokenizer``:
from a Hugging Face directory or from the metadata of a GGUF file (converted once and kept in
the weights cache: the conversion reads the whole vocabulary, seconds for a 49k-token one)."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raykv.model.checkpoint import gguf_identity
from raykv.model.spec import UnsupportedModel

log = logging.getLogger(__name__)


class Tokenizer:
    """Text to token ids and back, and chat messages through the model's template.
    ``cache_dir`` (the config's ``model.cache_dir``) keeps a GGUF file's tokenizer
    converted, in transformers' own format; None converts it on every start."""

    def __init__(self, path: str | Path, cache_dir: str | Path | None = None) -> None:
        file = Path(path)
        if file.is_file() and file.suffix == ".gguf":
            self._tok = _gguf_tokenizer(file, cache_dir)
        elif file.is_dir():
            present = _tokenizer_files(file)
            if not present:  # transformers would guess a class from config.json
                raise UnsupportedModel(missing_tokenizer(file))
            try:
                self._tok = _directory_tokenizer(file)
            except Exception as exc:  # transformers' own, of every kind and class
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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs ``bytes``: the two halves of a
        character split over two tokens each carry theirs). A byte-level vocabulary spells each
        byte as one character; a SentencePiece one spells a space as U+2581 and a byte it has no
        piece for as ``<0xNN>``; anything else is the token's text."""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str):
            return b""
        if self._byte_level:
            spelled = _byte_spelling()
            if all(ch in spelled for ch in piece):
                return bytes(spelled[ch] for ch in piece)
        fallback = _BYTE_PIECE.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback[1], 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        backend = getattr(self._tok, "backend_tokenizer", None)
        return backend is not None and type(backend.decoder).__name__ == "ByteLevel"

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary string's length (a
        byte-level token's string has one character per byte, a SentencePiece token's one per
        character, a byte-fallback token's several for one)."""
        return max(map(len, self._tok.get_vocab()))

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` from the text's length alone, so a prompt
        that cannot fit a context is refused without encoding it (0 where this tokenizer
        allows no sound bound). No token stands for more than ``max_token_chars`` characters,
        of the text or of what its normalizer makes of it (``_shrink``); a special token that
        absorbs the whitespace beside it stands for a run of it as if it were one character."""
        bound = self._length_bound
        if bound is None:
            return 0
        per_token, absorbs = bound
        if absorbs:
            text = _WHITESPACE_RUN.sub(" ", text)
        return -(-len(text) // per_token)

    @functools.cached_property
    def _length_bound(self) -> tuple[int, bool] | None:
        """(characters one token stands for at most, whether special tokens absorb the
        whitespace beside them), or None: runs of unknown characters fuse into one token, or
        the normalizer may delete characters."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        described = json.loads(backend.to_str())
        model = described.get("model") or {}
        if model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
        shrink = _shrink(described.get("normalizer"))
        if shrink is None or not _keeps_characters(described.get("pre_tokenizer")):
            return None
        absorbs = any(t.get("lstrip") or t.get("rstrip") for t in described["added_tokens"])
        return self.max_token_chars * shrink + absorbs, absorbs


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times shorter a normalizer (its JSON description) may make a text, at most;
    None where it may delete characters (stripping, accents, control characters) or its effect
    is not known here. Unicode composition (NFC, NFKC) joins at most four code points into one:
    the longest canonical decomposition is four."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            shrink = _shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in ("NFC", "NFKC"):
        return 4
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1  # these only keep or lengthen a text
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        if pattern is None or not content:
            return None  # a regular expression, or a deletion
        return max(1, -(-len(pattern) // len(content)))
    return None


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer (its JSON description) only splits the text, deleting nothing
    (BERT's whitespace splitting drops the whitespace: a run of it would be no token at all)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts")


_WHITESPACE_RUN = re.compile(r"\s+")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_spelling() -> dict[str, int]:
    """How a byte-level vocabulary spells each byte as one character (GPT-2's scheme): the
    printable Latin-1 bytes as themselves, the other 68 as the characters from U+0100 on, in
    byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelled = {chr(b): b for b in kept}
    others = sorted(set(range(256)) - set(kept))
    for offset, byte in enumerate(others):
        spelled[chr(256 + offset)] = byte
    return spelled


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


# the class names of a tokenizer that is its tokenizer.json and nothing else: built from that
# file by transformers' generic class, without the model registry AutoTokenizer imports and reads
# first (seconds of every start of every process that loads a tokenizer: a served replica, its
# ingress)
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# the model types whose generic tokenizer AutoTokenizer also builds as named (no config.json: a
# GGUF file's converted tokenizer). Others it may build with a class of the model's own that
# rewrites the pipeline (Qwen2's does, whatever the file names), so they go through it
_GENERIC_MODEL_TYPES = frozenset({None, "llama", "mistral", "qwen3"})


def _directory_tokenizer(directory: Path) -> Any:
    """transformers' tokenizer of a Hugging Face directory: built by its generic class where
    that is what ``AutoTokenizer`` would build (the file names that class, the model type keeps
    it, no code or Mistral vocabulary of its own), otherwise ``AutoTokenizer``'s choice."""
    settings = _json_object(directory / "tokenizer_config.json")
    named = settings.get("tokenizer_class")
    model_type = _json_object(directory / "config.json").get("model_type")
    generic = (
        isinstance(named, str)
        and named in _GENERIC_CLASSES
        and model_type in _GENERIC_MODEL_TYPES
        and (directory / "tokenizer.json").is_file()
        and not (directory / "tekken.json").exists()
        and settings.get("auto_map") is None
    )
    if generic:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; empty where the file is missing, unreadable or holds
    something else (transformers then says what is wrong with it)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _gguf_tokenizer(file: Path, cache_dir: str | Path | None) -> Any:
    target = None
    if cache_dir:
        target = Path(cache_dir) / "tokenizers" / f"{file.stem}-{gguf_identity(file)}"
        if target.is_dir():
            return _directory_tokenizer(target)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    if target is None:
        return tokenizer
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

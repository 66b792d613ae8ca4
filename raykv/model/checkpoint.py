"""Where a checkpoint is and what it is, without loading its weights (no torch): a preset name,
a Hugging Face directory or a GGUF file, and the config that serves it. What is read is checked
where it is read (config.json's fields, a GGUF file's header, each safetensors file's header),
so a broken checkpoint is refused naming the file, and the field, before any rank loads it.

``configure`` sets the config's model and KV-cache geometry from the checkpoint: layers, KV
heads, head size, vocabulary, and the KV groups (one per attention kind: full attention and each
sliding window), so the pages the ranks allocate are the pages the model reads and writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import numbers
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from raykv.config import GroupConfig, RaykvConfig
from raykv.error_text import first_line, reason
from raykv.model.presets import PRESETS, preset_path
from raykv.model.spec import KVPlacement, ModelSpec, UnsupportedModel, eos_token_ids

log = logging.getLogger(__name__)

_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_SAMPLE = 1 << 20  # bytes read from each end of a GGUF file to name its cache entry
# in the name of a kept config (and beside the config in a weights-cache entry): a raykv that
# reads more of the metadata reads the file again
KEPT_CONFIG_VERSION = 1


def gguf_identity(path: Path) -> str:
    """A name for the GGUF file ``path`` as it is now: from the file's place, size, modification
    time and its first and last MiB (a rewrite within one clock tick still changes the header
    or the last tensors), so what is cached of a changed file is made again; reading the whole
    file would cost seconds per start for a large model."""
    stat = path.stat()
    identity = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as file:
        identity.update(file.read(_SAMPLE))
        file.seek(max(0, stat.st_size - _SAMPLE))
        identity.update(file.read(_SAMPLE))
    return identity.hexdigest()[:16]


def resolve(path: str) -> Path:
    """A preset's file, or the given directory or ``.gguf`` file (which must exist)."""
    if path in PRESETS:
        return preset_path(path)
    file = Path(path)
    if file.is_dir() or (file.is_file() and file.suffix == ".gguf"):
        return file
    raise UnsupportedModel(
        f"model.path {path!r}: no such model directory or .gguf file "
        f"(presets: {', '.join(PRESETS)})"
    )


def config_file(path: Path) -> Path:
    """The file a checkpoint's config is read from: a directory's ``config.json``, or the
    GGUF file itself (its metadata)."""
    return path / "config.json" if path.is_dir() else path


def hf_config(path: Path, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """``config.json``'s contents, or the same keys read from a GGUF file's metadata (kept in
    ``cache_dir``, where given, for the next start)."""
    if path.is_dir():
        config = config_file(path)
        if not config.is_file():
            raise UnsupportedModel(f"{path}: no config.json")
        return read_json_object(config)
    return cached_gguf_config(path, cache_dir)


def read_spec(path: Path, cache_dir: str | Path | None = None) -> ModelSpec:
    """The model a checkpoint (a directory or a GGUF file) describes; every error names the
    file at fault and, where one is, the field."""
    return ModelSpec.from_hf_config(hf_config(path, cache_dir), config_file(path))


def cached_gguf_config(path: Path, cache_dir: str | Path | None) -> dict[str, Any]:
    """``gguf_config`` of the GGUF file ``path``, kept in ``cache_dir`` under the file's
    identity (``gguf_identity``: a file changed or cut short is read again). Reading it means
    parsing the whole metadata, the vocabulary's every string with it: 10 s for a 49k-token
    one, at every start of every command, where the kept copy is a small JSON file. A kept copy
    that no longer describes a model is dropped and the file read again."""
    if cache_dir is None:
        return gguf_config(read_gguf(path), path)
    name = f"{path.stem}-{gguf_identity(path)}-v{KEPT_CONFIG_VERSION}.json"
    target = Path(cache_dir) / "configs" / name
    try:
        kept = json.loads(target.read_text(encoding="utf-8"))
        ModelSpec.from_hf_config(kept, target)
        return kept
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, AttributeError):  # damaged, or edited by hand
        with contextlib.suppress(OSError):
            target.unlink()
    config = gguf_config(read_gguf(path), path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # a name no other writer has (two nodes sharing the cache may share a pid), replaced
        # whole onto the target
        fd, partial = tempfile.mkstemp(prefix=f".{name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(config, out)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as exc:
        log.warning("cannot keep the GGUF file's config in %s (%s)", target.parent, exc)
    return config


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON file holding one object (``config.json``, ``generation_config.json``), refused
    naming the file when it cannot be read, is not JSON or holds something else."""
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise UnsupportedModel(f"{file}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise UnsupportedModel(f"{file}: not UTF-8 text ({exc.reason})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise UnsupportedModel(f"{file}: not valid JSON ({exc.msg} at {where})") from None
    except (ValueError, RecursionError) as exc:  # a number of too many digits, too deep a nest
        raise UnsupportedModel(f"{file}: not valid JSON ({reason(exc)})") from None
    if not isinstance(value, dict):
        raise UnsupportedModel(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


GGUF_MAGIC = b"GGUF"


def read_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of the file (its metadata, and its tensors mapped, not read); a
    file that is not GGUF, or is no longer whole, is refused naming it."""
    from gguf import GGUFReader

    try:
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise UnsupportedModel(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        found = "it is empty" if not magic else f"it starts with {magic!r}, not {GGUF_MAGIC!r}"
        raise UnsupportedModel(f"{path}: not a valid GGUF file ({found})")
    try:
        return GGUFReader(str(path))
    except OSError as exc:
        raise UnsupportedModel(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:
        # the reader fails in many ways where its header runs past the end of the file or
        # holds nonsense (numpy's reshape and view, an index beyond the data, undecodable
        # text): each means the file is cut short or garbled
        raise UnsupportedModel(
            f"{path}: not a valid GGUF file, or no longer a whole one (truncated or corrupt: "
            f"{first_line(exc)})"
        ) from None


def gguf_config(reader: Any, file: Path | str | None = None) -> dict[str, Any]:
    """A GGUF file's metadata as ``config.json``'s keys; a key missing or of the wrong kind
    is refused naming it (and ``file``, where given)."""
    at = f"{file}: " if file is not None else ""

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"{at}GGUF architecture {arch!r} is not supported")

    def integer(key: str, default: Any = None) -> int:
        value = field(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModel(f"{at}GGUF metadata has no {arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise UnsupportedModel(
                f"{at}GGUF key {arch}.{key} must be a positive integer, got {value!r}"
            )
        return int(value)

    def number(key: str, default: float) -> float:
        value = field(f"{arch}.{key}", default)
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not real or not math.isfinite(value) or value <= 0:
            raise UnsupportedModel(f"{at}GGUF key {arch}.{key} must be a number > 0, got {value!r}")
        return float(value)

    heads = integer("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = integer("vocab_size", len(tokens.data) if tokens is not None else None)
    hidden = integer("embedding_length")
    config: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": integer("feed_forward_length"),
        "num_hidden_layers": integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer("attention.head_count_kv", heads),
        "head_dim": integer("attention.key_length", hidden // heads or None),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": number("rope.freq_base", 10000.0),
        "max_position_embeddings": integer("context_length", 2048),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # linear is what Llama files use; others are refused
        config["rope_scaling"] = {
            "rope_type": str(scaling),
            "factor": number("rope.scaling.factor", 1.0),
        }
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is not None:
        if isinstance(eos, bool) or not isinstance(eos, numbers.Integral) or eos < 0:
            raise UnsupportedModel(
                f"{at}GGUF key tokenizer.ggml.eos_token_id must be a token id, got {eos!r}"
            )
        config["eos_token_id"] = int(eos)
    return config


def configure(cfg: RaykvConfig) -> tuple[RaykvConfig, ModelSpec, Path]:
    """``cfg`` with the model's geometry taken from ``cfg.model.path``'s checkpoint."""
    if cfg.model.path is None:
        raise ValueError("configure needs model.path")
    path = resolve(cfg.model.path)
    spec = read_spec(path, cfg.model.cache_dir)
    spec.check_tensor_parallel(cfg.parallel.tensor_parallel_size)
    placement, kinds = KVPlacement.for_windows(spec.windows)
    groups = [
        GroupConfig() if w is None else GroupConfig(kind="sliding_window", window_tokens=w)
        for w in kinds
    ]
    model = cfg.model.model_copy(
        update={
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "kv_layers_per_group": placement.layers_per_group,
            "max_positions": _context(cfg.model.max_positions, spec.max_positions),
            "stop_token_ids": sorted(
                {*cfg.model.stop_token_ids, *spec.eos_token_ids, *_generation_eos(path)}
            ),
        }
    )
    cache = cfg.cache.model_copy(update={"groups": groups})
    if path.is_dir():  # after its config files: each names its own fault first
        check_safetensors(path, spec)  # a GGUF file's tensors were found whole by read_spec
    return cfg.model_copy(update={"model": model, "cache": cache}), spec, path


def _context(asked: int | None, checkpoint: int) -> int:
    """The context a request may fill: ``model.max_positions`` where it asks for less than
    the checkpoint was trained for (a server's tighter limit), the checkpoint's otherwise (it
    computes no further), with a warning when that overrides what was asked."""
    if asked is None or asked == checkpoint:
        return checkpoint
    if asked < checkpoint:
        return asked
    log.warning(
        "model.max_positions %d: the checkpoint's context is %d tokens; serving %d",
        asked,
        checkpoint,
        checkpoint,
    )
    return checkpoint


def _generation_eos(path: Path) -> list[int]:
    """The EOS tokens of a directory's ``generation_config.json`` (chat models often list
    more there than in ``config.json``)."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return []
    config = read_json_object(file)
    try:
        return list(eos_token_ids(config.get("eos_token_id")))
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"{file}: {exc}") from None


def safetensors_files(directory: Path) -> list[Path]:
    """A Hugging Face directory's weight files, refused naming the directory when it has none."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{directory}: no *.safetensors file (the model's weights)")
    return files


def open_safetensors(file: Path, framework: str = "numpy") -> Any:
    """``safetensors.safe_open`` of ``file`` (its header read and checked against the file's
    size, no tensor read); a file that is not safetensors, or cut short, is refused naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework=framework)
    except (SafetensorError, OSError) as exc:
        raise UnsupportedModel(
            f"{file}: not a valid safetensors file ({first_line(exc)})"
        ) from None


def check_safetensors(directory: Path, spec: ModelSpec) -> None:
    """Refuse a directory without weights, with a weight file that is not whole, or without a
    tensor the model reads, before any rank loads it: each file's header is read, no tensor."""
    present: set[str] = set()
    for file in safetensors_files(directory):
        with open_safetensors(file) as weights:
            present.update(weights.keys())
    for name in spec.required_tensors():
        if name not in present:
            raise UnsupportedModel(f"{directory}: the checkpoint has no tensor {name!r}")


def with_stop_tokens(cfg: RaykvConfig, token_ids: Iterable[int | None]) -> RaykvConfig:
    """``cfg`` with more tokens that end a request (a tokenizer's EOS beside the checkpoint's;
    None is skipped)."""
    stops = sorted({*cfg.model.stop_token_ids, *(t for t in token_ids if t is not None)})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"stop_token_ids": stops})})


# windows of a weights file read for its fingerprint: enough spread that two checkpoints of one
# architecture (a fine-tune, a requantization) differ in what is read, little enough to read
_FINGERPRINT_WINDOWS = 16
_FINGERPRINT_WINDOW = 64 * 1024


def fingerprint(path: Path) -> str:
    """What identifies a checkpoint's weights (hex): each weights file's name and size and 16
    windows of 64 KiB spread over it (its first and last included), and the config. The same on
    every node that holds the same files, wherever they are and whenever they were copied; a
    change to a header, a file's size, a quantization or most retrained layers changes it, but
    an edit confined to bytes between the windows (a few layers changed in place) does not: give
    such a checkpoint its own ``offload.disk.path``. About 1 MiB read per file."""
    files = [path] if not path.is_dir() else [*safetensors_files(path), config_file(path)]
    return files_fingerprint([(file.name, file) for file in files])


def files_fingerprint(files: Sequence[tuple[str, Path]]) -> str:
    """A digest (hex) of these files, each by the name given, its size and the 16 windows of
    ``fingerprint``."""
    digest = hashlib.blake2b(digest_size=16)
    for name, file in files:
        size = file.stat().st_size
        digest.update(f"{name}\0{size}\0".encode())
        step = max(0, size - _FINGERPRINT_WINDOW) // max(1, _FINGERPRINT_WINDOWS - 1)
        with open(file, "rb") as fh:
            for i in range(_FINGERPRINT_WINDOWS):
                fh.seek(min(i * step, max(0, size - _FINGERPRINT_WINDOW)))
                digest.update(fh.read(_FINGERPRINT_WINDOW))
    return digest.hexdigest()

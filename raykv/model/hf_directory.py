"""A GGUF checkpoint as a Hugging Face directory, for engines that read only those (vLLM).

raykv reads a GGUF file itself: it dequantizes the tensors once into its weights cache (one
safetensors file, Hugging Face's tensor names) and converts the tokenizer once into its
tokenizer cache. A Hugging Face directory is those two entries and a ``config.json``: made here
beside them, its tensors a link to the cached file (no second copy of the weights).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from raykv.model.checkpoint import cached_gguf_config, gguf_identity
from raykv.model.spec import UnsupportedModel

# the Hugging Face class of each GGUF architecture raykv reads
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_directory(gguf: Path, cache_dir: str | Path) -> Path:
    """The Hugging Face directory of the GGUF file ``gguf`` in ``cache_dir`` (made on first
    use, whole or not at all): ``config.json``, ``model.safetensors`` and the tokenizer's
    files."""
    from raykv.model.tokenizer import Tokenizer
    from raykv.model.weights import cached_gguf_path, load_gguf_weights

    target = Path(cache_dir) / "hf" / f"{gguf.stem}-{gguf_identity(gguf)}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target  # whole, its weights link not left dangling by a cleared weights cache
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    config = dict(cached_gguf_config(gguf, cache_dir))
    architecture = ARCHITECTURES.get(str(config.get("model_type")))
    if architecture is None:
        raise UnsupportedModel(
            f"{gguf}: no Hugging Face class for architecture {config.get('model_type')!r}"
        )
    load_gguf_weights(gguf, cache_dir)  # makes the weights cache's entry
    weights = cached_gguf_path(gguf, cache_dir)
    if not weights.is_file():
        raise OSError(f"cannot keep {gguf}'s dequantized weights in {cache_dir}")
    Tokenizer(gguf, cache_dir)  # makes the tokenizer cache's entry
    tokenizer = Path(cache_dir) / "tokenizers" / f"{gguf.stem}-{gguf_identity(gguf)}"
    config.update(architectures=[architecture], torch_dtype="float32")
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        for file in tokenizer.iterdir():
            shutil.copy2(file, partial / file.name)
        os.symlink(weights.resolve(), partial / "model.safetensors")
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.rename(partial, target)  # a process that got there first keeps its own
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def model_directory(model: str) -> str:
    """A Hugging Face directory for ``model``: itself, or a preset's or GGUF file's, made once
    in raykv's weights cache (vLLM reads directories)."""
    from raykv.config import ConfigError
    from raykv.model.checkpoint import resolve
    from raykv.model.spec import UnsupportedModel

    try:
        path = resolve(model)
    except UnsupportedModel as exc:
        raise ConfigError(f"--model: {exc}") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model}: no config.json (a Hugging Face directory?)")
        return str(path)
    cache = os.environ.get("RAYKV_WEIGHTS_CACHE") or str(Path.home() / ".cache" / "raykv")
    return str(hf_directory(path, cache))

"""What a vLLM worker runs, as the namespace of raykv's persistent tiers needs it: the model's
configuration as vLLM resolved it and a fingerprint of the weights it holds in memory.

The files under a model's path are not what runs: ``hf_overrides`` change the configuration
after it is read (a ``rope_theta`` for long context gives every position other KV), a
``--revision`` or a file replaced at the same path loads other weights, and a weight update in a
running engine (an RLHF step: ``apply_model``, a weight sync) changes them with no file touched.
So the worker reads what it was given: vLLM's ``ModelConfig`` after every override, and the
parameters of the model it loaded, found from the attention layers vLLM registered for the
forward pass (whatever the format they came from: safetensors, ``.bin``, GGUF, sharded).

The fingerprint hashes each parameter's name, shape and dtype and ``SAMPLES`` of its elements
spread evenly over it (the first and last among them), copied to the host: about a millisecond
per hundred parameters, on any device. Replicas that hold the same weights agree; an update
that moves a parameter at all moves the sampled elements of it with near certainty (a training
step changes nearly every element; a change confined to a few elements between the samples
would not be seen).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SAMPLES = 1024  # elements hashed per parameter
# the configuration's entries that say nothing of a KV byte (where it was read, by which version)
_NOT_THE_MODEL = ("transformers_version", "name_or_path")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def served_model(layers: Mapping[str, Any]) -> torch.nn.Module | None:
    """The model that holds ``layers`` (vLLM's attention layers by name: its static forward
    context), its outermost module; None where none is found. A walk over the modules the
    collector tracks, once per call (a fraction of a second)."""
    anchors = [layer for layer in layers.values() if isinstance(layer, torch.nn.Module)]
    if not anchors:
        return None
    parent: dict[int, torch.nn.Module] = {}
    module = torch.nn.Module
    for obj in gc.get_objects():
        # the type, not isinstance: that asks some objects for their __class__, which a
        # deprecated module attribute answers with a warning
        if issubclass(type(obj), module):
            for child in obj._modules.values():
                if child is not None:
                    parent[id(child)] = obj
    node = anchors[0]
    while id(node) in parent:
        node = parent[id(node)]
    return None if node is anchors[0] else node


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest (hex) of the parameters ``model`` holds now (the module's docstring)."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            data = parameter.detach()
            digest.update(f"{name}\0{tuple(data.shape)}\0{data.dtype}\0".encode())
            flat = data.reshape(-1)
            count = flat.numel()
            if count == 0:
                continue
            if count > SAMPLES:
                picks = torch.linspace(0, count - 1, SAMPLES, device=flat.device).long()
                flat = flat.index_select(0, picks)
            sample = flat.contiguous().cpu()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def files_fingerprint(path: str) -> str:
    """Where the loaded model cannot be found: the weight files under ``path`` (any format
    vLLM loads), as raykv's own engine fingerprints a checkpoint's files. An update in memory
    then goes unseen (said in the log where this is used)."""
    from raykv.model.checkpoint import files_fingerprint as of_files

    root = Path(path)
    if root.is_file():
        return of_files([(root.name, root)])
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return of_files([(str(file.relative_to(root)), file) for file in files])


def model_configuration(vllm_config: Any) -> dict[str, Any]:
    """What of vLLM's resolved configuration a KV byte depends on: the model's configuration
    after ``hf_overrides`` (its architecture, geometry, rotary embedding, ...), the dtype it
    computes in, its quantization and the KV cache's dtype."""
    model = vllm_config.model_config
    hf = model.hf_config.to_dict()
    kept = {
        key: value
        for key, value in hf.items()
        if not key.startswith("_") and key not in _NOT_THE_MODEL
    }
    return json.loads(
        json.dumps(
            {
                "hf_config": kept,
                "dtype": str(model.dtype),
                "quantization": model.quantization,
                "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
            },
            sort_keys=True,
            default=str,
        )
    )

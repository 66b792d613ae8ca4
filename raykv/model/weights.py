"""Checkpoint files: a Hugging Face directory (``config.json`` and ``*.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from raykv.model.spec import ModelSpec, UnsupportedModel


def load_hf_directory(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The model's description and every tensor of its safetensors files, by name."""
    root = Path(path)
    config = root / "config.json"
    if not config.is_file():
        raise UnsupportedModel(f"{root}: no config.json")
    spec = ModelSpec.from_hf_config(json.loads(config.read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{root}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return spec, weights

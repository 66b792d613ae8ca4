"""Whether a transfer device can hold ranks on this machine, asked before anything is deployed,
so a config naming a device the machine lacks gets a plain answer instead of an engine error."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


def device_problem(device: str, gpus: int = 1) -> str | None:
    """Why ``device`` cannot run here with ``gpus`` GPUs (one per rank where each rank has its
    own), or None when it can. ``cpu`` always can."""
    if device == "cpu":
        return None
    if device != "cuda":
        return f"unknown device {device!r} (known: {', '.join(DEVICES)})"
    if not torch.cuda.is_available():
        return f"CUDA is not available on this machine (torch {torch.__version__})"
    found = torch.cuda.device_count()
    if found < gpus:
        return f"{gpus} ranks need one GPU each; this machine has {found}"
    return None


def use_cpu_threads(count: int) -> None:
    """Have this process's torch use ``count`` threads (a CPU rank's share of its node)."""
    torch.set_num_threads(count)

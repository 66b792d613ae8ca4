"""What the ``raykv`` commands share: argument types, the flag groups several commands take
(workload, real model, config and ``--set``), and the checks made before any work starts."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from raykv.config import ConfigError, RaykvConfig, load_config

DEFAULT_RUN_CONFIG = "configs/local.yaml"


def int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _int_from(text: str, smallest: int, expected: str) -> int:
    """``text`` as an int (``_`` separators allowed) of at least ``smallest``, else an
    argparse error saying what was ``expected``."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = smallest - 1
    if value < smallest:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    return _int_from(text, 0, "0 or a positive integer")


def positive_int(text: str) -> int:
    return _int_from(text, 1, "a positive integer")


def check_output(flag: str, path: str | None) -> None:
    """Refuse an output file that cannot be written before the work, not after it."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory {str(parent)!r}")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot write into {str(parent)!r}")


def check_device(cfg: RaykvConfig, engine: str, address: str | None) -> None:
    """A device this machine lacks gets one line naming parallel.device, before anything is
    deployed (the ranks would fail to build it, or on an embedded Ray wait for GPUs that do not
    exist). On a joined cluster the ranks run on its nodes, not here: nothing to check."""
    device = cfg.parallel.device
    if device == "cpu":
        return
    if engine == "local":
        gpus = 1  # ranks in one process share the GPUs there are
    elif address or os.environ.get("RAY_ADDRESS"):
        return
    else:
        gpus = cfg.parallel.tensor_parallel_size  # the embedded Ray gives each rank a GPU
    from raykv.transfer.devices import device_problem

    problem = device_problem(device, gpus)
    if problem:
        raise ConfigError(f"parallel.device: {device}: {problem}; use parallel.device=cpu")


def real_model_config(args: argparse.Namespace) -> RaykvConfig:
    """The config of a command that always runs a real model (``generate``, ``bench ttft``):
    SmolLM2 in float32 unless ``--model``, the config file or ``--set`` say otherwise."""
    cfg = load_real_model_config(args)
    check_real_model_engine(cfg, args.engine)
    check_device(cfg, args.engine, getattr(args, "address", None))
    return cfg


def load_real_model_config(args: argparse.Namespace) -> RaykvConfig:
    """--config, --set and --model over a real model's defaults."""
    overrides = [*(args.set or []), *([f"model.path={args.model}"] if args.model else [])]
    defaults = ["model.path=smollm2-135m-instruct", "model.dtype=float32"]
    return load_config(args.config, overrides, defaults)


def check_real_model_engine(cfg: RaykvConfig, engine: str) -> None:
    """A real model's tensor-parallel ranks compute together through a process group, which
    only ranks in processes of their own (the Ray engine) have."""
    tp = cfg.parallel.tensor_parallel_size
    if engine == "local" and tp > 1:
        raise ConfigError(
            f"parallel.tensor_parallel_size {tp}: the one-process engine runs a real model at "
            "tensor_parallel_size 1; use --engine ray for more ranks"
        )


def workload_overrides(workload: str | None, num_requests: int | None) -> list[str]:
    """``--workload synthetic|trace:FILE`` and ``--num-requests`` as config overrides."""
    overrides = [] if num_requests is None else [f"workload.num_requests={num_requests}"]
    if workload:
        kind, _, path = workload.partition(":")
        if kind == "synthetic" and not path:
            overrides.append("workload.kind=synthetic")
        elif kind == "trace" and path:
            overrides += ["workload.kind=trace", f"workload.trace={path}"]
        else:
            raise ConfigError(f"--workload {workload!r}: expected synthetic or trace:FILE")
    return overrides


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """What ``raykv run`` and ``raykv bench offload`` share: engine, config, workload, model."""
    parser.add_argument(
        "--engine",
        choices=["ray", "local"],
        default="ray",
        help="ray: scheduler and rank actors (default); local: everything in this process",
    )
    parser.add_argument(
        "--address",
        help="Ray cluster to join ('auto', host:port); default: RAY_ADDRESS, else start an "
        "embedded local Ray (loopback only, no dashboard)",
    )
    parser.add_argument(
        "--config",
        default=DEFAULT_RUN_CONFIG if Path(DEFAULT_RUN_CONFIG).exists() else None,
        help=f"YAML config (default: {DEFAULT_RUN_CONFIG} when it exists, else built-in defaults)",
    )
    add_set_arg(parser)
    parser.add_argument("--workload", help="synthetic, or trace:FILE (Mooncake JSONL)")
    parser.add_argument(
        "--model",
        help="a real model (model.path: a preset, a Hugging Face directory or a .gguf file); "
        "tensor_parallel_size > 1 needs --engine ray",
    )
    parser.add_argument("--num-requests", type=int, help="how many requests to run")


def add_real_model_args(parser: argparse.ArgumentParser) -> None:
    """--config, --set and --model of a command that runs a real model."""
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    add_set_arg(parser)
    parser.add_argument(
        "--model",
        help="a preset (smollm2-135m-instruct, the default), a Hugging Face directory or a "
        ".gguf file (model.path)",
    )


def add_set_arg(parser: argparse.ArgumentParser) -> None:
    """``--set KEY.PATH=VALUE`` (repeatable): one config key over the file's."""
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")


def need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'raykv[plot]'") from None


def interrupt_on_sigterm() -> None:
    """SIGTERM as Ctrl-C: a KeyboardInterrupt, so cleanup in ``finally`` runs."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def write_json(path: str, shape: Any, console: Console | None = None) -> None:
    """``shape`` as indented JSON in ``path`` (checked writable by ``check_output`` before the
    work), saying so on ``console`` when given."""
    Path(path).write_text(json.dumps(shape, indent=2) + "\n")
    if console is not None:
        console.print(f"wrote {path}")

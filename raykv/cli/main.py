"""The ``raykv`` command: one subcommand group per module of this package, each declaring its
own flags beside its body (``register``); ``main`` parses and dispatches, and turns a bad input
into one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from raykv.cli import bench_engine, bench_serving, bench_vllm, config, generate, run, serve
from raykv.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``bench``, ``run``, ``generate``, ``serve``, ``config``."""
    parser = argparse.ArgumentParser(
        prog="raykv", description="Ray-native KV-cache offloading engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bench_engine.register(bench)
    bench_serving.register(bench)
    bench_vllm.register(bench)
    run.register(sub)
    generate.register(sub)
    serve.register(sub)
    config.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze tables into 80 columns
        console = Console(width=140)
    try:
        return args.func(args, console)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"raykv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # cleanup ran on the way out
        print("raykv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

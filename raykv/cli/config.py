"""``raykv config check``: a config validated, its resolved values printed."""

from __future__ import annotations

import argparse
from typing import Any

import yaml
from rich.console import Console

from raykv.cli.common import add_set_arg
from raykv.config import load_config


def _cmd_config_check(args: argparse.Namespace, console: Console) -> int:
    config = load_config(args.file, args.set or ())
    console.print(f"{args.file}: ok", highlight=False)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def register(sub: Any) -> None:
    """``raykv config ...``."""
    cfg = sub.add_parser("config", help="configuration tools").add_subparsers(
        dest="config", required=True
    )
    check = cfg.add_parser("check", help="validate a config and print the resolved values")
    check.add_argument("file")
    add_set_arg(check)
    check.set_defaults(func=_cmd_config_check)

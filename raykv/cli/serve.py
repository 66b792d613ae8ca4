"""``raykv serve``: the OpenAI-compatible server on Ray Serve, until interrupted."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console

from raykv.cli.common import add_real_model_args, check_device, load_real_model_config, positive_int


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from raykv.serve.app import ServeOptions, Server

    if args.engine is not None:  # the flag over the config's serve.engine
        args.set = [*(args.set or []), f"serve.engine={args.engine}"]
    cfg = load_real_model_config(args)
    check_device(cfg, "ray", args.address)
    options = ServeOptions.of(
        cfg.serve,
        # from the environment by preference: a flag shows in the process list
        api_key=args.api_key or os.environ.get("RAYKV_API_KEY") or None,
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        router=args.router,
        insecure=args.insecure,
    )
    err = Console(stderr=True)
    server = Server(cfg, options, address=args.address)  # bad options refused here, by name
    with err.status(f"starting {options.replicas} replica(s) of {cfg.model.path}..."):
        try:
            server.start()
        except RuntimeError as exc:  # Serve gave up on the replicas (their logs say why)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            err.print(f"raykv serve: the replicas did not start: {first}", highlight=False)
            return 1
    try:
        auth = " (API key required)" if options.api_key else ""
        where = f"{server.url}/v1{auth}"
        err.print(f"serving {cfg.model.path} at {where}; Ctrl-C stops", highlight=False)
        server.wait()
    finally:
        with err.status("stopping..."):
            server.stop()
    return 0


def register(sub: Any) -> None:
    """``raykv serve``."""
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on Ray Serve")
    add_real_model_args(srv)
    # each flag overrides the config's serve: section (serve.host etc.)
    srv.add_argument("--host", help="where to listen (default: serve.host, loopback)")
    srv.add_argument("--port", type=int, help="default: serve.port, 8000")
    srv.add_argument("--replicas", type=positive_int, help="engine replicas (serve.replicas)")
    srv.add_argument(
        "--engine",
        choices=("raykv", "vllm"),
        help="what computes under each replica (serve.engine): raykv's own engine (the "
        "default) or vLLM's, with raykv's tiers as its offloading spec (make vllm)",
    )
    srv.add_argument(
        "--router",
        help="how requests pick a replica: kv (where the prompt's KV already is; the default "
        "with more than one replica), pow2 (Serve's power of two choices; the default with "
        "one) or prefix (Ray Serve LLM's text prefix tree)",
    )
    srv.add_argument(
        "--api-key",
        help="require this bearer key, or one of several separated by commas, each a tenant "
        "of its own cache (better: set RAYKV_API_KEY, kept out of ps)",
    )
    srv.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without a key"
    )
    srv.add_argument(
        "--address", help="the Ray cluster to join; default: RAY_ADDRESS, else an embedded Ray"
    )
    srv.set_defaults(func=_cmd_serve)

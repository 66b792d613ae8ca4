"""``raykv generate``: prompts through a real model, texts (and token ids, logprobs) out."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from raykv.cli.common import (
    add_real_model_args,
    check_output,
    positive_int,
    real_model_config,
    write_json,
)
from raykv.config import ConfigError


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    from raykv.core.step import SamplingError, SamplingSpec
    from raykv.runs.generate import Prompt, generate, read_prompt_file

    check_output("--json", args.json)
    cfg = real_model_config(args)
    model = cfg.model.path
    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    else:
        prompts = [
            Prompt(text=text) if args.raw else Prompt(messages=[{"role": "user", "content": text}])
            for text in args.prompt
        ]
    err = Console(stderr=True)
    sampling = SamplingSpec(args.temperature, args.top_p, args.top_k, args.seed, args.logprobs)
    try:
        sampling.check()
    except SamplingError as exc:
        raise ConfigError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    if args.engine == "local":
        with err.status(f"loading {model} and generating..."):
            outputs, report = generate(
                cfg,
                prompts,
                args.max_tokens,
                sequential=args.sequential,
                sampling=sampling,
                cache_salt=args.cache_salt,
            )
        report_shape = report.as_dict()
    else:
        from raykv.cluster.client import RaykvClient
        from raykv.runs.generate import prepare

        # bad input refused here
        gen = prepare(cfg, prompts, args.max_tokens, sampling, args.cache_salt)
        with err.status(f"starting Ray and {model} on its rank actors..."):
            client = RaykvClient.start(gen.cfg, address=args.address)
        with client, err.status("generating..."):
            outputs = client.run_generation(gen, sequential=args.sequential)
            report_shape = client.report()
    for out in outputs:
        if out.error is not None:
            what = "failed" if out.finish_reason == "error" else "refused"
            err.print(f"[{out.index}] {what}: {out.error}", highlight=False)
        else:
            console.print(f"[{out.index}] {out.text}", highlight=False, markup=False)
    if args.json:
        shape = {"outputs": [o.as_dict() for o in outputs], "report": report_shape}
        write_json(args.json, shape, err)
    return 0


def register(sub: Any) -> None:
    """``raykv generate``."""
    gen = sub.add_parser("generate", help="prompts through a real model, texts out")
    add_real_model_args(gen)
    gen.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: the engine in this process, tensor_parallel_size 1 (default); ray: the "
        "scheduler and one rank actor per tensor-parallel rank",
    )
    gen.add_argument(
        "--address",
        help="with --engine ray: the Ray cluster to join; default: RAY_ADDRESS, else an "
        "embedded local Ray (loopback only)",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        help="a prompt text (repeatable): a user message through the model's chat template "
        "when it has one, unless --raw",
    )
    source.add_argument(
        "--prompt-file",
        help='JSONL: {"prompt": text}, {"messages": [...]} or {"prompt_token_ids": [...]}',
    )
    gen.add_argument(
        "--sequential",
        action="store_true",
        help="submit each prompt after the previous finished (later ones reuse earlier KV)",
    )
    gen.add_argument("--raw", action="store_true", help="send --prompt texts as they are")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0: no limit")
    gen.add_argument("--seed", type=int, help="same seed, same tokens")
    gen.add_argument(
        "--cache-salt",
        help="the prompts' cache tenant: prompts with another salt (or none) share no cached "
        "KV with them, in any tier (a prompt file's line may give its own cache_salt)",
    )
    gen.add_argument(
        "--logprobs", type=int, help="report each token's log-probability and the top K"
    )
    gen.add_argument("--json", help="write the outputs and the run report to this JSON file")
    gen.set_defaults(func=_cmd_generate)

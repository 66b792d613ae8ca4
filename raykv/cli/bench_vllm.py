"""``raykv bench vllm``: raykv's tiers inside vLLM against vLLM's own recompute (the method is
in ``raykv/vllm/bench.py``)."""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from raykv.cli.common import check_output, int_list, non_negative_int, positive_int, write_json
from raykv.config import ConfigError
from raykv.model.hf_directory import model_directory


def _cmd_bench_vllm(args: argparse.Namespace, console: Console) -> int:
    check_output("--json", args.json)
    try:
        import raykv.vllm  # noqa: F401  (refuses an unsupported vLLM in one line)
    except ImportError as exc:
        raise ConfigError(f"raykv bench vllm needs vLLM ({exc}); make vllm installs it") from None
    from raykv.vllm.bench import (
        VllmBenchError,
        VllmBenchOptions,
        format_vllm_table,
        platform_block_size_problem,
        run_vllm_bench,
    )

    if len(set(args.prompt_tokens)) != len(args.prompt_tokens):
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens}: each length once")
    if min(args.prompt_tokens) <= args.block_tokens:
        raise ConfigError(
            f"--prompt-tokens {min(args.prompt_tokens)}: a prompt needs more than one block "
            f"(--block-tokens {args.block_tokens}) to have a block to load"
        )
    block_size_problem = platform_block_size_problem(args.block_tokens)
    if block_size_problem:
        raise ConfigError(f"--block-tokens {args.block_tokens}: {block_size_problem}")
    if args.disk_path is not None and not os.path.isdir(args.disk_path):
        raise ConfigError(f"--disk-path {args.disk_path}: no such directory")
    options = VllmBenchOptions(
        model=model_directory(args.model),
        prompt_tokens=args.prompt_tokens,
        repeat=args.repeat,
        block_tokens=args.block_tokens,
        dtype=args.dtype,
        disk_path=args.disk_path,
        throughput_requests=args.throughput_requests,
        throughput_prompt_tokens=args.throughput_prompt_tokens,
        throughput_output_tokens=args.throughput_output_tokens,
        throughput_rounds=args.throughput_rounds,
        enforce_eager=args.enforce_eager,
        slow_disk_ms=args.slow_disk_ms,
    )
    err = Console(stderr=True)
    try:
        with err.status("starting") as status:
            report = run_vllm_bench(options, progress=lambda text: status.update(text))
    except VllmBenchError as exc:
        err.print(f"raykv bench vllm: {exc}", markup=False, highlight=False)
        return 1
    cells = format_vllm_table(report)
    table = Table(title=f"TTFT through vLLM {report.vllm_version} ({report.dtype})")
    for header in cells[0]:
        table.add_column(header, justify="right")
    for row in cells[1:]:
        table.add_row(*row)
    console.print(table)
    if report.throughput is not None:
        t = report.throughput
        spread = f"rounds {min(t.ratios):.3f}-{max(t.ratios):.3f}"
        console.print(
            f"no reuse ({t.requests} requests of {t.prompt_tokens}+{t.output_tokens} tokens, "
            f"{t.rounds} rounds taken in turns): "
            f"{t.without_tokens_per_s:,.0f} tokens/s without raykv, "
            f"{t.with_tokens_per_s:,.0f} with its CPU and disk tiers: {t.ratio:.3f}x ({spread})"
        )
        if t.with_shared_tokens_per_s is not None and t.shared_ratio is not None:
            pool = (
                ""
                if t.shared_pool_cpu_s is None
                else f" (the store's pool process spent {t.shared_pool_cpu_s:.1f} s of CPU)"
            )
            ratios = t.shared_ratios or [t.shared_ratio]
            console.print(
                f"  with the shared tier too: {t.with_shared_tokens_per_s:,.0f} tokens/s, "
                f"{t.shared_ratio:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}){pool}"
            )
    console.print(f"shared tier: Mooncake Store, {report.shared_transport}")
    slow = report.slow_disk_restart
    if slow is not None:
        ratios = ", ".join(f"{r.ratio:.2f}" for r in slow.requests)
        settled = (
            f"within 1.2x of vLLM alone from request {slow.within_1_2x_from} on"
            if slow.within_1_2x_from is not None
            else "never within 1.2x of vLLM alone"
        )
        console.print(
            f"warm restart from a disk at {slow.disk_ms} ms a load (take_hits: faster): each "
            f"request's TTFT over vLLM alone's: {ratios}; {settled} ({slow.skipped_slower} disk "
            f"hits passed over, {slow.recompute_probes} recomputed to price the prefill)"
        )
    if args.json:
        write_json(args.json, report.as_dict(), console)
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    """``raykv bench vllm``."""
    bv = bench.add_parser(
        "vllm", help="TTFT through vLLM: recomputed against loaded from raykv's tiers"
    )
    bv.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a Hugging Face directory, a .gguf file or a preset (made into a directory once)",
    )
    bv.add_argument(
        "--prompt-tokens", type=int_list, default=[256, 1024, 2048], help="prompt lengths"
    )
    bv.add_argument("--repeat", type=positive_int, default=3, help="runs per way; fastest kept")
    bv.add_argument(
        "--block-tokens",
        type=positive_int,
        default=32,
        help="vLLM's block size (a multiple of 32 on CPU): the tail of a prompt after its last "
        "whole block is computed in every loaded run",
    )
    bv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    bv.add_argument("--disk-path", help="where the disk tier's files go (default: a temp dir)")
    bv.add_argument(
        "--throughput-requests",
        type=non_negative_int,
        default=8,
        help="requests of the no-reuse throughput workload (0: not measured)",
    )
    bv.add_argument("--throughput-prompt-tokens", type=positive_int, default=512)
    bv.add_argument("--throughput-output-tokens", type=positive_int, default=32)
    bv.add_argument(
        "--throughput-rounds",
        type=positive_int,
        default=5,
        help="batches each engine of the throughput comparison runs, taken in turns (the "
        "ratio is the median of the rounds')",
    )
    bv.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM without torch.compile: every engine starts sooner and steps slower",
    )
    bv.add_argument(
        "--slow-disk-ms",
        type=non_negative_int,
        default=0,
        metavar="MS",
        help="also a warm restart from a disk this slow a load, the worth-it choice on: each "
        "request's TTFT against vLLM alone's (default 0: not run)",
    )
    bv.add_argument("--json", help="write the results to this JSON file")
    bv.set_defaults(func=_cmd_bench_vllm)

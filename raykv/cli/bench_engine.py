"""``raykv bench`` of the engine's parts: policies, copies, the step's cost, the step message,
the streaming detokenizer."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from raykv.cli.common import (
    add_real_model_args,
    check_device,
    check_output,
    int_list,
    load_real_model_config,
    positive_int,
    write_json,
)
from raykv.config import ConfigError, load_config


def _cmd_bench_policy(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.policy import bench_work, policy_table, prepare_accesses, run_policy_bench
    from raykv.offload.policies import policy_names, resolve_policy
    from raykv.runs.terminal import progress_bar
    from raykv.workload.trace import read_trace

    names = policy_names() if args.policies.strip() == "all" else args.policies.split(",")
    names = [n.strip() for n in names if n.strip()]
    check_output("--json", args.json)
    for name in names:
        resolve_policy(name)  # unknown names fail before the replay starts
    requests = read_trace(args.trace, args.block_tokens, limit=args.limit)
    accesses = prepare_accesses(requests, args.block_tokens)
    total = bench_work(len(accesses), len(args.capacity_tokens), len(names), args.repeat)
    err = Console(stderr=True)
    with progress_bar(err, total, "replaying") as advance:
        report = run_policy_bench(
            accesses,
            args.capacity_tokens,
            names,
            trace=str(args.trace),
            block_tokens=args.block_tokens,
            repeat=args.repeat,
            progress=advance,
        )
    console.print(policy_table(report))
    if args.json:
        write_json(args.json, report.as_json(), console)
    return 0


def _cmd_bench_transfer(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.transfer import format_transfer_table, run_transfer_bench

    disk = args.device == "disk"
    direction = args.direction or (
        "store,load" if disk or args.device == "shared" else "store,load,both"
    )
    directions = [d.strip() for d in direction.split(",") if d.strip()]
    check_output("--json", args.json)
    if args.pieces != 1 and args.device in ("disk", "shared"):
        raise ConfigError(f"--pieces: only with --device cpu or cuda, not {args.device}")
    if disk:
        return _bench_disk_transfer(args, directions, console)
    if args.device == "shared":
        return _bench_shared_transfer(args, directions, console)
    for flag in ("path", "mode", "blocks_per_chunk", "io_threads", "master"):
        if getattr(args, flag) is not None:
            device = "shared" if flag == "master" else "disk"
            raise ConfigError(f"--{flag.replace('_', '-')}: only with --device {device}")
    for kib in args.page_kib:
        if kib * 1024 % args.pieces:
            raise ConfigError(
                f"--pieces {args.pieces}: a page of {kib} KiB (--page-kib) does not split into "
                f"{args.pieces} equal pieces"
            )
    if args.device != "cpu":
        from raykv.transfer.devices import device_problem

        # checked here so a CPU-only machine gets a plain answer, not an engine error
        problem = device_problem(args.device)
        if problem:
            raise ValueError(f"--device {args.device}: {problem}; use --device cpu")
    blocks = args.blocks if args.blocks is not None else 512
    result = run_transfer_bench(
        args.device,
        args.page_kib,
        blocks,
        directions,
        args.pattern,
        args.repeat,
        pieces=args.pieces,
    )
    console.print(format_transfer_table(result), highlight=False)
    if args.json:
        write_json(args.json, result, console)
    return 0


def _bench_shared_transfer(
    args: argparse.Namespace, directions: list[str], console: Console
) -> int:
    from raykv.bench.shared_transfer import (
        DEFAULT_SHARED_BLOCKS,
        format_shared_table,
        run_shared_bench,
    )
    from raykv.config.shared import check_address
    from raykv.transfer.shared_store import mooncake_problem

    for flag in ("path", "mode", "io_threads"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')}: only with --device disk")
    if args.master is not None:
        try:
            check_address(args.master)
        except ValueError as exc:
            raise ConfigError(f"--master {args.master}: {exc}") from None
    problem = mooncake_problem()
    if problem:
        raise ConfigError(f"--device shared: {problem}")
    with Console(stderr=True).status("putting chunks into the store and reading them back..."):
        result = run_shared_bench(
            args.page_kib,
            args.blocks if args.blocks is not None else DEFAULT_SHARED_BLOCKS,
            directions,
            args.repeat,
            None if args.master in (None, "embedded") else args.master,
            blocks_per_chunk=args.blocks_per_chunk or 1,
        )
    console.print(format_shared_table(result), highlight=False)
    if args.json:
        write_json(args.json, result, console)
    return 0


def _bench_disk_transfer(args: argparse.Namespace, directions: list[str], console: Console) -> int:
    from raykv.bench.disk_transfer import (
        DEFAULT_DISK_BLOCKS,
        directory_problem,
        format_disk_table,
        run_disk_bench,
    )

    if args.path is not None:
        problem = directory_problem(args.path)
        if problem:
            raise ConfigError(f"--path {args.path}: {problem}")
    modes = [m.strip() for m in (args.mode or "cold,warm").split(",") if m.strip()]
    with Console(stderr=True).status("writing and reading chunk files..."):
        result = run_disk_bench(
            args.page_kib,
            args.blocks if args.blocks is not None else DEFAULT_DISK_BLOCKS,
            directions,
            modes,
            args.repeat,
            args.path,
            blocks_per_chunk=args.blocks_per_chunk or 1,
            io_threads=args.io_threads or 4,
        )
    console.print(format_disk_table(result), highlight=False)
    if args.json:
        write_json(args.json, result, console)
    return 0


def _cmd_bench_step(args: argparse.Namespace, console: Console) -> int:
    check_output("--json", args.json)
    if args.engine == "ray":
        from raykv.cluster.bench import (
            format_fanout_table,
            format_model_share_table,
            run_fanout_bench,
            run_model_share,
        )

        cfg = load_config(args.config, args.set or ())
        check_device(cfg, "ray", None)
        result = run_fanout_bench(cfg, args.tp, steps=min(args.steps, 400), repeat=args.repeat)
        console.print(format_fanout_table(result), highlight=False)
        if args.model != "none":
            model_cfg = load_config(args.config, [*(args.set or ()), f"model.path={args.model}"])
            result["model_step"] = run_model_share(model_cfg, args.model_tp)
            console.print(format_model_share_table(result["model_step"]), highlight=False)
    else:
        from raykv.bench.step import format_step_table, run_step_bench

        result = run_step_bench(args.cached, args.steps, args.repeat, args.policy)
        console.print(format_step_table(result), highlight=False)
    if args.json:
        write_json(args.json, result, console)
    return 0


def _cmd_bench_plan(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.plan import format_plan_table, run_plan_bench

    check_output("--json", args.json)
    if args.steps < 2 or args.groups < 1:
        raise ConfigError(
            f"--steps must be >= 2 and --groups >= 1 (got {args.steps}, {args.groups})"
        )
    rows = []
    with Console(stderr=True).status("measuring...") as status:
        for requests in args.requests:
            for context in args.context:
                status.update(f"measuring: {requests} requests x {context} tokens")
                rows.append(
                    run_plan_bench(requests, context, args.steps, args.groups, not args.real_model)
                )
    console.print(format_plan_table(rows), highlight=False)
    if args.json:
        write_json(args.json, {"results": rows}, console)
    return 0


def _cmd_bench_detokenize(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.detokenize import report_lines, run_detokenize_bench
    from raykv.model.checkpoint import resolve
    from raykv.model.tokenizer import Tokenizer

    check_output("--json", args.json)
    if args.tokens < 4 * args.window:
        raise ConfigError(f"--tokens {args.tokens}: at least four --window of {args.window}")
    cfg = load_real_model_config(args)
    with Console(stderr=True).status(f"loading {cfg.model.path}'s tokenizer..."):
        tokenizer = Tokenizer.of(resolve(cfg.model.path), cfg.model.cache_dir)
    if tokenizer is None:
        raise ConfigError(f"--model {cfg.model.path}: it has no tokenizer to stream text with")
    with Console(stderr=True).status(f"streaming {args.tokens} tokens..."):
        result = run_detokenize_bench(
            tokenizer, args.tokens, args.window, whole_decode_tokens=4 * args.window
        )
    console.print("\n".join(report_lines(result)), highlight=False, markup=False)
    if args.json:
        write_json(args.json, result, console)
    return 0


def register(bench: Any) -> None:
    """``raykv bench policy|transfer|step|plan|detokenize``."""
    pol = bench.add_parser(
        "policy", help="eviction policies against the offline optimum on a request trace"
    )
    pol.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    pol.add_argument(
        "--capacity-tokens",
        type=int_list,
        required=True,
        help="CPU tier sizes in tokens, comma-separated (e.g. 1000000,3000000)",
    )
    pol.add_argument(
        "--policies", default="all", help="comma-separated policy names, or 'all' (default)"
    )
    pol.add_argument("--json", help="write the results to this JSON file")
    pol.add_argument(
        "--block-tokens", type=positive_int, default=512, help="tokens per trace block"
    )
    pol.add_argument(
        "--repeat", type=positive_int, default=3, help="timed replays per row; the fastest counts"
    )
    pol.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    pol.set_defaults(func=_cmd_bench_policy)

    tr = bench.add_parser(
        "transfer",
        help="transfer-engine bandwidth against one large copy of the same bytes (disk: against "
        "a plain sequential write and read of one file)",
    )
    tr.add_argument(
        "--device",
        choices=["cpu", "cuda", "disk", "shared"],
        default="cpu",
        help="default: cpu; shared: Mooncake Store (against a local copy)",
    )
    tr.add_argument(
        "--page-kib",
        type=int_list,
        default=[64, 256, 1024, 4096],
        help="page sizes in KiB, comma-separated (default 64,256,1024,4096)",
    )
    tr.add_argument(
        "--blocks",
        type=int,
        help="blocks per job (default 512; disk: 4096, at most 256 MiB of pages a row)",
    )
    tr.add_argument(
        "--direction",
        help="comma-separated: store, load, both (default: all three; disk: store,load)",
    )
    tr.add_argument(
        "--pattern",
        choices=["random", "contiguous"],
        default="random",
        help="GPU block order: random (scattered cache, default) or contiguous",
    )
    tr.add_argument("--repeat", type=int, default=3, help="timed runs per row; the fastest counts")
    tr.add_argument(
        "--pieces",
        type=positive_int,
        default=1,
        help="cpu, cuda: a page split into this many equal byte views of as many layers, as "
        "vLLM's canonical views are (what raykv's worker inside vLLM copies); default 1",
    )
    tr.add_argument("--json", help="write the results to this JSON file")
    tr.add_argument(
        "--path",
        help="disk: the directory to put the files under (default: the system's temporary "
        "directory); a fresh directory there is removed at the end",
    )
    tr.add_argument(
        "--mode",
        help="disk, comma-separated: cold (O_DIRECT, or the page cache dropped), warm (buffered, "
        "the files in the page cache); default: both",
    )
    tr.add_argument(
        "--blocks-per-chunk",
        type=positive_int,
        help="disk, shared: pages a chunk file or object holds (default 1)",
    )
    tr.add_argument(
        "--io-threads", type=positive_int, help="disk: the engine's I/O threads (default 4)"
    )
    tr.add_argument(
        "--master",
        help="shared: host:port of a running mooncake_master (default: embedded, started for "
        "the run on loopback)",
    )
    tr.set_defaults(func=_cmd_bench_transfer)

    st = bench.add_parser(
        "step", help="the connector's bookkeeping per engine step against what is cached"
    )
    st.add_argument(
        "--cached",
        type=int_list,
        default=[100, 10_000],
        help="CPU-tier chunks cached, comma-separated (default 100,10000)",
    )
    st.add_argument("--steps", type=int, default=2000, help="timed steps per count and repeat")
    st.add_argument("--repeat", type=int, default=3, help="timed rounds; the best one counts")
    st.add_argument("--policy", default="lru", help="eviction policy of the CPU tier (lru)")
    st.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: connector bookkeeping vs cached blocks; ray: the per-step fan-out to the "
        "rank actors vs a bare Ray round trip",
    )
    st.add_argument("--tp", type=int_list, default=[2, 4], help="with --engine ray: TP sizes")
    st.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="with --engine ray: the real model whose decode step is timed both ways (a preset "
        "or a path; none: skip it)",
    )
    st.add_argument(
        "--model-tp",
        type=int_list,
        default=[1],
        help="with --engine ray: TP sizes of the real model's run (dividing its KV heads)",
    )
    st.add_argument("--config", help="with --engine ray: the config whose plans are replayed")
    st.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")
    st.add_argument("--json", help="write the results to this JSON file")
    st.set_defaults(func=_cmd_bench_step)

    pl = bench.add_parser(
        "plan",
        help="the step message of decode steps as contexts grow: table changes vs whole tables",
    )
    pl.add_argument(
        "--requests", type=int_list, default=[64, 256], help="decoding requests (default 64,256)"
    )
    pl.add_argument(
        "--context",
        type=int_list,
        default=[1024, 4096, 32768],
        help="prompt tokens of each request (default 1024,4096,32768)",
    )
    pl.add_argument("--steps", type=int, default=64, help="decode steps timed per row")
    pl.add_argument("--groups", type=int, default=1, help="KV groups (full attention)")
    pl.add_argument(
        "--real-model",
        action="store_true",
        help="a real model's plans (no parent hashes, which only the synthetic model reads)",
    )
    pl.add_argument("--json", help="write the results to this JSON file")
    pl.set_defaults(func=_cmd_bench_plan)

    dt = bench.add_parser(
        "detokenize",
        help="a long token stream through the server's incremental detokenizer, one token a "
        "push: cost per token in its first and last windows, beside decoding it all each time",
    )
    add_real_model_args(dt)
    dt.add_argument("--tokens", type=positive_int, default=50_000, help="stream length")
    dt.add_argument("--window", type=positive_int, default=1_000, help="tokens per window")
    dt.add_argument("--json", help="write the result to this JSON file")
    dt.set_defaults(func=_cmd_bench_detokenize)

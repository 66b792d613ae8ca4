"""``raykv bench`` of whole runs and of serving: the CPU tier on and off, TTFT from the tier
against recompute, the routers behind real replicas, the router's weights."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from raykv.cli.common import (
    add_real_model_args,
    add_workload_options,
    check_device,
    check_output,
    check_real_model_engine,
    int_list,
    interrupt_on_sigterm,
    load_real_model_config,
    need_matplotlib,
    non_negative_int,
    positive_int,
    real_model_config,
    workload_overrides,
    write_json,
)
from raykv.cli.run import execute_run, prepared_run
from raykv.config import ConfigError, RaykvConfig, load_config

if TYPE_CHECKING:
    from raykv.bench.serve import ServeBenchResult, ServeWay


def tier_list(text: str) -> list[str]:
    """``--tiers``: ``cpu`` or ``cpu,disk``."""
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    if tiers not in (["cpu"], ["cpu", "disk"]):
        raise argparse.ArgumentTypeError(f"{text!r}: cpu, or cpu,disk")
    return tiers


def _cmd_bench_offload(args: argparse.Namespace, console: Console) -> int:
    check_output("--json", args.json)
    check_output("--plot", args.plot)
    if args.plot:
        need_matplotlib()
    args.no_offload, args.verify = False, False
    tiers = tuple(args.tiers)
    against = args.against or ("cpu" if "disk" in tiers else "none")
    if against not in ("none", "cpu") or (against == "cpu" and "disk" not in tiers):
        raise ConfigError(f"--against {against}: none, or cpu with --tiers cpu,disk")
    with ExitStack() as cleanup:
        cfg = prepared_run(args)
        if "disk" in tiers and not cfg.offload.disk.path:
            where = args.disk_path or tempfile.mkdtemp(prefix="raykv-bench-offload-")
            if args.disk_path is None:
                cleanup.callback(shutil.rmtree, where, True)
            tree = cfg.model_dump(mode="json")
            tree["offload"]["disk"]["path"] = where
            cfg = load_config(tree)
        return _offload(args, console, cfg, tiers, against)


def _offload(
    args: argparse.Namespace,
    console: Console,
    cfg: RaykvConfig,
    tiers: tuple[str, ...],
    against: str,
) -> int:
    from raykv.bench.offload import (
        compare_runs,
        format_comparison,
        plot_ttft_distributions,
        pool_runs,
        repeat_ratios,
        warm_up_requests,
    )

    err = Console(stderr=True)
    # the first run in a process pays for warming up: the workload first, unmeasured, so that
    # neither way is charged for it (see warm_up_requests). The CPU tier's copies are warmed
    # too; the disk and shared tiers stay off, or the run with them would find what the
    # warm-up left there.
    warm_up = warm_up_requests(cfg.workload.num_requests, args.engine, args.warm_up)
    if warm_up:
        tree = cfg.model_dump(mode="json")
        tree["workload"]["num_requests"] = warm_up
        tree["offload"]["disk"]["enabled"] = False
        tree["offload"]["shared"]["enabled"] = False
        execute_run(load_config(tree), args.engine, args.address, err, "warm-up")
    ways = {
        "with_tier": (True, "disk" in tiers),
        "without_tier": (against != "none", False),
    }
    runs: dict[str, list[Any]] = {way: [] for way in ways}
    for repeat in range(args.repeat):
        # the two ways take turns going first, so that neither is always the second to run
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for way in order:
            enabled, with_disk = ways[way]
            tree = cfg.model_dump(mode="json")
            tree["offload"]["enabled"] = enabled
            tree["offload"]["disk"]["enabled"] = with_disk
            if with_disk and repeat:  # each repeat's disk tier starts empty, as the first's
                tree["offload"]["disk"]["path"] = os.path.join(
                    tree["offload"]["disk"]["path"], f"repeat-{repeat}"
                )
            label = way.replace("_", " ") + (f", repeat {repeat + 1}" if args.repeat > 1 else "")
            runs[way].append(execute_run(load_config(tree), args.engine, args.address, err, label))
    reports = {way: [run.as_dict() for run in runs[way]] for way in runs}
    with_tier, without_tier = pool_runs(reports["with_tier"]), pool_runs(reports["without_tier"])
    result = compare_runs(with_tier, without_tier, tiers)
    result["warm_up_requests"] = warm_up
    result["repeats"] = args.repeat
    if args.repeat > 1:
        result["repeat_ratios"] = repeat_ratios(reports["with_tier"], reports["without_tier"])
    console.print(format_comparison(result), highlight=False)
    if args.json:
        shape = {**result, "runs": {"with_tier": with_tier, "without_tier": without_tier}}
        write_json(args.json, shape, err)
    if args.plot:
        plot_ttft_distributions(with_tier, without_tier, args.plot)
        err.print(f"wrote {args.plot}")
    return 1 if any(r.integrity.mismatches for way in runs.values() for r in way) else 0


def _cmd_bench_ttft(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.ttft import bench_config, with_disk_tier
    from raykv.model.checkpoint import configure

    check_output("--json", args.json)
    check_output("--plot", args.plot)
    if args.plot:
        need_matplotlib()
    lengths = args.prompt_tokens
    cfg, spec, path = configure(bench_config(real_model_config(args), lengths))
    with ExitStack() as cleanup:
        if not args.no_disk:
            where = args.disk_path
            if where is None:
                where = tempfile.mkdtemp(prefix="raykv-bench-ttft-")
                cleanup.callback(shutil.rmtree, where, True)
            cfg = with_disk_tier(cfg, where, lengths, args.repeat)
        reader_cfg = None
        if not args.no_shared:
            reader_cfg = _shared_ttft_config(args, cfg, lengths, cleanup)
            if reader_cfg is not None:
                cfg = reader_cfg
        return _ttft(args, console, cfg, spec, path, reader_cfg)


def _shared_ttft_config(
    args: argparse.Namespace, cfg: Any, lengths: list[int], cleanup: ExitStack
) -> Any:
    """The config of both engines with a shared tier on a master of the bench's own (None, said
    on stderr, where the store cannot start here)."""
    from raykv.bench.ttft import with_shared_tier

    if args.engine != "local":
        Console(stderr=True).print("shared_tier_s: with --engine local only so far (skipped)")
        return None
    joined = _bench_master("shared_tier_s", cleanup)
    if joined is None:
        return None
    address, secret_file = joined
    return with_shared_tier(cfg, address, secret_file, lengths, args.repeat)


def _bench_master(what: str, cleanup: ExitStack) -> tuple[str, str] | None:
    """A Mooncake master of the bench's own and a cluster secret for it (in a file only this
    user reads), both gone with ``cleanup``: its address and the secret's file, or None
    (``what`` said skipped on stderr, with why) where the store cannot start here."""
    import os
    import tempfile

    from raykv.transfer.seal import new_secret
    from raykv.transfer.shared_master import EmbeddedMaster
    from raykv.transfer.shared_store import SharedStoreError, mooncake_problem

    err = Console(stderr=True)
    problem = mooncake_problem()
    if problem:
        err.print(f"{what}: skipped ({problem})")
        return None
    master = EmbeddedMaster()
    try:
        address = master.start()
    except SharedStoreError as exc:
        err.print(f"{what}: skipped ({exc})")
        return None
    cleanup.callback(master.stop)
    fd, secret_file = tempfile.mkstemp(prefix="raykv-bench-secret-")  # 0600
    with os.fdopen(fd, "w") as fh:
        fh.write(new_secret().hex())
    cleanup.callback(os.unlink, secret_file)
    return address, secret_file


def _ttft(
    args: argparse.Namespace,
    console: Console,
    cfg: Any,
    spec: Any,
    path: Path,
    reader_cfg: Any = None,
) -> int:
    from raykv.bench.ttft import (
        LocalTTFTEngine,
        TTFTReport,
        format_ttft_table,
        measure_restarts,
        plot_ttft,
        run_ttft_bench,
        transformers_forward,
    )

    lengths = args.prompt_tokens
    too_long = [n for n in lengths if n + 1 > spec.max_positions]
    if too_long:
        raise ConfigError(
            f"--prompt-tokens {too_long[0]}: longer than the model's context of "
            f"{spec.max_positions}"
        )
    err = Console(stderr=True)
    with err.status("loading the model...") as status:
        reference = None
        if not args.no_transformers:
            reference = transformers_forward(path, cfg.model.dtype, cfg.parallel.device)

        def start() -> Any:
            if args.engine == "local":
                return LocalTTFTEngine(cfg)
            from raykv.cluster.bench import RayTTFTEngine

            return RayTTFTEngine(cfg)

        engine = start()
        # the shared tier's other engine: a CPU tier of its own, the same store
        reader = LocalTTFTEngine(reader_cfg) if reader_cfg is not None else None
        prompts: dict[int, list[int]] = {}
        progress = lambda what: status.update(f"measuring: {what}")  # noqa: E731
        try:
            results = run_ttft_bench(
                cfg,
                engine,
                lengths,
                args.repeat,
                reference,
                progress=progress,
                reader=reader,
                asked=prompts,
            )
        finally:
            engine.close()
            if reader is not None:
                reader.close()
        if cfg.offload.disk.enabled:  # the engine has stopped: its files are for the next one
            measure_restarts(cfg, results, prompts, start, progress)
    report = TTFTReport(
        cfg.model.path or "",
        cfg.parallel.device,
        args.engine,
        cfg.parallel.tensor_parallel_size,
        results,
    )
    console.print(format_ttft_table(report), highlight=False)
    if args.json:
        write_json(args.json, report.as_dict(), err)
    if args.plot:
        plot_ttft(report, args.plot)
        err.print(f"wrote {args.plot}")
    return 0


def _shared_config(args: argparse.Namespace, shared: bool | None) -> RaykvConfig:
    """The run's config with the shared tier on or off (None: as --config and --set say)."""
    if shared is None:
        return load_real_model_config(args)
    sets = [*(args.set or []), f"offload.shared.enabled={str(shared).lower()}"]
    if shared:  # the shared tier sits below the CPU tier: without offloading it would not run
        sets.append("offload.enabled=true")
    return load_real_model_config(argparse.Namespace(**{**vars(args), "set": sets}))


# the router name of the baseline without Ray Serve (--engine vllm)
VLLM_BASELINE = "vllm"


def _cmd_bench_serve(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.serve import (
        bench_router,
        bench_vllm_server,
        format_serve_table,
        pool,
        reuse_bounds,
        run_order,
        serve_ways,
    )
    from raykv.cluster.runtime import connect
    from raykv.runs.terminal import progress_bar
    from raykv.serve.app import ROUTERS, kv_layout, ray_resources, served_config
    from raykv.workload.requests import make_workload

    check_output("--json", args.json)
    if args.engine is not None:
        args.set = [*(args.set or []), f"serve.engine={args.engine}"]
    routers = list(dict.fromkeys(r.strip() for r in args.router.split(",") if r.strip()))
    for router in routers:
        if router == VLLM_BASELINE and args.engine != "vllm":
            raise ConfigError(
                f"--router {VLLM_BASELINE}: vLLM's own server is the baseline of --engine vllm"
            )
        if router not in ROUTERS and router != VLLM_BASELINE:
            raise ConfigError(
                f"--router {router!r}: expected some of {', '.join([*ROUTERS, VLLM_BASELINE])}"
            )
    kind, _, trace = args.workload.partition(":")
    if kind == "trace" and not Path(trace).is_file():  # before a model loads, not after
        raise ConfigError(f"--workload {args.workload}: no trace file at {trace!r}")
    args.set = [*(args.set or []), *workload_overrides(args.workload, args.num_requests)]
    ways = serve_ways(routers, args.shared)
    configs = {shared: _shared_config(args, shared) for shared in {w.shared for w in ways}}
    cfg = configs[ways[0].shared]
    check_device(cfg, "ray", args.address)
    served, _ = served_config(cfg)
    specs = make_workload(served)
    bounds = reuse_bounds(specs, kv_layout(served), args.replicas)
    err = Console(stderr=True)
    cpus, gpus = ray_resources(cfg, args.replicas)
    ray_handle = connect(args.address, num_cpus=cpus, num_gpus=gpus)
    # after Ray's own handlers: the finally blocks then take the replicas and shard files down
    interrupt_on_sigterm()
    runs: dict[ServeWay, list[ServeBenchResult]] = {way: [] for way in ways}
    try:
        for i, way in enumerate(run_order(ways, args.repeat)):
            tag = way.label
            if args.repeat > 1:
                tag += f" (run {i // len(ways) + 1} of {args.repeat})"
            with progress_bar(err, len(specs), f"{tag}: {len(specs)} requests") as advance:
                if way.router == VLLM_BASELINE:
                    result = bench_vllm_server(
                        configs[way.shared],
                        specs,
                        args.concurrency,
                        args.port,
                        on_done=lambda _: advance(1),
                    )
                else:
                    result = bench_router(
                        configs[way.shared],
                        way.router,
                        args.replicas,
                        specs,
                        args.concurrency,
                        args.port,
                        on_done=lambda _: advance(1),
                    )
            result.router = way.label
            for request in result.requests_list:  # which run, in --per-request's rows
                request.run = len(runs[way])
            runs[way].append(result)
            err.print(
                f"{tag}: TTFT mean {result.ttft_s['mean']:.3f} s, "
                f"{result.cached_tokens:,} prompt tokens cached, {result.errors} errors",
                highlight=False,
            )
            failed = [r for r in result.requests_list if r.error is not None]
            if failed:  # e.g. prompts longer than the model's context: scale a trace down
                err.print(
                    f"  first error ({failed[0].request_id}): {failed[0].error}",
                    markup=False,
                    highlight=False,
                )
    finally:
        ray_handle.shutdown()
    results = [pool(way.label, runs[way]) for way in ways]  # one run pools as itself
    title = (
        f"raykv bench serve: {cfg.model.path}, {args.replicas} replicas, {args.workload} "
        f"({len(specs)} requests, concurrency {args.concurrency}"
        f"{f', {args.repeat} runs each, pooled' if args.repeat > 1 else ''})"
    )
    console.print(format_serve_table(results, title, bounds.affinity))
    if args.repeat > 1:
        for r in results:
            means = ", ".join(f"{m:.3f}" for m in r.run_ttft_means)
            console.print(f"{r.router}: each run's TTFT mean {means} s", highlight=False)
    console.print(
        f"what the workload allows (unbounded caches, in its order): {bounds.affinity:,} prompt "
        f"tokens reused with each request where most of its prompt is, {bounds.random:,} with "
        f"replicas at random ({bounds.ratio:.2f}x)",
        highlight=False,
    )
    if args.json:
        shape = {
            "model": str(cfg.model.path),
            "replicas": args.replicas,
            "workload": args.workload,
            "num_requests": len(specs),
            "concurrency": args.concurrency,
            "repeat": args.repeat,
            "shared": args.shared,
            "reuse_bounds": {"affinity": bounds.affinity, "random": bounds.random},
            "results": [r.as_dict(with_requests=args.per_request) for r in results],
        }
        write_json(args.json, shape, err)
    return 0


def _cmd_bench_route_weights(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.ttft import bench_config, with_disk_tier, with_shared_tier
    from raykv.model.checkpoint import configure

    check_output("--json", args.json)
    if len(args.prompt_tokens) != 2 or args.prompt_tokens[0] >= args.prompt_tokens[1]:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens}: two lengths, shorter first")
    lengths = list(args.prompt_tokens)
    cfg = load_real_model_config(args)
    check_real_model_engine(cfg, "local")
    cfg, _, _ = configure(bench_config(cfg, lengths))
    with ExitStack() as cleanup:
        if args.no_disk:  # whatever the config says: no disk tier measured
            tree = cfg.model_dump(mode="json")
            tree["offload"]["disk"]["enabled"] = False
            cfg = load_config(tree)
        else:
            where = args.disk_path
            if where is None:
                where = tempfile.mkdtemp(prefix="raykv-bench-route-weights-")
                cleanup.callback(shutil.rmtree, where, True)
            cfg = with_disk_tier(cfg, where, lengths, args.repeat)
        if not args.no_shared:
            joined = _bench_master("shared_hit_cost", cleanup)
            if joined is not None:
                cfg = with_shared_tier(cfg, *joined, lengths, args.repeat)
        return _route_weights(args, console, cfg)


def _route_weights(args: argparse.Namespace, console: Console, cfg: RaykvConfig) -> int:
    from raykv.bench.route_weights import measure_route_weights

    with Console(stderr=True).status("measuring computing, loading and decoding..."):
        m = measure_route_weights(cfg, tuple(args.prompt_tokens), tuple(args.decoders), args.repeat)
    from_disk = ""
    if m.disk_s_per_token is not None:
        from_disk = f"; promoted from disk and loaded: {m.disk_s_per_token * 1e3:.4f} ms"
    if m.shared_s_per_token is not None:
        from_disk += f"; read from the shared tier and loaded: {m.shared_s_per_token * 1e3:.4f} ms"
    console.print(
        f"computed prompt token: {m.compute_s_per_token * 1e3:.3f} ms; loaded from the CPU "
        f"tier: {m.load_s_per_token * 1e3:.4f} ms{from_disk}; decoding requests delay a prompt "
        "by " + ", ".join(f"{v * 1e3:.1f} ms ({k})" for k, v in m.decode_delay_s.items()),
        highlight=False,
    )
    disk_weight = ""
    if m.disk_hit_cost is not None:
        disk_weight = f"serve.router_weights.disk_hit_cost={m.disk_hit_cost:.4f} "
    if m.shared_hit_cost is not None:
        disk_weight += f"serve.router_weights.shared_hit_cost={m.shared_hit_cost:.4f} "
    console.print(
        f"serve.router_weights.cpu_hit_cost={m.cpu_hit_cost:.4f} {disk_weight}"
        f"serve.router_weights.decode_cost={m.decode_cost:.2f}",
        highlight=False,
    )
    if args.json:
        write_json(args.json, m.as_dict())
    return 0


def register(bench: Any) -> None:
    """``raykv bench offload|ttft|serve|route-weights``."""
    off = bench.add_parser(
        "offload",
        help="one workload with the CPU tier and without: TTFT, throughput, hits, ratios",
    )
    add_workload_options(off)
    off.add_argument(
        "--tiers",
        type=tier_list,
        default=["cpu"],
        metavar="cpu[,disk]",
        help="the tiers of the run with (default cpu); the run without has all but the last",
    )
    off.add_argument(
        "--against",
        choices=["none", "cpu"],
        help="the run without: no tier, or the CPU tier alone (default: all but the last)",
    )
    off.add_argument(
        "--disk-path",
        help="with --tiers cpu,disk and no offload.disk.path: where the disk tier's files go "
        "(default: a fresh temporary directory, removed at the end)",
    )
    off.add_argument(
        "--warm-up",
        type=non_negative_int,
        metavar="REQUESTS",
        help="the workload's first REQUESTS run first, unmeasured, without the disk tier, so "
        "that neither way pays for first use (default: the whole workload with --engine "
        "local; 0 with --engine ray, whose runs each start rank actors of their own)",
    )
    off.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="run each way this many times, taking turns at going first; the percentiles are "
        "over the requests of all of them (default 1)",
    )
    off.add_argument("--json", help="write the comparison and both run reports to this file")
    off.add_argument("--plot", help="draw both TTFT distributions to this PNG file")
    off.set_defaults(func=_cmd_bench_offload, fault=None)

    tt = bench.add_parser(
        "ttft",
        help="time to first token of one prompt, recomputed vs loaded from the CPU tier and "
        "from the disk tier",
    )
    tt.add_argument("--config", help="YAML config (default: built-in defaults)")
    tt.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")
    tt.add_argument(
        "--model", help="a preset (smollm2-135m-instruct, the default), a directory or a .gguf"
    )
    tt.add_argument(
        "--prompt-tokens", type=int_list, default=[256, 512, 1024, 2048, 4096], metavar="N,N"
    )
    tt.add_argument("--repeat", type=positive_int, default=3, help="fastest of R each way")
    tt.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process, TP 1 (default); ray: the rank actors",
    )
    tt.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' forward pass"
    )
    tt.add_argument(
        "--disk-path",
        help="where the disk tier's files go (default: a fresh directory under the system's "
        "temporary directory, removed at the end)",
    )
    tt.add_argument("--no-disk", action="store_true", help="skip the disk tier")
    tt.add_argument(
        "--no-shared",
        action="store_true",
        help="skip the shared tier (another engine loading from Mooncake Store; skipped by "
        "itself where the store cannot start)",
    )
    tt.add_argument("--json", help="write the results to this JSON file")
    tt.add_argument("--plot", help="draw TTFT against prompt length to this PNG file")
    tt.set_defaults(func=_cmd_bench_ttft)

    bs = bench.add_parser(
        "serve", help="one workload through the HTTP API behind each request router in turn"
    )
    add_real_model_args(bs)
    bs.add_argument("--replicas", type=positive_int, default=2, help="engine replicas")
    bs.add_argument(
        "--engine",
        choices=("raykv", "vllm"),
        help="what computes under each replica (serve.engine; default raykv)",
    )
    bs.add_argument(
        "--router",
        default="kv,pow2,prefix",
        help="routers to compare, comma-separated; with --engine vllm also vllm: the same "
        "requests straight to vLLM's own OpenAI server, one engine on one replica's cores",
    )
    bs.add_argument(
        "--workload",
        default="synthetic",
        help="synthetic (multi-turn conversations; workload.*) or trace:FILE (Mooncake JSONL)",
    )
    bs.add_argument("--num-requests", type=positive_int, help="workload.num_requests")
    bs.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    bs.add_argument(
        "--shared",
        choices=["config", "on", "off", "both"],
        default="config",
        help="the shared tier (offload.shared.enabled) for every router: as the config says, "
        "on, off, or both (each router once without it and once with it: ROUTER+shared)",
    )
    bs.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="run each router (and way) this many times, taking turns at going first; the "
        "percentiles are over the requests of all of them, each run's mean is printed too",
    )
    bs.add_argument("--port", type=int, default=8000, help="where the server listens")
    bs.add_argument(
        "--address", help="the Ray cluster to join; default: RAY_ADDRESS, else an embedded Ray"
    )
    bs.add_argument("--json", help="write the results to this JSON file")
    bs.add_argument(
        "--per-request", action="store_true", help="with --json: every request's numbers too"
    )
    bs.set_defaults(func=_cmd_bench_serve)

    rw = bench.add_parser(
        "route-weights", help="measure the KV-aware router's weights on the serving model"
    )
    add_real_model_args(rw)
    rw.add_argument("--prompt-tokens", type=int_list, default=[256, 512], metavar="N,N")
    rw.add_argument("--decoders", type=int_list, default=[8, 16], metavar="K,K")
    rw.add_argument("--repeat", type=positive_int, default=3, help="fastest of R")
    rw.add_argument(
        "--disk-path",
        help="where the disk tier's files go (default: a fresh directory under the system's "
        "temporary directory, removed at the end)",
    )
    rw.add_argument("--no-disk", action="store_true", help="skip the disk tier (no disk_hit_cost)")
    rw.add_argument(
        "--no-shared", action="store_true", help="skip the shared tier (no shared_hit_cost)"
    )
    rw.add_argument("--json", help="write the measurement to this JSON file")
    rw.set_defaults(func=_cmd_bench_route_weights)

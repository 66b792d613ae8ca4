"""The ``raykv`` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.console import Console

from raykv.config import ConfigError, RaykvConfig, load_config

if TYPE_CHECKING:
    from raykv.engine.run_report import RunReport
    from raykv.workload.chat import ChatSession

DEFAULT_RUN_CONFIG = "configs/local.yaml"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _check_output(flag: str, path: str | None) -> None:
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


def _check_device(cfg: RaykvConfig, engine: str, address: str | None) -> None:
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


def _real_model_config(args: argparse.Namespace) -> RaykvConfig:
    """The config of a command that always runs a real model (``generate``, ``bench ttft``):
    SmolLM2 in float32 unless ``--model``, the config file or ``--set`` say otherwise."""
    cfg = _load_real_model_config(args)
    _check_real_model_engine(cfg, args.engine)
    _check_device(cfg, args.engine, getattr(args, "address", None))
    return cfg


def _load_real_model_config(args: argparse.Namespace) -> RaykvConfig:
    """--config, --set and --model over a real model's defaults."""
    overrides = [*(args.set or []), *([f"model.path={args.model}"] if args.model else [])]
    defaults = ["model.path=smollm2-135m-instruct", "model.dtype=float32"]
    return load_config(args.config, overrides, defaults)


def _check_real_model_engine(cfg: RaykvConfig, engine: str) -> None:
    """A real model's tensor-parallel ranks compute together through a process group, which
    only ranks in processes of their own (the Ray engine) have."""
    tp = cfg.parallel.tensor_parallel_size
    if engine == "local" and tp > 1:
        raise ConfigError(
            f"parallel.tensor_parallel_size {tp}: the one-process engine runs a real model at "
            "tensor_parallel_size 1; use --engine ray for more ranks"
        )


def _cmd_bench_policy(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.policy import bench_work, prepare_accesses, run_policy_bench
    from raykv.offload.policies import policy_names, resolve_policy
    from raykv.report import policy_table, progress_bar
    from raykv.workload.trace import read_trace

    names = policy_names() if args.policies.strip() == "all" else args.policies.split(",")
    names = [n.strip() for n in names if n.strip()]
    _check_output("--json", args.json)
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
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _cmd_bench_transfer(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.transfer import format_transfer_table, run_transfer_bench

    directions = [d.strip() for d in args.direction.split(",") if d.strip()]
    _check_output("--json", args.json)
    if args.device != "cpu":
        from raykv.transfer.devices import device_problem

        # checked here so a CPU-only machine gets a plain answer, not an engine error
        problem = device_problem(args.device)
        if problem:
            raise ValueError(f"--device {args.device}: {problem}; use --device cpu")
    result = run_transfer_bench(
        args.device, args.page_kib, args.blocks, directions, args.pattern, args.repeat
    )
    console.print(format_transfer_table(result), highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _cmd_bench_ttft(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.ttft import (
        LocalTTFTEngine,
        TTFTReport,
        bench_config,
        format_ttft_table,
        plot_ttft,
        run_ttft_bench,
        transformers_forward,
    )
    from raykv.model.checkpoint import configure

    _check_output("--json", args.json)
    _check_output("--plot", args.plot)
    if args.plot:
        _need_matplotlib()
    lengths = args.prompt_tokens
    cfg, spec, path = configure(bench_config(_real_model_config(args), lengths))
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
        if args.engine == "local":
            engine = LocalTTFTEngine(cfg)
        else:
            from raykv.cluster.bench import RayTTFTEngine

            engine = RayTTFTEngine(cfg)
        try:
            results = run_ttft_bench(
                cfg,
                engine,
                lengths,
                args.repeat,
                reference,
                progress=lambda what: status.update(f"measuring: {what}"),
            )
        finally:
            engine.close()
    report = TTFTReport(
        cfg.model.path or "",
        cfg.parallel.device,
        args.engine,
        cfg.parallel.tensor_parallel_size,
        results,
    )
    console.print(format_ttft_table(report), highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        err.print(f"wrote {args.json}")
    if args.plot:
        plot_ttft(report, args.plot)
        err.print(f"wrote {args.plot}")
    return 0


def _cmd_bench_step(args: argparse.Namespace, console: Console) -> int:
    _check_output("--json", args.json)
    if args.engine == "ray":
        from raykv.cluster.bench import (
            format_fanout_table,
            format_model_share_table,
            run_fanout_bench,
            run_model_share,
        )

        cfg = load_config(args.config, args.set or ())
        _check_device(cfg, "ray", None)
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
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _cmd_bench_plan(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.plan import format_plan_table, run_plan_bench

    _check_output("--json", args.json)
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
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _cmd_bench_detokenize(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.detokenize import report_lines, run_detokenize_bench
    from raykv.model.checkpoint import resolve
    from raykv.model.tokenizer import Tokenizer

    _check_output("--json", args.json)
    if args.tokens < 4 * args.window:
        raise ConfigError(f"--tokens {args.tokens}: at least four --window of {args.window}")
    cfg = _load_real_model_config(args)
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
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _workload_overrides(workload: str | None, num_requests: int | None) -> list[str]:
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


def _run_config(args: argparse.Namespace) -> RaykvConfig:
    overrides = [*(args.set or []), *_workload_overrides(args.workload, args.num_requests)]
    if args.no_offload:
        overrides.append("offload.enabled=false")
    if args.verify:
        overrides.append("offload.verify=true")
    if args.model:
        overrides.append(f"model.path={args.model}")
    cfg = load_config(args.config, overrides)
    if args.fault:
        tree = cfg.model_dump(mode="json")
        tree["faults"] = [*cfg.faults, *args.fault]
        cfg = load_config(tree)
    return cfg


def _prepared_run(args: argparse.Namespace) -> RaykvConfig:
    """``raykv run``'s config, checked, and configured for its checkpoint when it has one."""
    cfg = _run_config(args)
    _check_device(cfg, args.engine, args.address)
    if cfg.model.path is not None:  # a real model: its geometry, its vocabulary, its EOS
        from raykv.model.checkpoint import configure

        _check_real_model_engine(cfg, args.engine)
        cfg, _, _ = configure(cfg)
    for kind in ("kill-scheduler", "fail-scheduler"):
        if args.engine == "local" and any(f.startswith(kind) for f in cfg.faults):
            raise ConfigError(f"fault {kind} needs the Ray engine (--engine ray)")
    return cfg


def _execute_run(
    cfg: RaykvConfig, engine: str, address: str | None, err: Console, label: str = "running"
) -> RunReport:
    """Run ``cfg``'s workload to the end on the local engine or a Ray deployment."""
    from raykv.report import run_progress
    from raykv.workload.requests import make_workload

    session = None
    if cfg.workload.kind == "chat":
        session, cfg = _chat_session(cfg)
    specs = make_workload(cfg) if session is None else []
    total = len(specs) or cfg.workload.num_requests
    if engine == "local":
        from raykv.engine.chat_run import run_chat
        from raykv.engine.core import EngineCore
        from raykv.engine.run import run_engine
        from raykv.engine.workers import LocalWorkerGroup

        with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
            core = EngineCore(cfg, workers)
            with run_progress(err, total, label) as progress:
                if session is not None:
                    report = run_chat(core, session, progress)
                else:
                    report = run_engine(core, specs, progress=progress)
    else:
        from raykv.cluster.client import RaykvClient

        with err.status("starting Ray and the raykv actors..."):
            client = RaykvClient.start(cfg, address=address)
        if client.metrics_url:
            err.print(f"Prometheus metrics (while the run lasts): {client.metrics_url}")
        if any(f.startswith("kill-") for f in cfg.faults):
            err.print(
                "injected faults kill processes: Ray reports each death below "
                "('A worker died or was killed...'); that is expected, the run carries on"
            )
        with client, run_progress(err, total, label) as progress:
            if session is not None:
                report = client.run_chat(session, progress)
            else:
                report = client.run_report(specs, progress=progress)
    report.engine = engine
    report.config = cfg.model_dump(mode="json")
    if session is not None:
        # by conversation, each one's turns in order (they finish in whatever order the
        # scheduler serves them)
        report.samples = [
            {"conversation": x.conversation, "question": x.question, "answer": x.answer}
            for x in sorted(session.exchanges, key=lambda x: x.conversation)
        ]
    return report


def _chat_session(cfg: RaykvConfig) -> tuple[ChatSession, RaykvConfig]:
    """``workload.kind: chat`` on the configured model, through its tokenizer (whose EOS then
    ends a request too, as in ``raykv generate``)."""
    from raykv.model.checkpoint import resolve, with_stop_tokens
    from raykv.model.tokenizer import Tokenizer
    from raykv.workload.chat import ChatSession

    if cfg.model.path is None:
        raise ConfigError("workload.kind chat needs a real model (model.path or --model)")
    tokenizer = Tokenizer.of(resolve(cfg.model.path), cfg.model.cache_dir)
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ConfigError(
            f"workload.kind chat: {cfg.model.path} has no tokenizer and chat template"
        )
    w = cfg.workload
    session = ChatSession(
        w.num_requests,
        chat_ids=tokenizer.chat,
        decode=tokenizer.decode,
        max_tokens=w.max_tokens,
        concurrent=w.concurrent_conversations,
        turns=w.chat_turns,
        seed=w.seed,
    )
    return session, with_stop_tokens(cfg, [tokenizer.eos_token_id])


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from raykv.report import print_run_report

    _check_output("--json-report", args.json_report)
    cfg = _prepared_run(args)
    report = _execute_run(cfg, args.engine, args.address, Console(stderr=True))
    shape = report.as_dict()
    # a few answers, as text: one conversation's turns, each asked after the previous answer
    samples = shape.get("samples", [])
    first = [x for x in samples if x["conversation"] == 0] or samples
    for sample in first[:3]:
        console.print(
            f"[bold]Q[/] {sample['question']}\n[bold]A[/] {sample['answer'].strip()}",
            highlight=False,
        )
    print_run_report(console, shape, verify=cfg.offload.verify)
    if args.json_report:
        Path(args.json_report).write_text(json.dumps(shape, indent=2) + "\n")
        console.print(f"wrote {args.json_report}")
    return 1 if report.integrity.mismatches else 0


def _cmd_bench_offload(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.offload import compare_runs, format_comparison, plot_ttft_distributions

    _check_output("--json", args.json)
    _check_output("--plot", args.plot)
    if args.plot:
        _need_matplotlib()
    args.no_offload, args.verify = False, False
    cfg = _prepared_run(args)
    err = Console(stderr=True)
    # the first run in a process pays for warming up (allocator, thread pools, the weights'
    # page cache): a few requests first, unmeasured, so that neither way is charged for it
    workload = cfg.workload.model_copy(update={"num_requests": min(4, cfg.workload.num_requests)})
    _execute_run(
        cfg.model_copy(update={"workload": workload}), args.engine, args.address, err, "warm-up"
    )
    runs = {}
    for way, enabled in (("with_tier", True), ("without_tier", False)):
        offload = cfg.offload.model_copy(update={"enabled": enabled})
        this = cfg.model_copy(update={"offload": offload})
        runs[way] = _execute_run(this, args.engine, args.address, err, way.replace("_", " "))
    result = compare_runs(runs["with_tier"].as_dict(), runs["without_tier"].as_dict())
    console.print(format_comparison(result), highlight=False)
    if args.json:
        shape = {**result, "runs": {k: v.as_dict() for k, v in runs.items()}}
        Path(args.json).write_text(json.dumps(shape, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    if args.plot:
        plot_ttft_distributions(
            runs["with_tier"].as_dict(), runs["without_tier"].as_dict(), args.plot
        )
        err.print(f"wrote {args.plot}")
    return 1 if any(r.integrity.mismatches for r in runs.values()) else 0


def _need_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'raykv[plot]'") from None


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    from raykv.core.step import SamplingError, SamplingSpec
    from raykv.engine.generate import Prompt, generate, read_prompt_file

    _check_output("--json", args.json)
    cfg = _real_model_config(args)
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
                cfg, prompts, args.max_tokens, sequential=args.sequential, sampling=sampling
            )
        report_shape = report.as_dict()
    else:
        from raykv.cluster.client import RaykvClient
        from raykv.engine.generate import prepare

        gen = prepare(cfg, prompts, args.max_tokens, sampling)  # bad input refused here
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
        Path(args.json).write_text(json.dumps(shape, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from raykv.serve.app import ServeOptions, Server

    cfg = _load_real_model_config(args)
    _check_device(cfg, "ray", args.address)
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
        server.start()
    try:
        auth = " (API key required)" if options.api_key else ""
        where = f"{server.url}/v1{auth}"
        err.print(f"serving {cfg.model.path} at {where}; Ctrl-C stops", highlight=False)
        server.wait()
    finally:
        with err.status("stopping..."):
            server.stop()
    return 0


def _interrupt_on_sigterm() -> None:
    """SIGTERM as Ctrl-C: a KeyboardInterrupt, so cleanup in ``finally`` runs."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _cmd_bench_serve(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.serve import bench_router, format_serve_table, reuse_bounds
    from raykv.cluster.runtime import connect
    from raykv.report import progress_bar
    from raykv.serve.app import ROUTERS, kv_layout, ray_resources, served_config
    from raykv.workload.requests import make_workload

    _check_output("--json", args.json)
    routers = [r.strip() for r in args.router.split(",") if r.strip()]
    for router in routers:
        if router not in ROUTERS:
            raise ConfigError(f"--router {router!r}: expected some of {', '.join(ROUTERS)}")
    kind, _, trace = args.workload.partition(":")
    if kind == "trace" and not Path(trace).is_file():  # before a model loads, not after
        raise ConfigError(f"--workload {args.workload}: no trace file at {trace!r}")
    args.set = [*(args.set or []), *_workload_overrides(args.workload, args.num_requests)]
    cfg = _load_real_model_config(args)
    _check_device(cfg, "ray", args.address)
    served, _ = served_config(cfg)
    specs = make_workload(served)
    bounds = reuse_bounds(specs, kv_layout(served), args.replicas)
    err = Console(stderr=True)
    cpus, gpus = ray_resources(cfg, args.replicas)
    ray_handle = connect(args.address, num_cpus=cpus, num_gpus=gpus)
    # after Ray's own handlers: the finally blocks then take the replicas and shard files down
    _interrupt_on_sigterm()
    results = []
    try:
        for router in routers:
            with progress_bar(err, len(specs), f"{router}: {len(specs)} requests") as advance:
                result = bench_router(
                    cfg,
                    router,
                    args.replicas,
                    specs,
                    args.concurrency,
                    args.port,
                    on_done=lambda _: advance(1),
                )
            results.append(result)
            err.print(
                f"{router}: TTFT mean {result.ttft_s['mean']:.3f} s, "
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
    title = (
        f"raykv bench serve: {cfg.model.path}, {args.replicas} replicas, {args.workload} "
        f"({len(specs)} requests, concurrency {args.concurrency})"
    )
    console.print(format_serve_table(results, title))
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
            "reuse_bounds": {"affinity": bounds.affinity, "random": bounds.random},
            "results": [r.as_dict(with_requests=args.per_request) for r in results],
        }
        Path(args.json).write_text(json.dumps(shape, indent=2) + "\n")
        err.print(f"wrote {args.json}")
    return 0


def _cmd_bench_route_weights(args: argparse.Namespace, console: Console) -> int:
    from raykv.bench.route_weights import measure_route_weights
    from raykv.bench.ttft import bench_config
    from raykv.model.checkpoint import configure

    _check_output("--json", args.json)
    if len(args.prompt_tokens) != 2 or args.prompt_tokens[0] >= args.prompt_tokens[1]:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens}: two lengths, shorter first")
    cfg = _load_real_model_config(args)
    _check_real_model_engine(cfg, "local")
    cfg, _, _ = configure(bench_config(cfg, list(args.prompt_tokens)))
    with Console(stderr=True).status("measuring computing, loading and decoding..."):
        m = measure_route_weights(cfg, tuple(args.prompt_tokens), tuple(args.decoders), args.repeat)
    console.print(
        f"computed prompt token: {m.compute_s_per_token * 1e3:.3f} ms; loaded from the CPU "
        f"tier: {m.load_s_per_token * 1e3:.4f} ms; decoding requests delay a prompt by "
        + ", ".join(f"{v * 1e3:.1f} ms ({k})" for k, v in m.decode_delay_s.items()),
        highlight=False,
    )
    console.print(
        f"serve.router_weights.cpu_hit_cost={m.cpu_hit_cost:.4f} "
        f"serve.router_weights.decode_cost={m.decode_cost:.2f}",
        highlight=False,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(m.as_dict(), indent=2) + "\n")
    return 0


def _cmd_config_check(args: argparse.Namespace, console: Console) -> int:
    config = load_config(args.file, args.set or ())
    console.print(f"{args.file}: ok", highlight=False)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")
    parser.add_argument("--workload", help="synthetic, or trace:FILE (Mooncake JSONL)")
    parser.add_argument(
        "--model",
        help="a real model (model.path: a preset, a Hugging Face directory or a .gguf file); "
        "tensor_parallel_size > 1 needs --engine ray",
    )
    parser.add_argument("--num-requests", type=int, help="how many requests to run")


def _add_real_model_args(parser: argparse.ArgumentParser) -> None:
    """--config, --set and --model of a command that runs a real model."""
    parser.add_argument("--config", help="YAML config (default: built-in defaults)")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")
    parser.add_argument(
        "--model",
        help="a preset (smollm2-135m-instruct, the default), a Hugging Face directory or a "
        ".gguf file (model.path)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raykv", description="Ray-native KV-cache offloading engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    pol = bench.add_parser(
        "policy", help="eviction policies against the offline optimum on a request trace"
    )
    pol.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    pol.add_argument(
        "--capacity-tokens",
        type=_int_list,
        required=True,
        help="CPU tier sizes in tokens, comma-separated (e.g. 1000000,3000000)",
    )
    pol.add_argument(
        "--policies", default="all", help="comma-separated policy names, or 'all' (default)"
    )
    pol.add_argument("--json", help="write the results to this JSON file")
    pol.add_argument(
        "--block-tokens", type=_positive_int, default=512, help="tokens per trace block"
    )
    pol.add_argument(
        "--repeat", type=_positive_int, default=3, help="timed replays per row; the fastest counts"
    )
    pol.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    pol.set_defaults(func=_cmd_bench_policy)

    tr = bench.add_parser(
        "transfer", help="transfer-engine bandwidth against one large copy of the same bytes"
    )
    tr.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default: cpu")
    tr.add_argument(
        "--page-kib",
        type=_int_list,
        default=[64, 256, 1024, 4096],
        help="page sizes in KiB, comma-separated (default 64,256,1024,4096)",
    )
    tr.add_argument("--blocks", type=int, default=512, help="blocks per job (default 512)")
    tr.add_argument(
        "--direction",
        default="store,load,both",
        help="comma-separated: store, load, both (default: all three)",
    )
    tr.add_argument(
        "--pattern",
        choices=["random", "contiguous"],
        default="random",
        help="GPU block order: random (scattered cache, default) or contiguous",
    )
    tr.add_argument("--repeat", type=int, default=3, help="timed runs per row; the fastest counts")
    tr.add_argument("--json", help="write the results to this JSON file")
    tr.set_defaults(func=_cmd_bench_transfer)

    st = bench.add_parser(
        "step", help="the connector's bookkeeping per engine step against what is cached"
    )
    st.add_argument(
        "--cached",
        type=_int_list,
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
    st.add_argument("--tp", type=_int_list, default=[2, 4], help="with --engine ray: TP sizes")
    st.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="with --engine ray: the real model whose decode step is timed both ways (a preset "
        "or a path; none: skip it)",
    )
    st.add_argument(
        "--model-tp",
        type=_int_list,
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
        "--requests", type=_int_list, default=[64, 256], help="decoding requests (default 64,256)"
    )
    pl.add_argument(
        "--context",
        type=_int_list,
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
    _add_real_model_args(dt)
    dt.add_argument("--tokens", type=_positive_int, default=50_000, help="stream length")
    dt.add_argument("--window", type=_positive_int, default=1_000, help="tokens per window")
    dt.add_argument("--json", help="write the result to this JSON file")
    dt.set_defaults(func=_cmd_bench_detokenize)

    off = bench.add_parser(
        "offload",
        help="one workload with the CPU tier and without: TTFT, throughput, hits, ratios",
    )
    _add_workload_options(off)
    off.add_argument("--json", help="write the comparison and both run reports to this file")
    off.add_argument("--plot", help="draw both TTFT distributions to this PNG file")
    off.set_defaults(func=_cmd_bench_offload, fault=None)

    tt = bench.add_parser(
        "ttft",
        help="time to first token of one prompt, recomputed vs loaded from the CPU tier",
    )
    tt.add_argument("--config", help="YAML config (default: built-in defaults)")
    tt.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a key")
    tt.add_argument(
        "--model", help="a preset (smollm2-135m-instruct, the default), a directory or a .gguf"
    )
    tt.add_argument(
        "--prompt-tokens", type=_int_list, default=[256, 512, 1024, 2048, 4096], metavar="N,N"
    )
    tt.add_argument("--repeat", type=_positive_int, default=3, help="fastest of R each way")
    tt.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process, TP 1 (default); ray: the rank actors",
    )
    tt.add_argument(
        "--no-transformers", action="store_true", help="skip transformers' forward pass"
    )
    tt.add_argument("--json", help="write the results to this JSON file")
    tt.add_argument("--plot", help="draw TTFT against prompt length to this PNG file")
    tt.set_defaults(func=_cmd_bench_ttft)

    bs = bench.add_parser(
        "serve", help="one workload through the HTTP API behind each request router in turn"
    )
    _add_real_model_args(bs)
    bs.add_argument("--replicas", type=_positive_int, default=2, help="engine replicas")
    bs.add_argument(
        "--router", default="kv,pow2,prefix", help="routers to compare, comma-separated"
    )
    bs.add_argument(
        "--workload",
        default="synthetic",
        help="synthetic (multi-turn conversations; workload.*) or trace:FILE (Mooncake JSONL)",
    )
    bs.add_argument("--num-requests", type=_positive_int, help="workload.num_requests")
    bs.add_argument("--concurrency", type=_positive_int, default=4, help="requests in flight")
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
    _add_real_model_args(rw)
    rw.add_argument("--prompt-tokens", type=_int_list, default=[256, 512], metavar="N,N")
    rw.add_argument("--decoders", type=_int_list, default=[8, 16], metavar="K,K")
    rw.add_argument("--repeat", type=_positive_int, default=3, help="fastest of R")
    rw.add_argument("--json", help="write the measurement to this JSON file")
    rw.set_defaults(func=_cmd_bench_route_weights)

    run = sub.add_parser("run", help="run a workload through the engine and report")
    _add_workload_options(run)
    run.add_argument("--no-offload", action="store_true", help="run without the CPU tier")
    run.add_argument(
        "--verify", action="store_true", help="check every loaded block's bytes (offload.verify)"
    )
    run.add_argument("--json-report", help="write the report to this JSON file")
    run.add_argument(
        "--fault",
        action="append",
        metavar="SPEC",
        help="inject a fault (repeatable): kill-worker:rate=P | kill-worker:step=N:rank=R | "
        "delay-acks:rank=R:steps=K | drop-acks:rate=P | dup-acks:rate=P | fail-copy:rate=P | "
        "corrupt-cpu:rate=P | stall-worker:step=N:rank=R:seconds=S | kill-scheduler:step=N | "
        "fail-scheduler:step=N, "
        "each with an optional :seed=S, a rank's with an optional "
        ":incarnation=I (only that instance of the rank; R: a rank below "
        "parallel.tensor_parallel_size)",
    )
    run.set_defaults(func=_cmd_run)

    gen = sub.add_parser("generate", help="prompts through a real model, texts out")
    _add_real_model_args(gen)
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
    gen.add_argument("--max-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0: no limit")
    gen.add_argument("--seed", type=int, help="same seed, same tokens")
    gen.add_argument(
        "--logprobs", type=int, help="report each token's log-probability and the top K"
    )
    gen.add_argument("--json", help="write the outputs and the run report to this JSON file")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on Ray Serve")
    _add_real_model_args(srv)
    # each flag overrides the config's serve: section (serve.host etc.)
    srv.add_argument("--host", help="where to listen (default: serve.host, loopback)")
    srv.add_argument("--port", type=int, help="default: serve.port, 8000")
    srv.add_argument("--replicas", type=_positive_int, help="engine replicas (serve.replicas)")
    srv.add_argument(
        "--router",
        help="how requests pick a replica: kv (where the prompt's KV already is; the default "
        "with more than one replica), pow2 (Serve's power of two choices; the default with "
        "one) or prefix (Ray Serve LLM's text prefix tree)",
    )
    srv.add_argument(
        "--api-key", help="require this bearer key (better: set RAYKV_API_KEY, kept out of ps)"
    )
    srv.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without a key"
    )
    srv.add_argument(
        "--address", help="the Ray cluster to join; default: RAY_ADDRESS, else an embedded Ray"
    )
    srv.set_defaults(func=_cmd_serve)

    cfg = sub.add_parser("config", help="configuration tools").add_subparsers(
        dest="config", required=True
    )
    check = cfg.add_parser("check", help="validate a config and print the resolved values")
    check.add_argument("file")
    check.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override")
    check.set_defaults(func=_cmd_config_check)
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

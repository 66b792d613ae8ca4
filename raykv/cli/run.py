"""``raykv run``: a workload through the engine (on Ray or in this process), a progress bar, the
report."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rich.console import Console

from raykv.cli.common import (
    add_workload_options,
    check_device,
    check_output,
    check_real_model_engine,
    workload_overrides,
    write_json,
)
from raykv.config import ConfigError, RaykvConfig, load_config

if TYPE_CHECKING:
    from raykv.runs.report import RunReport
    from raykv.workload.chat import ChatSession


def run_config(args: argparse.Namespace) -> RaykvConfig:
    overrides = [*(args.set or []), *workload_overrides(args.workload, args.num_requests)]
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


def prepared_run(args: argparse.Namespace) -> RaykvConfig:
    """``raykv run``'s config, checked, and configured for its checkpoint when it has one."""
    cfg = run_config(args)
    check_device(cfg, args.engine, args.address)
    if cfg.model.path is not None:  # a real model: its geometry, its vocabulary, its EOS
        from raykv.model.checkpoint import configure

        check_real_model_engine(cfg, args.engine)
        cfg, _, _ = configure(cfg)
    for kind in ("kill-scheduler", "fail-scheduler"):
        if args.engine == "local" and any(f.startswith(kind) for f in cfg.faults):
            raise ConfigError(f"fault {kind} needs the Ray engine (--engine ray)")
    return cfg


def execute_run(
    cfg: RaykvConfig, engine: str, address: str | None, err: Console, label: str = "running"
) -> RunReport:
    """Run ``cfg``'s workload to the end on the local engine or a Ray deployment."""
    from raykv.runs.terminal import run_progress
    from raykv.workload.requests import make_workload

    session = None
    if cfg.workload.kind == "chat":
        session, cfg = _chat_session(cfg)
    specs = make_workload(cfg) if session is None else []
    total = len(specs) or cfg.workload.num_requests
    if engine == "local":
        from raykv.engine.core import EngineCore
        from raykv.engine.workers import LocalWorkerGroup
        from raykv.runs.chat import run_chat
        from raykv.runs.driver import run_engine

        with LocalWorkerGroup(cfg, cfg.cpu_slots()) as workers:
            core = EngineCore(cfg, workers)
            with run_progress(err, total, label) as progress:
                if session is not None:
                    report = run_chat(core, session, progress)
                else:
                    report = run_engine(core, specs, progress=progress)
            core.stop()  # the CPU tier to the disk tier: the next run starts warm
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
    from raykv.runs.terminal import print_run_report

    check_output("--json-report", args.json_report)
    cfg = prepared_run(args)
    report = execute_run(cfg, args.engine, args.address, Console(stderr=True))
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
        write_json(args.json_report, shape, console)
    return 1 if report.integrity.mismatches else 0


def register(sub: Any) -> None:
    """``raykv run``."""
    run = sub.add_parser("run", help="run a workload through the engine and report")
    add_workload_options(run)
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
        "fail-scheduler:step=N | fail-disk:rate=P | corrupt-disk:rate=P | slow-disk:ms=N | "
        "full-disk[:after=N], "
        "each with an optional :seed=S, a rank's with an optional "
        ":incarnation=I (only that instance of the rank; R: a rank below "
        "parallel.tensor_parallel_size)",
    )
    run.set_defaults(func=_cmd_run)

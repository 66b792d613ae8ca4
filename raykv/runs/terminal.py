"""Terminal rendering of reports (rich tables and progress bars)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


@contextmanager
def run_progress(console: Console, total: int, label: str = "running") -> Iterator[callable]:
    """A progress bar for ``raykv run``: requests done, tokens/s and hit rates so far. Yields
    ``update(progress)`` taking the dict of ``EngineServer.progress`` / ``progress_of``."""
    bar = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task("run", total=total, stats="")
        start = time.perf_counter()

        def update(p: dict) -> None:
            elapsed = max(time.perf_counter() - start, 1e-9)
            admitted = max(p["admitted_tokens"], 1)
            hits = p["gpu_hit_tokens"] + p["cpu_hit_tokens"]
            ttft = p.get("ttft_p50_s")
            stats = (
                f"{p['generated_tokens'] / elapsed:7.0f} tok/s  "
                f"hit {hits / admitted:6.1%}  cpu {p['cpu_hit_tokens'] / admitted:6.1%}  "
                f"ttft p50 {_seconds(ttft) if ttft is not None else '-':>8}"
            )
            bar.update(task, completed=p["finished"], stats=stats)

        yield update


def _seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _latency(summary: dict | None) -> str:
    if summary is None:
        return "-"
    return "mean {}, p50 {}, p90 {}, p99 {}".format(
        *(_seconds(summary[k]) for k in ("mean", "p50", "p90", "p99"))
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _restarts(r: dict) -> str:
    n = r.get("rank_restarts", 0)
    return f"{n:,} (CPU tier kept in {r.get('tier_kept_restarts', 0):,})" if n else "0"


def print_run_report(console: Console, r: dict, verify: bool) -> None:
    """The final table of ``raykv run``."""
    table = Table(title="raykv run", title_justify="left", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    # hits are counted per admission, so they are shown as a share of what admissions needed
    # (more than the prompts when preemptions and restarts re-admit requests)
    admitted = max(r["admitted_tokens"], 1)
    rows = [
        ("requests finished", f"{r['requests_finished']} / {r['requests_admitted']}"),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("generated tokens", f"{r['generated_tokens']:,}"),
        ("admitted tokens", f"{r['admitted_tokens']:,} (re-admissions count again)"),
        (
            "GPU prefix-cache hits",
            f"{r['gpu_hit_tokens']:,} tokens ({r['gpu_hit_tokens'] / admitted:.1%} of admitted)",
        ),
        (
            "CPU-tier hits",
            f"{r['cpu_hit_tokens']:,} tokens ({r['cpu_hit_tokens'] / admitted:.1%} of admitted)",
        ),
        *_disk_rows(r, admitted),
        ("recomputed tokens", f"{r['recomputed_tokens']:,}"),
        ("time to first token", _latency(r.get("ttft_s"))),
        ("inter-token latency", _latency(r.get("itl_s"))),
        (
            "throughput",
            "{:,.0f} prompt + {:,.1f} generated tokens/s".format(
                r["throughput"]["prompt_tokens_per_s"], r["throughput"]["generated_tokens_per_s"]
            ),
        ),
    ]
    for name in ("loads", "stores"):
        x = r[name]
        bw = x["bytes"] / x["seconds"] / 1e9 if x["seconds"] else 0.0
        rows.append(
            (
                name,
                f"{x['jobs']:,} jobs, {x['blocks']:,} blocks, {_size(x['bytes'])}, {bw:.1f} GB/s",
            )
        )
    f = r["flushes"]
    rows += [
        ("fence flushes", f"reuse {f['reuse']}, preemption {f['preemption']}, reset {f['reset']}"),
        ("preemptions", f"{r['preemptions']:,}"),
        ("rank restarts", _restarts(r)),
        *(
            [("scheduler restarts", str(r["scheduler_restarts"]))]
            if r.get("scheduler_restarts")
            else []
        ),
        ("steps", f"{r['steps']:,} ({r['idle_steps']:,} polling only)"),
        ("wall time", f"{r['wall_seconds']:.2f} s"),
        ("output digest", r["output_digest"][:16]),
    ]
    if verify:
        i = r["integrity"]
        rows.append(("verified blocks", f"{i['blocks_verified']:,}, mismatches {i['mismatches']}"))
        rows.append(
            (
                "checksums",
                f"{i.get('checked', 0):,} loaded rows checked, "
                f"{i.get('corrupt_detected', 0):,} corrupt caught (recomputed)",
            )
        )
    if r.get("rejected"):
        rows.append(("rejected requests", str(len(r["rejected"]))))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for item in r.get("rejected", [])[:10]:
        console.print(f"[yellow]rejected[/] {item['request']}: {item['error']}")


@contextmanager
def progress_bar(console: Console, total: int, label: str) -> Iterator[callable]:
    """A progress bar on stderr; yields ``advance(n)``. Silent when stderr is not a terminal."""
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _disk_rows(r: dict, admitted: int) -> list[tuple[str, str]]:
    """The disk tier's rows, and the hits the scheduler passed over as slower than recomputing
    (none without a disk tier or a choice)."""
    rows: list[tuple[str, str]] = []
    tiers = r.get("tiers") or {}
    disk = tiers.get("disk")
    if disk is not None:
        hits = r.get("disk_hit_tokens", 0)
        rows.append(("disk-tier hits", f"{hits:,} tokens ({hits / admitted:.1%} of admitted)"))
        rows.append(
            (
                "disk tier",
                f"{disk['used_chunks']:,} / {disk['capacity_chunks']:,} chunks, {disk['io']} I/O",
            )
        )
        for name, chunks, key in (
            ("disk reads", "promoted_chunks", "read"),
            ("disk writes", "demoted_chunks", "write"),
        ):
            rows.append(
                (
                    name,
                    f"{disk[chunks]:,} chunks, {_size(disk[key + '_bytes'])}, "
                    f"{disk[key + '_gbps']:.2f} GB/s",
                )
            )
        if disk["warm_start_chunks"]:
            rows.append(("disk warm start", f"{disk['warm_start_chunks']:,} chunks found"))
    skipped = {name: t.get("skipped_slower", 0) for name, t in tiers.items()}
    if any(skipped.values()):
        rows.append(
            (
                "hits recomputed (slower)",
                ", ".join(f"{name} {n:,}" for name, n in skipped.items()),
            )
        )
    return rows

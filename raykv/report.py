"""Terminal rendering of reports (rich tables and progress bars)."""

from __future__ import annotations

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

from raykv.bench.policy import BASELINE_LRU, BELADY, PolicyBenchReport


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


def policy_table(report: PolicyBenchReport) -> Table:
    """One row per (capacity, policy): hit rates, ratio to Belady, speed against the bare LRU."""
    table = Table(
        title=f"raykv bench policy: {report.trace} ({report.requests} requests, "
        f"{report.block_tokens}-token blocks)",
        title_justify="left",
    )
    for col in ("capacity", "policy", "token hit", "x belady", "block hit"):
        table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for col in ("evictions", "seconds", "x bare-LRU time"):
        table.add_column(col, justify="right", no_wrap=True)
    for cap, row in report.rows.items():
        best = row[BELADY].token_hit_rate or 1.0
        base = row[BASELINE_LRU].seconds or 1e-9
        for i, (name, r) in enumerate(row.items()):
            table.add_row(
                f"{cap:,} tokens" if i == 0 else "",
                name,
                f"{r.token_hit_rate:.2%}",
                f"{r.token_hit_rate / best:.3f}",
                f"{r.block_hit_rate:.2%}",
                f"{r.evictions:,}",
                f"{r.seconds:.3f}",
                "-" if name == BELADY else f"{r.seconds / base:.2f}",
                end_section=i == len(row) - 1,
            )
    return table

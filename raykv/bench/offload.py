"""``raykv bench offload``: one workload run twice, with a tier and without it, and what the
tier changed: time to first token (mean, p50, p90, p99), throughput, prompt tokens by where they
came from, and request by request (the runs' per-request lists joined on the request id) the
TTFT ratio of the requests that hit the tier. ``--tiers cpu`` compares the CPU tier with no
tier; ``--tiers cpu,disk`` the CPU and disk tiers with the CPU tier alone (``--against none``:
with no tier at all).
"""

from __future__ import annotations

import statistics
from typing import Any

from raykv.engine.latency import percentile


def _way(report: dict[str, Any]) -> dict[str, Any]:
    ttft = report.get("ttft_s") or {}
    return {
        "ttft_mean_s": ttft.get("mean"),
        "ttft_p50_s": ttft.get("p50"),
        "ttft_p90_s": ttft.get("p90"),
        "ttft_p99_s": ttft.get("p99"),
        "generated_tokens_per_s": report["throughput"]["generated_tokens_per_s"],
        "prompt_tokens_per_s": report["throughput"]["prompt_tokens_per_s"],
        "prefill_tokens": report["prefill_tokens"],
        "wall_seconds": report["wall_seconds"],
        "requests_finished": report["requests_finished"],
        # what a step cost, and of it the rank's model and the rank's moves (report.step_time)
        "step_time": {key: report["step_time"].get(key) for key in STEP_PARTS},
        "steps": report.get("steps"),
        "idle_steps": report.get("idle_steps"),
    }


# the parts of a step the comparison shows: where a tier's cost lands, if it has one
STEP_PARTS = ("busy_step_s", "step_s", "model_s", "transfers_s")
# each ratio: the field of a way (``_way``) it divides, and its row in the table (name, unit)
RATIOS = {
    "ttft_mean": ("ttft_mean_s", "TTFT mean", "s"),
    "ttft_p50": ("ttft_p50_s", "TTFT p50", "s"),
    "ttft_p90": ("ttft_p90_s", "TTFT p90", "s"),
    "ttft_p99": ("ttft_p99_s", "TTFT p99", "s"),
    "generated_tokens_per_s": ("generated_tokens_per_s", "generated tokens/s", ""),
}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _hit_ratios(with_tier: dict[str, Any], without_tier: dict[str, Any], key: str) -> dict:
    """The TTFT ratio (with / without) of the requests that hit a tier (``key``: the request
    records' hit tokens of that tier), joined on the request id."""
    before = {r["req_id"]: r for r in without_tier["requests"]}
    ordered = sorted(
        r["ttft_s"] / before[r["req_id"]]["ttft_s"]
        for r in with_tier["requests"]
        if r.get(key, 0) > 0 and r["req_id"] in before and before[r["req_id"]]["ttft_s"] > 0
    )
    return {
        "count": len(ordered),
        "ttft_ratio_median": statistics.median(ordered) if ordered else None,
        "ttft_ratio_p90": percentile(ordered, 90) if ordered else None,
    }


def warm_up_requests(num_requests: int, engine: str = "local", asked: int | None = None) -> int:
    """How many of the workload's requests run first, unmeasured (``--warm-up``; ``asked``
    None: the default). The first run in a process pays for what later runs in it find ready:
    on CUDA every kernel and GEMM shape met for the first time (loaded lazily, its heuristics
    cached), on both devices the allocator's growth and the caches of the model's code paths;
    only the same workload meets the same shapes, so the default on the local engine is all of
    it. Measured, with 4 requests of warm-up and the run with the tiers measured first: on an
    H200 (a random SmolLM2-shaped model, the shared trace, 300 requests) that run had 2.6x the
    mean TTFT of the one after it, though standalone runs of the two ways were within 17% of
    each other either way round; on this 2-core machine (SmolLM2, the trace as conversations,
    300 requests) p90 1.02x and p99 1.08x, and with the whole workload first 0.99x and 0.96x.
    On Ray each run starts rank actors of its own, which no warm-up reaches: none by default."""
    if asked is not None:
        return min(asked, num_requests)
    return num_requests if engine == "local" else 0


def pool_runs(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one way (``--repeat``) as one report: the requests of all of them (each id
    marked with its repeat, ``#i``, so that a repeat's requests join the other way's of the same
    repeat), TTFT percentiles over them all, and the means of the totals. A percentile pooled
    from K runs moves less with one run's noise than any one run's does."""
    if len(reports) == 1:
        return reports[0]
    pooled = dict(reports[0])
    requests = [
        {**r, "req_id": f"{r['req_id']}#{i}"}
        for i, report in enumerate(reports)
        for r in report["requests"]
    ]
    ttfts = sorted(r["ttft_s"] for r in requests if r.get("ttft_s") is not None)
    pooled["requests"] = requests
    pooled["ttft_s"] = (
        {"mean": statistics.fmean(ttfts), **{f"p{q}": percentile(ttfts, q) for q in (50, 90, 99)}}
        if ttfts
        else None
    )

    pooled["throughput"] = {
        key: statistics.fmean(r["throughput"][key] for r in reports)
        for key in reports[0]["throughput"]
    }
    pooled["prefill_tokens"] = {
        key: round(statistics.fmean(r["prefill_tokens"][key] for r in reports))
        for key in reports[0]["prefill_tokens"]
    }
    pooled["step_time"] = _pooled_step_time(reports)
    for key in (
        "wall_seconds",
        "requests_finished",
        "cpu_hit_tokens",
        "disk_hit_tokens",
        "steps",
        "idle_steps",
    ):
        if key in reports[0]:
            pooled[key] = statistics.fmean(r.get(key, 0) for r in reports)
    disk = (reports[0].get("tiers") or {}).get("disk")
    if disk is not None:
        late = sum(
            (r.get("tiers") or {}).get("disk", {}).get("later_than_recompute", 0) for r in reports
        )
        pooled["tiers"] = {**reports[0]["tiers"], "disk": {**disk, "later_than_recompute": late}}
    return pooled


def _pooled_step_time(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The repeats' ``step_time`` as one run's: each mean over all their steps (busy_step_s
    over their busy ones), outside_share from the pooled means."""
    steps = [r["steps"] for r in reports]
    busy = [r["steps"] - r["idle_steps"] for r in reports]
    out = {}
    for key in reports[0]["step_time"]:
        weights = busy if key == "busy_step_s" else steps
        total = sum(r["step_time"][key] * w for r, w in zip(reports, weights, strict=True))
        out[key] = total / max(sum(weights), 1)
    if "outside_share" in out:
        step = out["step_s"]
        out["outside_share"] = 1.0 - out["ranks_busy_s"] / step if step > 0 else 0.0
    return out


def _ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    return {key: _ratio(on[field], off[field]) for key, (field, _, _) in RATIOS.items()}


def repeat_ratios(
    with_runs: list[dict[str, Any]], without_runs: list[dict[str, Any]]
) -> dict[str, list[float | None]]:
    """Each repeat's own ratios (with / without, repeat i against repeat i): how far they
    scatter is the noise of one pair of runs on this machine, the yardstick for the pooled
    ratios' distance from 1."""
    pairs = [_ratios(_way(on), _way(off)) for on, off in zip(with_runs, without_runs, strict=True)]
    return {key: [pair[key] for pair in pairs] for key in RATIOS}


def compare_runs(
    with_tier: dict[str, Any], without_tier: dict[str, Any], tiers: tuple[str, ...] = ("cpu",)
) -> dict[str, Any]:
    """The two run reports (``RunReport.as_dict``) side by side, with the ratios (with /
    without: below 1 means the tier made it faster); ``tiers``: those of the run with."""
    on, off = _way(with_tier), _way(without_tier)
    result: dict[str, Any] = {
        "tiers": list(tiers),
        "with_tier": on,
        "without_tier": off,
        "ratios": _ratios(on, off),
        "cpu_hit_requests": _hit_ratios(with_tier, without_tier, "cpu_hit_tokens"),
        "tier_hit_tokens": {
            way: report["cpu_hit_tokens"] + report.get("disk_hit_tokens", 0)
            for way, report in (("with_tier", with_tier), ("without_tier", without_tier))
        },
    }
    if "disk" in tiers:
        result["disk_hit_requests"] = _hit_ratios(with_tier, without_tier, "disk_hit_tokens")
        result["later_than_recompute"] = (
            (with_tier.get("tiers") or {}).get("disk", {}).get("later_than_recompute")
        )
    return result


def _cell(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:,.2f}"


def _count(steps: float, idle: float | None) -> str:
    return f"{steps:,.0f} ({idle or 0:,.0f})"


def format_comparison(result: dict[str, Any]) -> str:
    on, off, ratio = result["with_tier"], result["without_tier"], result["ratios"]
    spread = result.get("repeat_ratios")
    lines = [
        f"raykv bench offload: the same workload with tiers {'+'.join(result['tiers'])} "
        "and without the last"
        + (f", {result['repeats']} runs each, pooled" if result.get("repeats", 1) > 1 else ""),
        f"{'':<22}{'with tier':>14}{'without':>14}{'with/without':>14}"
        + (f"{'each repeat':>24}" if spread else ""),
    ]
    for ratio_key, (key, name, unit) in RATIOS.items():
        lines.append(
            f"{name:<22}{_cell(on[key], unit):>14}{_cell(off[key], unit):>14}"
            f"{_cell(ratio[ratio_key]):>14}"
            + (f"{' '.join(_cell(v) for v in spread[ratio_key]):>24}" if spread else "")
        )
    if on.get("steps") is not None and off.get("steps") is not None:
        lines.append(
            f"{'steps (idle ones)':<22}{_count(on['steps'], on['idle_steps']):>14}"
            f"{_count(off['steps'], off['idle_steps']):>14}"
        )
    for name, key in (
        ("busy step", "busy_step_s"),
        ("step", "step_s"),
        ("  its rank's model", "model_s"),
        ("  its rank's moves", "transfers_s"),
    ):
        a, b = on["step_time"].get(key), off["step_time"].get(key)
        if a is not None and b is not None:
            lines.append(
                f"{name:<22}{_cell(a, 's'):>14}{_cell(b, 's'):>14}{_cell(_ratio(a, b)):>14}"
            )
    for source in ("computed", "gpu_cache", "cpu_tier", "disk_tier"):
        lines.append(
            f"{'prefill ' + source:<22}{on['prefill_tokens'].get(source, 0):>14,}"
            f"{off['prefill_tokens'].get(source, 0):>14,}"
        )
    for name, key in (("the CPU tier", "cpu_hit_requests"), ("the disk tier", "disk_hit_requests")):
        hits = result.get(key)
        if hits is not None:
            lines.append(
                f"requests that hit {name}: {hits['count']}, their TTFT with/without: median "
                f"{_cell(hits['ttft_ratio_median'])}, p90 {_cell(hits['ttft_ratio_p90'])}"
            )
    if result.get("later_than_recompute") is not None:
        lines.append(
            "disk hits whose first token came later than the scheduler's predicted recompute: "
            f"{result['later_than_recompute']}"
        )
    return "\n".join(lines)


def plot_ttft_distributions(
    with_tier: dict[str, Any], without_tier: dict[str, Any], path: str
) -> None:
    """Both runs' TTFT as cumulative distributions, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, report in (("with the tier", with_tier), ("without", without_tier)):
        values = sorted(r["ttft_s"] for r in report["requests"])
        if values:
            share = [(i + 1) / len(values) for i in range(len(values))]
            axes.step(values, share, where="post", label=label)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s)")
    axes.set_ylabel("share of requests")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

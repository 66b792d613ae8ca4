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


SHORT_WARM_UP_REQUESTS = 4


def warm_up_requests(device: str, num_requests: int, asked: int | None = None) -> int:
    """How many of the workload's requests run first, unmeasured (``--warm-up``; ``asked``
    None: the default). The first run in a process pays for what later runs find ready: on
    CUDA that is every kernel and GEMM shape met for the first time (loaded lazily, its
    heuristics cached) and the allocator's growth, so the default there is the whole workload.
    Measured on an H200 (a random SmolLM2-shaped model, the shared trace, 300 requests): after
    a 4-request warm-up the run measured first, with the CPU tier, had 2.6x the mean TTFT of
    the one after it, without; standalone runs of the two ways, alternated, were within 17%
    of each other either way round. On CPU ranks a short warm-up (threads, the weights' page
    cache) is enough, and the whole workload again would cost half the bench's time."""
    if asked is not None:
        return max(0, min(asked, num_requests))
    return num_requests if device == "cuda" else min(SHORT_WARM_UP_REQUESTS, num_requests)


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
        "ratios": {
            "ttft_mean": _ratio(on["ttft_mean_s"], off["ttft_mean_s"]),
            "ttft_p50": _ratio(on["ttft_p50_s"], off["ttft_p50_s"]),
            "ttft_p90": _ratio(on["ttft_p90_s"], off["ttft_p90_s"]),
            "ttft_p99": _ratio(on["ttft_p99_s"], off["ttft_p99_s"]),
            "generated_tokens_per_s": _ratio(
                on["generated_tokens_per_s"], off["generated_tokens_per_s"]
            ),
        },
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


def format_comparison(result: dict[str, Any]) -> str:
    on, off, ratio = result["with_tier"], result["without_tier"], result["ratios"]
    rows = [
        ("TTFT mean", "ttft_mean_s", "ttft_mean", "s"),
        ("TTFT p50", "ttft_p50_s", "ttft_p50", "s"),
        ("TTFT p90", "ttft_p90_s", "ttft_p90", "s"),
        ("TTFT p99", "ttft_p99_s", "ttft_p99", "s"),
        ("generated tokens/s", "generated_tokens_per_s", "generated_tokens_per_s", ""),
    ]
    lines = [
        f"raykv bench offload: the same workload with tiers {'+'.join(result['tiers'])} "
        "and without the last",
        f"{'':<22}{'with tier':>14}{'without':>14}{'with/without':>14}",
    ]
    for name, key, ratio_key, unit in rows:
        lines.append(
            f"{name:<22}{_cell(on[key], unit):>14}{_cell(off[key], unit):>14}"
            f"{_cell(ratio[ratio_key]):>14}"
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

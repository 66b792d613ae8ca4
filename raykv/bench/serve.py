"""``raykv bench serve``: one workload through the HTTP API, one request router after another,
as a client sees it.

For each router a fresh application is deployed (its replicas' caches empty), warmed with a
few short requests, and the workload is sent with the official ``openai`` client: token-id
prompts to ``/v1/completions``, streamed, ``concurrency`` at a time. A multi-turn workload's
turn waits for the turn before it in its conversation (its prompt extends that one's), so a
returning conversation can find its KV where the previous turn left it. TTFT is from sending
the request to its first streamed token; the prompt tokens each replica took from its GPU cache
and its CPU tier come from the usage the server reports.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raykv.config import RaykvConfig
from raykv.engine.latency import LatencySummary
from raykv.serve.kv_index import KVLayout, PromptKeys, ReplicaKV, prompt_hit
from raykv.workload.requests import RequestSpec

# how far back a turn looks for the turn it extends (conversations open at once are fewer)
DEPENDENCY_WINDOW = 64
WARMUP_REQUESTS_PER_REPLICA = 2
REQUEST_TIMEOUT_S = 600.0
# how long vLLM's own server may take to start (import, engine, model, API)
VLLM_START_S = 300.0


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it."""

    request_id: str
    ttft_s: float | None
    output_tokens: int
    prompt_tokens: int
    gpu_cache_tokens: int
    cpu_tier_tokens: int
    replica: str
    error: str | None = None
    disk_tier_tokens: int = 0
    shared_tier_tokens: int = 0
    run: int = 0  # which of a way's repeated runs (``--repeat``)


@dataclass(slots=True)
class ServeBenchResult:
    """One router's run: TTFT percentiles (seconds), output tokens per second of the run's wall
    time, and where the prompt tokens came from."""

    router: str
    ttft_s: dict[str, float]
    output_tokens_per_s: float
    prefill_tokens: dict[str, int]
    requests: int
    errors: int
    wall_s: float
    replicas_used: int
    run_ttft_means: list[float] = field(default_factory=list)  # each run's mean TTFT (pooled)
    requests_list: list[RequestResult] = field(default_factory=list, repr=False)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed: from the GPU caches and every tier."""
        return sum(n for where, n in self.prefill_tokens.items() if where != "computed")

    def as_dict(self, with_requests: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not with_requests:
            out.pop("requests_list")
        return out


def dependencies(specs: Sequence[RequestSpec]) -> list[int | None]:
    """For each request, the earlier one within ``DEPENDENCY_WINDOW`` whose prompt is the
    longest its own extends (the previous turn of its conversation), if any."""
    out: list[int | None] = []
    for i, spec in enumerate(specs):
        dep, longest = None, 0
        for j in range(i - 1, max(-1, i - 1 - DEPENDENCY_WINDOW), -1):
            prior = specs[j].prompt
            if longest < len(prior) < len(spec.prompt) and spec.prompt[: len(prior)] == prior:
                dep, longest = j, len(prior)
        out.append(dep)
    return out


@dataclass(slots=True)
class ReuseBounds:
    """What a workload lets any router reuse, on replicas of unbounded GPU caches taking the
    requests in the workload's order: each request sent to a replica holding the most of its
    prompt (``affinity``) or to one at random (``random``, the mean over several draws).
    Against these a router's cached tokens read as a share of what was there to get: real
    caches are bounded, and requests in flight overlap, so a run gets less than ``affinity``."""

    affinity: int
    random: int

    @property
    def ratio(self) -> float:
        return self.affinity / self.random if self.random else 0.0


def reuse_bounds(
    specs: Sequence[RequestSpec], layout: KVLayout, replicas: int, draws: int = 10, seed: int = 0
) -> ReuseBounds:
    """``ReuseBounds`` of these requests (prompts hashed as the engine hashes them)."""
    keys = [PromptKeys.of(spec.prompt, layout) for spec in specs]

    def reused(choose: Callable[[list[int]], int]) -> int:
        held: list[set[int]] = [set() for _ in range(replicas)]
        total = 0
        for prompt in keys:
            hits = [prompt_hit(prompt, ReplicaKV(gpu=h), layout).gpu_tokens for h in held]
            where = choose(hits)
            total += hits[where]
            held[where].update(prompt.published)
        return total

    rng = random.Random(seed)

    def most(hits: list[int]) -> int:
        best = max(hits)
        return rng.choice([i for i, h in enumerate(hits) if h == best])

    affinity = reused(most)
    randomly = sum(reused(lambda hits: rng.randrange(len(hits))) for _ in range(draws))
    return ReuseBounds(affinity, round(randomly / draws))


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (``engine.latency``'s interpolation); zeros for no values."""
    summary = LatencySummary.of(values)
    if summary is None:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {"mean": summary.mean, "p50": summary.p50, "p90": summary.p90, "p99": summary.p99}


def summarize(router: str, results: list[RequestResult], wall_s: float) -> ServeBenchResult:
    ok = [r for r in results if r.error is None]
    where = {
        "gpu_cache": sum(r.gpu_cache_tokens for r in ok),
        "cpu_tier": sum(r.cpu_tier_tokens for r in ok),
        "disk_tier": sum(r.disk_tier_tokens for r in ok),
        "shared_tier": sum(r.shared_tier_tokens for r in ok),
    }
    prompt = sum(r.prompt_tokens for r in ok)
    ttft = percentiles([r.ttft_s for r in ok if r.ttft_s is not None])
    return ServeBenchResult(
        router=router,
        ttft_s=ttft,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        prefill_tokens={**where, "computed": prompt - sum(where.values())},
        requests=len(results),
        errors=len(results) - len(ok),
        wall_s=wall_s,
        replicas_used=len({r.replica for r in ok}),
        run_ttft_means=[ttft["mean"]],
        requests_list=results,
    )


@dataclass(frozen=True, slots=True)
class ServeWay:
    """One way of serving the workload in a comparison: a router, with the shared tier on, off,
    or as the config says (None)."""

    router: str
    shared: bool | None = None

    @property
    def label(self) -> str:
        return f"{self.router}+shared" if self.shared else self.router


SHARED_CHOICES: dict[str, tuple[bool | None, ...]] = {
    "config": (None,),
    "on": (True,),
    "off": (False,),
    "both": (False, True),
}


def serve_ways(routers: Sequence[str], shared: str) -> list[ServeWay]:
    """Every router, each with the shared tier as ``shared`` says (``SHARED_CHOICES``)."""
    return [ServeWay(router, on) for router in routers for on in SHARED_CHOICES[shared]]


def run_order(ways: Sequence[ServeWay], repeats: int) -> list[ServeWay]:
    """The runs of a comparison: every way once a repeat, in order on even repeats and in reverse
    on odd ones, so that no way always runs first or last on a machine whose speed drifts (two
    runs of the same way moved the mean TTFT by a quarter here)."""
    order: list[ServeWay] = []
    for repeat in range(repeats):
        order.extend(ways if repeat % 2 == 0 else reversed(ways))
    return order


def pool(label: str, runs: Sequence[ServeBenchResult]) -> ServeBenchResult:
    """Several runs of one way as one: TTFT percentiles over all their requests, output tokens
    per second of their summed wall time, where the prompt tokens came from as the runs' mean
    (comparable with one run's and with the workload's bounds; each source rounded on its own),
    requests, errors and wall time of them all, and each run's own mean TTFT (their scatter is
    the noise of one run)."""
    requests = [r for run in runs for r in run.requests_list]
    pooled = summarize(label, requests, sum(run.wall_s for run in runs))
    pooled.prefill_tokens = {k: round(v / len(runs)) for k, v in pooled.prefill_tokens.items()}
    pooled.replicas_used = max(run.replicas_used for run in runs)
    pooled.run_ttft_means = [run.ttft_s["mean"] for run in runs]
    return pooled


async def _one(client: Any, model: str, spec: RequestSpec) -> RequestResult:
    started = time.perf_counter()
    first: float | None = None
    usage = None
    replica = ""
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(spec.prompt),
            max_tokens=spec.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter()
            replica = chunk.system_fingerprint or replica
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:
        return RequestResult(spec.req_id, None, 0, len(spec.prompt), 0, 0, replica, repr(exc))
    ttft = None if first is None else first - started
    if usage is None:
        return RequestResult(spec.req_id, ttft, 0, len(spec.prompt), 0, 0, replica)
    details = usage.prompt_tokens_details
    extra = (details.model_extra or {}) if details is not None else {}
    # vLLM's own server reports only cached_tokens (its prefix cache and its connector's)
    cached = (details.cached_tokens or 0) if details is not None else 0
    return RequestResult(
        spec.req_id,
        ttft,
        usage.completion_tokens,
        usage.prompt_tokens,
        int(extra.get("gpu_cache_tokens", cached)),
        int(extra.get("cpu_tier_tokens", 0)),
        replica,
        disk_tier_tokens=int(extra.get("disk_tier_tokens", 0)),
        shared_tier_tokens=int(extra.get("shared_tier_tokens", 0)),
    )


async def drive(
    base_url: str,
    api_key: str,
    specs: Sequence[RequestSpec],
    concurrency: int,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request (each after the one it extends), ``concurrency`` at a time; the
    results in the workload's order and the wall time."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    try:
        model = (await client.models.list()).data[0].id
        deps = dependencies(specs)
        done = [asyncio.Event() for _ in specs]
        results: list[RequestResult | None] = [None] * len(specs)
        order = iter(range(len(specs)))

        async def worker() -> None:
            for i in order:
                dep = deps[i]
                if dep is not None:
                    await done[dep].wait()
                results[i] = result = await _one(client, model, specs[i])
                done[i].set()
                if on_done is not None:
                    on_done(result)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        wall = time.perf_counter() - started
        return [r for r in results if r is not None], wall
    finally:
        await client.close()


def warmup_specs(cfg: RaykvConfig, replicas: int, seed: int = 1) -> list[RequestSpec]:
    """Short prompts of no shared prefix: every replica's first steps (and torch's) done
    before the clock starts."""
    rng = random.Random(seed)
    vocab = cfg.model.vocab_size
    return [
        RequestSpec(f"warmup-{i}", tuple(rng.randrange(vocab - 1) for _ in range(8)), 2, 0.0)
        for i in range(WARMUP_REQUESTS_PER_REPLICA * replicas)
    ]


def bench_router(
    cfg: RaykvConfig,
    router: str,
    replicas: int,
    specs: Sequence[RequestSpec],
    concurrency: int,
    port: int,
    on_done: Callable[[RequestResult], None] | None = None,
) -> ServeBenchResult:
    """Deploy ``replicas`` behind ``router`` on the Ray this process is connected to, run the
    workload, tear the application down (and the shared tier's pool with it: each router's run
    starts from an empty store, not from what the one before published)."""
    from raykv.cluster.shared_store import stop_shared_store
    from raykv.serve.app import ServeOptions, Server

    # the config's serve: section (replica resources, router weights) as raykv serve takes it
    options = ServeOptions.of(cfg.serve, port=port, replicas=replicas, router=router)
    disk_dir = None
    if cfg.offload.enabled and cfg.offload.disk.enabled and cfg.offload.disk.path:
        # each run's disk tier starts empty too, in a directory of its own under the path
        import tempfile

        os.makedirs(cfg.offload.disk.path, exist_ok=True)
        disk_dir = tempfile.mkdtemp(prefix="bench-run-", dir=cfg.offload.disk.path)
        disk = cfg.offload.disk.model_copy(update={"path": disk_dir})
        cfg = cfg.model_copy(update={"offload": cfg.offload.model_copy(update={"disk": disk})})
    server = Server(cfg, options).start()
    try:
        url = server.url + "/v1"
        asyncio.run(drive(url, "none", warmup_specs(server.cfg, replicas), replicas))
        results, wall = asyncio.run(drive(url, "none", specs, concurrency, on_done))
    finally:
        server.stop()
        if cfg.offload.shared.enabled:
            stop_shared_store()
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    return summarize(router, results, wall)


def bench_vllm_server(
    cfg: RaykvConfig,
    specs: Sequence[RequestSpec],
    concurrency: int,
    port: int,
    on_done: Callable[[RequestResult], None] | None = None,
) -> ServeBenchResult:
    """The baseline of ``--router vllm``: the workload sent straight to vLLM's own OpenAI
    server (``python -m vllm.entrypoints.openai.api_server``), one engine with the settings and
    the cores of one ``serve.engine: vllm`` replica, no Ray Serve in front; stopped after."""
    import tempfile
    from pathlib import Path

    from raykv.serve.app import served_config
    from raykv.serve.cores import CoreClaim
    from raykv.vllm.api_server import running
    from raykv.vllm.serving import api_server_command, cpu_platform

    served, model_dir = served_config(cfg)
    cpu = cpu_platform()
    command = api_server_command(
        model_dir, served.serve.vllm.model_dump(), served.offload, port, cpu
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    claim = None
    if cpu:
        tp = served.serve.vllm.tensor_parallel_size
        claim = CoreClaim.claim(served.serve.replica_cpus * tp)
        env.update(claim.vllm_env(tp))
    log_dir = tempfile.mkdtemp(prefix="raykv-bench-vllm-")
    try:
        with running(command, port, Path(log_dir) / "server.log", env, VLLM_START_S) as base:
            url = base + "/v1"
            asyncio.run(drive(url, "none", warmup_specs(served, 1), 1))
            results, wall = asyncio.run(drive(url, "none", specs, concurrency, on_done))
    finally:
        if claim is not None:
            claim.release()
        shutil.rmtree(log_dir, ignore_errors=True)
    return summarize("vllm", results, wall)


def format_serve_table(results: Sequence[ServeBenchResult], title: str, affinity: int = 0) -> Any:
    """A rich table, one row per router (and way), and the ratios against pow2 (with the shared
    tier as the row has it) when it ran."""
    from rich.table import Table

    table = Table(title=title)
    for column in (
        "router",
        "TTFT mean",
        "p50",
        "p90",
        "p99",
        "output tok/s",
        "from GPU caches",
        "from CPU tiers",
        "from disk tiers",
        "from the shared tier",
        "computed",
        "cached vs pow2",
        "of affinity bound",
        "errors",
    ):
        table.add_column(column, justify="left" if column == "router" else "right")
    by_label = {r.router: r for r in results}
    for r in results:
        ratio = ""
        # against pow2 with the shared tier as this row has it
        base = by_label.get("pow2+shared" if r.router.endswith("+shared") else "pow2")
        if base is not None and base.cached_tokens > 0:
            ratio = f"{r.cached_tokens / base.cached_tokens:.2f}x"
        t = r.ttft_s
        table.add_row(
            r.router,
            f"{t['mean']:.3f} s",
            f"{t['p50']:.3f} s",
            f"{t['p90']:.3f} s",
            f"{t['p99']:.3f} s",
            f"{r.output_tokens_per_s:.1f}",
            f"{r.prefill_tokens['gpu_cache']:,}",
            f"{r.prefill_tokens['cpu_tier']:,}",
            f"{r.prefill_tokens.get('disk_tier', 0):,}",
            f"{r.prefill_tokens.get('shared_tier', 0):,}",
            f"{r.prefill_tokens['computed']:,}",
            ratio,
            f"{r.cached_tokens / affinity:.2f}" if affinity else "",
            str(r.errors),
        )
    return table

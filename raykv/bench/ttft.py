"""``raykv bench ttft``: time to first token of one prompt alone, recomputed against loaded from
the CPU tier and from the disk tier, with transformers' own forward pass over the same prompt
beside them.

For each prompt length and repeat, a fresh prompt of random token ids is sent to one engine
with ``max_tokens`` 1, three times. The first time nothing holds it: the whole prefill is
computed (``recompute_s``), and its KV is stored to the CPU tier. Then, once every store has
landed, the GPU prefix cache is emptied, so the second time the CPU tier is the only source: the
prefix is loaded and only the last token is computed (``cpu_tier_s``). With a disk tier, the CPU
tier is then moved to disk entirely (``EngineCore.spill_to_disk``) and the GPU cache emptied
again, so the third time the prefix is read from its files (with ``O_DIRECT`` where the file
system allows it: cold, not from the page cache), promoted into the CPU tier and loaded
(``disk_tier_s``). With a shared tier, a second engine (a CPU tier of its own, the same Mooncake
Store) then asks for the prompt: what the first engine computed and published, it finds in the
store, promotes into its CPU tier and loads (``shared_tier_s``: computed on one engine, loaded by
another). With a disk tier, a restart too: once every way was measured, the engine stops and,
for each length, a fresh engine on the same disk path (its warm start indexes the files) asks
for that length's last prompt once, alone on an idle engine (``restart_s``, and the tokens it
found against the prompt's full chunks: ``restart_hit_tokens``, ``full_chunk_tokens``). Every
hit is loaded (``offload.take_hits: always``): the tiers are measured, not the choice. Each is
the request's TTFT as the engine measures it (from its arrival at the engine to its first
token). The fastest of the repeats is kept each way, and ``speedup`` and
``disk_speedup`` are recomputing's ratios to them. transformers' number is a forward pass over
the same number of tokens on the same weights in this process, fastest of the repeats.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from raykv.config import RaykvConfig, load_config


class TTFTEngine(Protocol):
    """An engine that answers one request at a time (the local one, or the Ray deployment)."""

    def first_token(self, req_id: str, prompt: list[int]) -> tuple[float, int]:
        """Run ``prompt`` alone to its first token once every earlier transfer has landed;
        its TTFT in seconds and the prompt tokens it found in the CPU tier."""
        ...

    def empty_gpu_cache(self) -> None: ...

    def spill_to_disk(self) -> None:
        """Move the CPU tier's chunks to the disk tier, once every transfer has landed."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class TTFTResult:
    prompt_tokens: int
    recompute_s: float
    cpu_tier_s: float
    speedup: float
    transformers_s: float | None
    cpu_hit_tokens: int  # of the CPU-tier run (the fastest repeat's)
    disk_tier_s: float | None = None  # None: no disk tier
    disk_speedup: float | None = None
    disk_hit_tokens: int = 0  # of the disk-tier run (the fastest repeat's)
    shared_tier_s: float | None = None  # None: no shared tier
    shared_speedup: float | None = None
    shared_hit_tokens: int = 0  # of the other engine's run (the fastest repeat's)
    restart_s: float | None = None  # None: no disk tier
    restart_speedup: float | None = None
    restart_hit_tokens: int = 0  # what the fresh engine found in the tiers
    full_chunk_tokens: int = 0  # the prompt's tokens in full chunks: all a tier can hold


@dataclass(slots=True)
class TTFTReport:
    model: str
    device: str
    engine: str
    tensor_parallel_size: int
    results: list[TTFTResult] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LocalTTFTEngine:
    """The one-process engine, the CPU tier on."""

    def __init__(self, cfg: RaykvConfig) -> None:
        from raykv.engine.core import EngineCore
        from raykv.engine.workers import LocalWorkerGroup

        self._workers = LocalWorkerGroup(cfg, cfg.cpu_slots())
        self.engine = EngineCore(cfg, self._workers, keep_finished=False)

    def first_token(self, req_id: str, prompt: list[int]) -> tuple[float, int]:
        from raykv.core.request import Request

        engine = self.engine
        while engine.has_work():  # the previous request's stores land first
            engine.step()
        req = Request(req_id, engine.totals.finished, prompt, 1)
        engine.add_request(req)
        while not req.finished:
            engine.step()
        record = engine.latency.requests[-1]
        assert record.req_id == req_id
        return (
            record.ttft_s,
            record.cpu_hit_tokens + record.disk_hit_tokens + record.shared_hit_tokens,
        )

    def empty_gpu_cache(self) -> None:
        while self.engine.has_work():
            self.engine.step()
        self.engine.reset_prefix_cache()

    def spill_to_disk(self) -> None:
        while self.engine.has_work():
            self.engine.step()
        self.engine.spill_to_disk()

    def close(self) -> None:
        self._workers.shutdown()


def bench_config(cfg: RaykvConfig, lengths: list[int]) -> RaykvConfig:
    """``cfg`` with room for the longest prompt: on the GPU (it and a spare), in one step's
    batch (the prefill in one chunk, as transformers computes it), and in the CPU tier."""
    longest = max(lengths)
    blocks = longest // cfg.cache.block_size + 4
    cache = cfg.cache.model_copy(
        update={"num_gpu_blocks": max(cfg.cache.num_gpu_blocks, 2 * blocks)}
    )
    engine = cfg.engine.model_copy(
        update={"max_num_batched_tokens": max(cfg.engine.max_num_batched_tokens, longest)}
    )
    # the tiers are measured, not the scheduler's choice of them
    offload = cfg.offload.model_copy(update={"enabled": True, "take_hits": "always"})
    return cfg.model_copy(update={"cache": cache, "engine": engine, "offload": offload})


def with_disk_tier(cfg: RaykvConfig, path: str, lengths: list[int], repeat: int) -> RaykvConfig:
    """``cfg`` with a disk tier at ``path`` large enough for every prompt the bench sends."""
    from raykv.engine.disk_tier import file_bytes

    tokens_per_chunk = cfg.cache.block_size * cfg.offload.blocks_per_chunk
    chunks = sum(-(-n // tokens_per_chunk) for n in lengths) * (repeat + 1) + 16
    per_chunk = file_bytes(cfg) * cfg.parallel.tensor_parallel_size * len(cfg.cache.groups)
    tree = cfg.model_dump(mode="json")
    tree["offload"]["disk"].update(enabled=True, path=path, capacity=chunks * per_chunk)
    return load_config(tree)  # checked: a path that cannot hold files is refused by name


def with_shared_tier(
    cfg: RaykvConfig, master: str, secret_file: str, lengths: list[int], repeat: int
) -> RaykvConfig:
    """``cfg`` with a shared tier on the store at ``master`` (its parts sealed with the secret
    in ``secret_file``), its segment large enough for every prompt the bench sends."""
    from raykv.engine.shared_tier import object_bytes

    tokens_per_chunk = cfg.cache.block_size * cfg.offload.blocks_per_chunk
    chunks = sum(-(-n // tokens_per_chunk) for n in lengths) * (repeat + 1) + 16
    segment = chunks * object_bytes(cfg) * len(cfg.cache.groups) * 2 + (64 << 20)
    tree = cfg.model_dump(mode="json")
    tree["offload"]["shared"].update(
        enabled=True, master=master, segment=segment, secret_file=secret_file
    )
    return load_config(tree)


def run_ttft_bench(
    cfg: RaykvConfig,
    engine: TTFTEngine,
    lengths: list[int],
    repeat: int,
    reference: Callable[[list[int]], float] | None,
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
    reader: TTFTEngine | None = None,
    asked: dict[int, list[int]] | None = None,
) -> list[TTFTResult]:
    """Every way for every length (see the module's docstring); ``reference`` times
    transformers' forward pass over a prompt (None: not measured); ``reader``: the second
    engine on the same shared tier (None: no shared tier); ``asked``: filled with each
    length's last prompt (for ``measure_restarts``)."""
    rng = random.Random(seed)
    vocab = cfg.model.vocab_size
    results = []
    # a first request pays for lazy initialisation (threads, allocator) outside the numbers
    engine.first_token("warm-up", [rng.randrange(vocab) for _ in range(16)])
    if reader is not None:
        reader.first_token("warm-up", [rng.randrange(vocab) for _ in range(16)])
    disk = cfg.offload.disk.enabled
    for n in lengths:
        best_recompute = best_loaded = best_reference = best_disk = best_shared = float("inf")
        hits = disk_hits = shared_hits = 0
        for r in range(repeat):
            prompt = [rng.randrange(vocab) for _ in range(n)]
            if progress is not None:
                progress(f"{n} tokens, repeat {r + 1}/{repeat}")
            recompute, _ = engine.first_token(f"recompute-{n}-{r}", prompt)
            engine.empty_gpu_cache()
            loaded, found = engine.first_token(f"cpu-tier-{n}-{r}", prompt)
            if found == 0:
                raise RuntimeError(
                    f"{n} tokens: the second run found nothing in the CPU tier (is the tier "
                    "large enough for the prompt?)"
                )
            best_recompute = min(best_recompute, recompute)
            if loaded < best_loaded:
                best_loaded, hits = loaded, found
            if disk:
                engine.spill_to_disk()
                engine.empty_gpu_cache()
                from_disk, found = engine.first_token(f"disk-tier-{n}-{r}", prompt)
                if found == 0:
                    raise RuntimeError(f"{n} tokens: the third run found nothing in the disk tier")
                if from_disk < best_disk:
                    best_disk, disk_hits = from_disk, found
            if reader is not None:
                engine.empty_gpu_cache()  # every publish of the first engine has landed
                shared, found = reader.first_token(f"shared-tier-{n}-{r}", prompt)
                if found == 0:
                    raise RuntimeError(f"{n} tokens: the other engine found nothing in the store")
                if shared < best_shared:
                    best_shared, shared_hits = shared, found
            if reference is not None:
                best_reference = min(best_reference, reference(prompt))
            if asked is not None:
                asked[n] = prompt
        results.append(
            TTFTResult(
                n,
                best_recompute,
                best_loaded,
                best_recompute / best_loaded,
                best_reference if reference is not None else None,
                hits,
                best_disk if disk else None,
                best_recompute / best_disk if disk else None,
                disk_hits,
                best_shared if reader is not None else None,
                best_recompute / best_shared if reader is not None else None,
                shared_hits,
            )
        )
    return results


def measure_restarts(
    cfg: RaykvConfig,
    results: list[TTFTResult],
    prompts: dict[int, list[int]],
    start_engine: Callable[[], TTFTEngine],
    progress: Callable[[str], None] | None = None,
    seed: int = 1,
) -> None:
    """For each result, a fresh engine (``start_engine``, on the disk path of the engine that
    stored its prompt, which has stopped) asks for its prompt once: ``restart_s`` and what it
    found, into the result. Its first request, a short prompt of its own, pays for lazy
    initialisation as the other ways' warm-up does."""
    rng = random.Random(seed)
    tokens_per_chunk = cfg.cache.block_size * cfg.offload.blocks_per_chunk
    for result in results:
        n = result.prompt_tokens
        if progress is not None:
            progress(f"{n} tokens, a fresh engine on the disk path")
        engine = start_engine()
        try:
            engine.first_token("warm-up", [rng.randrange(cfg.model.vocab_size) for _ in range(16)])
            seconds, found = engine.first_token(f"restart-{n}", prompts[n])
        finally:
            engine.close()
        result.restart_s = seconds
        result.restart_speedup = result.recompute_s / seconds
        result.restart_hit_tokens = found
        result.full_chunk_tokens = (n - 1) // tokens_per_chunk * tokens_per_chunk


def transformers_model(path: Path, dtype: str, device: str = "cpu") -> Any:
    """transformers' own model on the checkpoint (a Hugging Face directory or a GGUF file):
    the reference a user would pick instead of raykv."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype
        )
    return model.to(device).eval()


def transformers_forward(path: Path, dtype: str, device: str) -> Callable[[list[int]], float]:
    """transformers' forward pass over a prompt on the checkpoint's weights: seconds."""
    import torch

    model = transformers_model(path, dtype, device)

    def forward(prompt: list[int]) -> float:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

    return forward


def plot_ttft(report: TTFTReport, path: str) -> None:
    """TTFT against prompt length, both ways (and transformers'), as a PNG line chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r.prompt_tokens for r in report.results]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    series = [
        ("recompute_s", "recomputed", "o-"),
        ("cpu_tier_s", "from the CPU tier", "o-"),
        ("disk_tier_s", "from disk", "o-"),
        ("restart_s", "after a restart (a fresh engine, from disk)", "o-"),
        ("shared_tier_s", "from the shared tier (another engine's)", "o-"),
        ("transformers_s", "transformers forward", "s--"),
    ]
    for name, label, style in series:
        values = [getattr(r, name) for r in report.results]
        if all(v is not None for v in values):  # a way not measured is not drawn
            axes.plot(lengths, values, style, label=label)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("time to first token (s)")
    axes.set_yscale("log")
    axes.set_title(
        f"{report.model} on {report.device} ({report.engine}, TP {report.tensor_parallel_size})"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def format_ttft_table(report: TTFTReport) -> str:
    lines = [
        f"raykv bench ttft: {report.model} on {report.device}, {report.engine} engine, "
        f"TP {report.tensor_parallel_size} (fastest of the repeats)",
        f"{'tokens':>7} {'recompute_s':>12} {'cpu_tier_s':>11} {'speedup':>8} "
        f"{'disk_tier_s':>12} {'speedup':>8} {'shared_tier_s':>14} {'speedup':>8} "
        f"{'restart_s':>10} {'speedup':>8} {'hit/full':>11} "
        f"{'transformers_s':>15} {'recompute/transformers':>23}",
    ]
    for r in report.results:
        ref = f"{r.transformers_s:>15.3f}" if r.transformers_s is not None else f"{'-':>15}"
        ratio = f"{r.recompute_s / r.transformers_s:>23.2f}" if r.transformers_s else f"{'-':>23}"
        disk = f"{'-':>12} {'-':>8}"
        if r.disk_tier_s is not None and r.disk_speedup is not None:
            disk = f"{r.disk_tier_s:>12.4f} {r.disk_speedup:>8.1f}"
        shared = f"{'-':>14} {'-':>8}"
        if r.shared_tier_s is not None and r.shared_speedup is not None:
            shared = f"{r.shared_tier_s:>14.4f} {r.shared_speedup:>8.1f}"
        restart = f"{'-':>10} {'-':>8} {'-':>11}"
        if r.restart_s is not None and r.restart_speedup is not None:
            hits = f"{r.restart_hit_tokens}/{r.full_chunk_tokens}"
            restart = f"{r.restart_s:>10.4f} {r.restart_speedup:>8.1f} {hits:>11}"
        lines.append(
            f"{r.prompt_tokens:>7} {r.recompute_s:>12.3f} {r.cpu_tier_s:>11.4f} "
            f"{r.speedup:>8.1f} {disk} {shared} {restart} {ref} {ratio}"
        )
    return "\n".join(lines)

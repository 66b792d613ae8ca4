"""``raykv bench transfer``: transfer-engine bandwidth against one large copy of the same bytes.

For each page size it builds a KV tensor and a pool of ``blocks`` pages, times one job of all the
blocks through the transfer engine of the device (:class:`~raykv.transfer.cpu.CpuTransferEngine`, or
:class:`~raykv.transfer.cuda.CudaTransferEngine` with the KV on the GPU and a pinned pool; submit +
flush, best of ``repeat``) and the same number of bytes moved by a single ``dst.copy_(src)``
between the same two tensors (the copy limit of this machine, measured in the same run).
``ratio`` is the engine's share of it. For ``both`` the baseline copies the two halves one after
the other, so its ratio is how much running stores and loads together gains over one direction.

Directions: ``store`` (kv -> pool), ``load`` (pool -> kv), ``both`` (a store over one half of the
blocks and a load over the other half, submitted together; the baseline copies the two halves
back to back).

Patterns: ``random`` (GPU block ids a seeded random permutation, slots consecutive, as a scattered
GPU cache against a freshly allocated CPU range) or ``contiguous`` (both sides consecutive).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from raykv.core.step import BlockCopy, TransferSpec
from raykv.transfer.cpu import CpuTransferEngine
from raykv.transfer.cuda import CudaTransferEngine
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool

DIRECTIONS = ("store", "load", "both")
PATTERNS = ("random", "contiguous")
# kv + pool of one page size stay under this unless the caller raises it, so a bench run of large
# pages does not take GiBs (the block count shrinks instead; each result reports the count used)
DEFAULT_MAX_BYTES = 512 * 2**20
_SEED = 20240601


def bench_layout(page_kib: int, blocks: int) -> KVLayout:
    """A float16 layout whose page is exactly ``page_kib`` KiB, with ``blocks`` GPU blocks and
    as many one-block slots."""
    if page_kib <= 0:
        raise ValueError(f"page_kib must be positive, got {page_kib}")
    elems = page_kib * 1024 // 2
    # a plausible shape (16-token blocks, 128-dim heads) when the size allows; else one long row
    if elems % (2 * 16 * 128) == 0:
        layers, block_size, head_dim = elems // (2 * 16 * 128), 16, 128
    else:
        layers, block_size, head_dim = 1, 1, elems // 2
    return KVLayout(
        num_gpu_blocks=blocks,
        block_size=block_size,
        num_groups=1,
        layers_per_group=layers,
        kv_heads=1,
        head_dim=head_dim,
        dtype="float16",
        blocks_per_chunk=1,
        num_slots=blocks,
    )


def best_pair(
    first: Callable[[], None],
    second: Callable[[], None],
    repeat: int,
    before: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """Best times of two functions, run alternately after one untimed round of each: the machine's
    bandwidth drifts by tens of percent from second to second, and alternating exposes both to the
    same drift. ``before(i)``, untimed, runs ahead of every run of function ``i`` (0: first, 1:
    second), the untimed ones too: what each run needs to start from the same state (the disk
    bench deletes the files the last write made, or drops them from the page cache)."""
    functions = (first, second)
    best = [float("inf"), float("inf")]
    for round_ in range(repeat + 1):
        for i, fn in enumerate(functions):
            if before is not None:
                before(i)
            start = time.perf_counter()
            fn()
            if round_ > 0:  # round 0 warms up (imports, allocations, first faults)
                best[i] = min(best[i], time.perf_counter() - start)
    return max(best[0], 1e-9), max(best[1], 1e-9)


def _bench_page(
    page_kib: int,
    blocks: int,
    directions: list[str],
    pattern: str,
    repeat: int,
    device: str,
    pieces: int = 1,
) -> list[dict[str, float | int | str]]:
    layout = bench_layout(page_kib, blocks)
    cuda = device == "cuda"
    pool = allocate_pool(layout, pin=cuda, zero=True)
    cache: torch.Tensor | list[torch.Tensor]
    if pieces == 1:
        kv = allocate_kv(layout, device)  # zero-filled: touched
        kv.fill_(1.0)
        cache = kv
    else:
        # vLLM's canonical views: a byte view per layer, the layers adjacent in one allocation
        width = layout.page_bytes // pieces
        kv = torch.ones((pieces, blocks, width), dtype=torch.uint8, device=device)
        cache = list(kv.unbind(0))
    flat_kv, flat_pool = kv.view(torch.uint8).view(-1), pool.view(torch.uint8).view(-1)

    gpu = list(range(blocks))
    if pattern == "random":
        random.Random(_SEED + page_kib).shuffle(gpu)
    slots = list(range(blocks))
    half = blocks // 2
    job_ids = iter(range(1, 1 << 30))

    def spec(is_store: bool, lo: int, hi: int) -> TransferSpec:
        copy = BlockCopy(gpu[lo:hi], slots[lo:hi], [0] * (hi - lo))
        return TransferSpec(job_id=next(job_ids), is_store=is_store, copy=copy)

    # (is_store, first, end) per job, and the (dst, src) flat ranges the baseline copies
    jobs_of = {
        "store": [(True, 0, blocks)],
        "load": [(False, 0, blocks)],
        "both": [(True, 0, half), (False, half, blocks)],
    }
    split = half * layout.page_bytes
    copies_of = {
        "store": [(flat_pool, flat_kv)],
        "load": [(flat_kv, flat_pool)],
        "both": [(flat_pool[:split], flat_kv[:split]), (flat_kv[split:], flat_pool[split:])],
    }

    results: list[dict[str, float | int | str]] = []
    engine_cls = CudaTransferEngine if cuda else CpuTransferEngine
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with engine_cls(cache, pool, layout) as engine:
        for direction in directions:
            jobs = jobs_of[direction]
            copies = copies_of[direction]

            def run_engine(jobs: list[tuple[bool, int, int]] = jobs) -> None:
                built = [spec(*job) for job in jobs]
                for s in built:
                    engine.submit(s)
                engine.flush([s.job_id for s in built])

            def baseline(copies: list[tuple[torch.Tensor, torch.Tensor]] = copies) -> None:
                for dst, src in copies:
                    dst.copy_(src, non_blocking=cuda)
                sync()

            moved = sum(end - first for _, first, end in jobs)
            total = moved * layout.page_bytes
            engine_s, base_s = best_pair(run_engine, baseline, repeat)
            engine.poll()
            gbps = total / engine_s / 1e9
            base = total / base_s / 1e9
            results.append(
                {
                    "page_kib": page_kib,
                    "pieces": pieces,
                    "direction": direction,
                    "blocks": blocks,
                    "bytes": total,
                    "gbps": gbps,
                    "baseline_gbps": base,
                    "ratio": gbps / base,
                }
            )
    return results


def run_transfer_bench(
    device: str,
    page_kib: list[int],
    blocks: int,
    directions: list[str],
    pattern: str = "random",
    repeat: int = 3,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    pieces: int = 1,
) -> dict[str, object]:
    """Measure transfer bandwidth per page size and direction against one large ``copy_``.

    Returns ``{"device", "pattern", "pieces", "results": [{"page_kib", "pieces", "direction",
    "blocks", "bytes", "gbps", "baseline_gbps", "ratio"}, ...]}`` (GB = 10^9 bytes). ``blocks``
    is capped per page size so kv + pool stay within ``max_bytes`` (None: no cap), but never
    below 2. ``pieces`` > 1: a page is that many equal byte views of as many layers, as vLLM's
    canonical views give raykv inside vLLM (the engine the worker copies with); the baseline
    still copies the same bytes in one ``copy_``.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"CUDA is not available to torch {torch.__version__} here")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    for direction in directions:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if blocks < 2:
        raise ValueError(f"blocks must be >= 2, got {blocks}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    for kib in page_kib:
        if kib * 1024 % pieces:
            raise ValueError(f"a page of {kib} KiB does not split into {pieces} equal pieces")

    results: list[dict[str, float | int | str]] = []
    for kib in page_kib:
        n = blocks
        if max_bytes is not None:
            n = max(2, min(blocks, max_bytes // (2 * kib * 1024)))
        results.extend(_bench_page(kib, n, directions, pattern, repeat, device, pieces))
    return {"device": device, "pattern": pattern, "pieces": pieces, "results": results}


def format_transfer_table(result: dict[str, object]) -> str:
    """The bench result as a plain-text table."""
    header = (
        f"{'page KiB':>9} {'direction':>9} {'blocks':>7} {'GB/s':>8} {'copy_ GB/s':>10} "
        f"{'ratio':>6}"
    )
    pieces = int(result.get("pieces", 1))  # type: ignore[call-overload]
    split = f", pages in {pieces} pieces (vLLM's per-layer views)" if pieces > 1 else ""
    lines = [
        f"transfer bench on {result['device']} ({result.get('pattern', '?')} pattern{split})",
        header,
    ]
    rows = result["results"]
    assert isinstance(rows, list)
    for row in rows:
        lines.append(
            f"{row['page_kib']:>9} {row['direction']:>9} {row['blocks']:>7} "
            f"{row['gbps']:>8.2f} {row['baseline_gbps']:>10.2f} {row['ratio']:>6.2f}"
        )
    return "\n".join(lines)

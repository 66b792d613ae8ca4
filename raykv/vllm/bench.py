"""``raykv bench vllm``: time to first token of one prompt through vLLM, recomputed against
loaded from each of raykv's tiers, beside the copy limit of the same bytes; and vLLM's
throughput with no reuse, without raykv's spec, with its CPU and disk tiers, and with all three.

The TTFT rows run in this process, one vLLM engine at a time (vLLM's connector is global to a
process), on the same model and settings, with vLLM's prefix cache on as vLLM runs by default:

1. **vLLM alone.** Each prompt (random token ids, ``max_tokens`` 1) is computed from scratch
   (``recompute_s``), the prefix cache emptied after it.
2. **vLLM with raykv (the writer):** its CPU tier, a disk tier and the shared tier on a
   Mooncake master the bench runs on loopback (its pool's memory given by a process of the
   bench's, so it outlives the engines, and made resident before any engine runs, as their CPU
   pools are). Each prompt is run once (its KV stored, written
   through to the disk and published), its stores waited for, vLLM's prefix cache emptied,
   and run again: raykv's CPU tier is the only place its KV is (``cpu_tier_s``).
3. **A second vLLM with raykv on the same disk path:** its CPU tier empty, the files' pages out
   of the page cache; each prompt's KV is read from its files, promoted into the CPU tier and
   loaded (``disk_tier_s``: cold).
4. **A third vLLM with raykv on the same store** (no disk tier), its CPU tier empty: each
   prompt's KV is what the writer published, read from the store, promoted and loaded
   (``shared_tier_s``: computed by one engine, loaded by another).

With ``--slow-disk-ms N``, a warm restart from a slow disk: a fourth vLLM with raykv on the
writer's disk path, its disk ``N`` ms a load (``slow-disk:ms=N``) and the worth-it choice on
(``take_hits: faster``), asks for every prompt of the TTFT rows once, one after the other, each
against vLLM alone's recompute of its length (``SlowDiskRestart``): a disk slower than
recomputing must be passed over within a few requests.

The throughput rows come last, measured in pairs (``paired.py``): vLLM alone, with raykv's CPU
and disk tiers (``with``) and with all three (``with_shared``: every full block stored, written
to the disk and put into the store, whose pool's process receives every put over TCP on the
same cores; the CPU it spends is reported beside), each an engine in a process of its own,
their batches taken in turns.

The copy limit of a prompt's KV bytes (what a tier load moves) is measured in the same run:
``limit_s`` one ``memcpy`` of them (the CPU tier's floor), ``disk_limit_s`` one cold sequential
read of them from a file on the disk tier's path (``O_DIRECT`` where allowed) plus that
``memcpy``, ``shared_limit_s`` one read of them from the store as a single object (the
transport's floor: TCP on loopback here) plus that ``memcpy``. ``cpu_load_s``, ``disk_load_s``
and ``shared_load_s`` are the tier's own load jobs, from vLLM's submit to the step that found
them done. The fastest of the repeats is kept each way.

Only whole blocks are offloaded: a prompt's tail after its last whole block, and at least its
last token, is computed in every loaded run (``--block-tokens`` sets vLLM's block size).
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from raykv.bench.disk_transfer import PlainFile, settle_files
from raykv.config.shared import SECRET_ENV
from raykv.transfer.disk_files import align_up, probe_direct_io
from raykv.transfer.seal import new_secret
from raykv.transfer.segment_process import HeldSegment
from raykv.transfer.shared_master import EmbeddedMaster
from raykv.transfer.shared_store import (
    LOCAL_BUFFER,
    SharedStoreError,
    StoreEndpoint,
    connect,
    mooncake_problem,
)
from raykv.vllm.local import local_engine, manager_of, stores_landed, worker_of
from raykv.vllm.paired import Contender, paired_throughput

Progress = Callable[[str], None]


class VllmBenchError(RuntimeError):
    """A run that could not measure what it was asked to (nothing loaded, stores not landed)."""


@dataclass(slots=True)
class VllmBenchOptions:
    """What one ``raykv bench vllm`` run measures."""

    model: str  # a Hugging Face directory
    prompt_tokens: list[int]
    repeat: int = 3
    block_tokens: int = 32
    dtype: str = "float32"
    disk_path: str | None = None  # None: a fresh directory under the system's temporary one
    throughput_requests: int = 8  # 0: no throughput rows
    throughput_prompt_tokens: int = 512
    throughput_output_tokens: int = 32
    throughput_rounds: int = 5  # batches each contender runs, in turns (``paired.py``)
    kv_cache_bytes: int = 1 << 30
    seed: int = 0
    enforce_eager: bool = False  # no torch.compile: engines start sooner, steps run slower
    slow_disk_ms: int = 0  # > 0: the warm restart from a disk this slow a load, too


@dataclass(slots=True)
class VllmTTFTRow:
    """One prompt length: each way's fastest TTFT, and the copy limit of its KV bytes."""

    prompt_tokens: int
    recompute_s: float
    cpu_tier_s: float
    disk_tier_s: float | None
    shared_tier_s: float | None
    limit_s: float
    disk_limit_s: float | None
    shared_limit_s: float | None
    cpu_load_s: float
    disk_load_s: float | None
    shared_load_s: float | None
    kv_bytes: int
    cpu_hit_tokens: int
    disk_hit_tokens: int
    shared_hit_tokens: int
    cpu_speedup: float
    disk_speedup: float | None
    shared_speedup: float | None


@dataclass(slots=True)
class VllmThroughput:
    """vLLM's tokens per second (prompt and output) on prompts that share nothing."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    rounds: int
    without_tokens_per_s: float  # the median round's
    with_tokens_per_s: float  # raykv's CPU and disk tiers
    ratio: float  # the median of the rounds' (vLLM alone's time over the spec's)
    ratios: list[float] = field(default_factory=list)  # each round's
    with_shared_tokens_per_s: float | None = None  # CPU, disk and shared tiers
    shared_ratio: float | None = None
    shared_ratios: list[float] | None = None
    shared_pool_cpu_s: float | None = None  # the store's pool process, in those batches


@dataclass(slots=True)
class SlowDiskRequest:
    """One request of the slow-disk restart, in the order asked."""

    prompt_tokens: int
    ttft_s: float
    loaded_tokens: int  # from raykv's tiers (0: recomputed)
    ratio: float  # to vLLM alone's recompute of its length (the median of its repeats)


@dataclass(slots=True)
class SlowDiskRestart:
    """A warm restart whose disk takes ``disk_ms`` a load, with the worth-it choice on."""

    disk_ms: int
    requests: list[SlowDiskRequest]
    within_1_2x_from: int | None  # the first request from which every ratio is at most 1.2
    skipped_slower: int  # disk hits passed over as slower than recomputing
    recompute_probes: int  # requests recomputed to price the prefill


@dataclass(slots=True)
class VllmBenchReport:
    model: str
    vllm_version: str
    dtype: str
    block_tokens: int
    threads: int
    disk_io: str
    repeat: int
    rows: list[VllmTTFTRow] = field(default_factory=list)
    throughput: VllmThroughput | None = None
    shared_transport: str = "tcp on loopback"
    slow_disk_restart: SlowDiskRestart | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def platform_block_size_problem(block_tokens: int) -> str | None:
    """Why this platform's vLLM cannot run blocks of ``block_tokens`` tokens, or None."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and block_tokens % 32:
        return "vLLM's CPU attention takes multiples of 32"
    return None


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """A token's KV bytes on one rank, from the model's ``config.json``."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * size


def memcpy_s(nbytes: int, repeat: int = 5) -> float:
    """The fastest of ``repeat`` copies of ``nbytes`` between two tensors in memory."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # both touched: no page faults in the timings
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def cold_read_s(directory: str, nbytes: int, repeat: int = 3) -> tuple[float, str]:
    """The fastest of ``repeat`` cold sequential reads of ``nbytes`` from one file in
    ``directory`` (``O_DIRECT`` where the file system allows, else its pages dropped first),
    and which of the two it was."""
    direct = probe_direct_io(directory)
    memory = mmap.mmap(-1, align_up(nbytes))
    plain = PlainFile(
        os.path.join(directory, f".raykv-bench-limit-{os.getpid()}"), memory, nbytes, direct
    )
    best = float("inf")
    try:
        plain.write(sync=True)
        for _ in range(repeat):
            settle_files([plain.path], drop=not direct)
            start = time.perf_counter()
            plain.read()
            best = min(best, time.perf_counter() - start)
    finally:
        plain.remove()  # the mapping goes with the file's views of it
    return best, "direct" if direct else "buffered, dropped"


def store_read_s(master: str, nbytes: int, repeat: int = 3) -> float:
    """The fastest of ``repeat`` reads of ``nbytes`` as one object from the store at
    ``master`` (put once by this process, removed after)."""
    client = connect(StoreEndpoint(master), 0, LOCAL_BUFFER)
    buffers = [mmap.mmap(-1, nbytes) for _ in range(2)]
    pointers = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in buffers]
    name = f"raykv-bench-limit/{os.getpid()}"
    best = float("inf")
    try:
        for pointer in pointers:
            if client.register_buffer(pointer, nbytes) != 0:
                raise VllmBenchError("the store refused the bench's buffer for its limit")
        if client.put_from(name, pointers[0], nbytes) != 0:
            raise VllmBenchError("the store refused the bench's object for its limit")
        for _ in range(repeat):
            start = time.perf_counter()
            got = client.get_into(name, pointers[1], nbytes)
            seconds = time.perf_counter() - start
            if got != nbytes:
                raise VllmBenchError("the store did not give back the bench's object")
            best = min(best, seconds)
        client.remove(name, True)
    finally:
        for pointer in pointers:
            client.unregister_buffer(pointer)
        client.close()
        for buffer in buffers:
            buffer.close()
    return best


class _Prompts:
    """Random token ids: the same ones for every engine of a run."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab

    def make(self, name: str, tokens: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{name}")
        return [rng.randrange(self.vocab) for _ in range(tokens)]


def _first_token(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """The prompt's TTFT alone (its one token's whole request) and the tokens vLLM did not
    compute."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=1)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens or 0


def _drain(llm: Any, prompts: _Prompts) -> None:
    """Step the engine until no store of raykv's is in flight (``local.stores_landed``)."""
    if not stores_landed(llm, lambda i: prompts.make(f"drain-{i}", 1), pause_s=0.002):
        raise VllmBenchError("raykv's stores did not land within the bench's wait")


def _last_load(llm: Any) -> Any:
    records = [r for r in worker_of(llm).records if not r.is_store]
    if not records or not records[-1].ok:
        raise VllmBenchError("the loaded run's load job did not finish well")
    return records[-1]


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


Timed = tuple[float, int, float]  # a loaded run's TTFT, tokens loaded, its load job's time


class _Run:
    """The three engines of one bench run, each in a call of its own."""

    def __init__(
        self,
        options: VllmBenchOptions,
        prompts: _Prompts,
        engine_args: dict[str, Any],
        tiers: dict[str, dict[str, Any]],
        extra: dict[str, Any],
        say: Progress,
    ) -> None:
        """``tiers``: raykv's settings of the writer (``all``), the disk reader (``disk``) and
        the store's reader (``shared``)."""
        self.options, self.prompts, self.engine_args = options, prompts, engine_args
        self.tiers, self.extra, self.say = tiers, extra, say

    def throughput_batch(self, contender: str, round_index: int) -> list[list[int]]:
        """One round's batch of the throughput workload for a contender: prompts no other
        batch, and no engine of the TTFT rows, has."""
        options = self.options
        return [
            self.prompts.make(
                f"throughput-{contender}-{round_index}-{i}", options.throughput_prompt_tokens
            )
            for i in range(options.throughput_requests)
        ]

    def alone(self) -> dict[int, float]:
        """vLLM without raykv: each length's fastest recompute (each one's in ``recomputes``)."""
        options, prompts = self.options, self.prompts
        recompute: dict[int, float] = {}
        self.recomputes: dict[int, list[float]] = {}
        self.say("vLLM alone")
        with local_engine(options.model, None, **self.engine_args) as llm:
            _first_token(llm, prompts.make("warm-up", 64))
            for n in options.prompt_tokens:
                for r in range(options.repeat):
                    self.say(f"vLLM alone: {n} tokens, repeat {r + 1}/{options.repeat}")
                    seconds, _ = _first_token(llm, prompts.make(f"ttft-{n}-{r}", n))
                    recompute[n] = min(recompute.get(n, float("inf")), seconds)
                    self.recomputes.setdefault(n, []).append(seconds)
                    llm.reset_prefix_cache()
            return recompute

    def writer(self) -> tuple[dict[int, Timed], int]:
        """vLLM with raykv: each length loaded from the CPU tier; a block's page bytes."""
        options, prompts = self.options, self.prompts
        cpu: dict[int, Timed] = {}
        self.say("vLLM with raykv")
        with local_engine(options.model, self.tiers["all"], self.extra, **self.engine_args) as llm:
            _first_token(llm, prompts.make("warm-up", 64))
            for n in options.prompt_tokens:
                for r in range(options.repeat):
                    self.say(f"vLLM with raykv: {n} tokens, repeat {r + 1}/{options.repeat}")
                    tokens = prompts.make(f"ttft-{n}-{r}", n)
                    _first_token(llm, tokens)  # stores it
                    _drain(llm, prompts)
                    if not llm.reset_prefix_cache():
                        raise VllmBenchError("vLLM did not empty its prefix cache")
                    seconds, hit = _first_token(llm, tokens)
                    if hit == 0:
                        raise VllmBenchError(
                            f"{n} tokens: nothing was loaded from raykv's CPU tier"
                        )
                    load = _last_load(llm)
                    if n not in cpu or seconds < cpu[n][0]:
                        cpu[n] = (seconds, hit, load.seconds)
            _drain(llm, prompts)
            return cpu, worker_of(llm).page_bytes

    def reader(self, tier: str) -> dict[int, Timed]:
        """A second vLLM with raykv on the writer's disk tier or store (``tier``), its CPU
        tier empty: each length loaded from there."""
        options, prompts = self.options, self.prompts
        found: dict[int, Timed] = {}
        where = "disk tier" if tier == "disk" else "shared tier's store"
        self.say(f"another vLLM on the same {where}")
        with local_engine(options.model, self.tiers[tier], self.extra, **self.engine_args) as llm:
            _first_token(llm, prompts.make("warm-up", 64))  # the writer's: loaded as well
            for n in options.prompt_tokens:
                for r in range(options.repeat):
                    self.say(f"another vLLM: {n} tokens from the {where}, {r + 1}/{options.repeat}")
                    seconds, hit = _first_token(llm, prompts.make(f"ttft-{n}-{r}", n))
                    if hit == 0:
                        raise VllmBenchError(f"{n} tokens: nothing was loaded from the {where}")
                    load = _last_load(llm)
                    if load.promoted == 0:
                        raise VllmBenchError(f"{n} tokens: the load read nothing from the {where}")
                    if n not in found or seconds < found[n][0]:
                        found[n] = (seconds, hit, load.seconds)
            return found

    def slow_restart(self) -> SlowDiskRestart:
        """A fresh vLLM on the writer's disk path, its disk slow and the choice on: every prompt
        of the TTFT rows once, in turn, against vLLM alone's recompute of its length (the
        median of its repeats: one request against a typical one, not the fastest)."""
        recompute = {n: statistics.median(s) for n, s in self.recomputes.items()}
        options, prompts = self.options, self.prompts
        ms = options.slow_disk_ms
        settings = {**self.tiers["disk"], "take_hits": "faster"}
        extra = {**self.extra, "raykv_faults": [f"slow-disk:ms={ms}"]}
        asked: list[SlowDiskRequest] = []
        self.say(f"a warm restart from a disk at {ms} ms a load")
        with local_engine(options.model, settings, extra, **self.engine_args) as llm:
            _first_token(llm, prompts.make("warm-up-slow", 64))
            for r in range(options.repeat):
                for n in options.prompt_tokens:
                    self.say(f"slow disk: {n} tokens, request {len(asked) + 1}")
                    seconds, hit = _first_token(llm, prompts.make(f"ttft-{n}-{r}", n))
                    asked.append(SlowDiskRequest(n, seconds, hit, seconds / recompute[n]))
            choice = manager_of(llm).choice
            skipped = choice.skipped["disk"] if choice is not None else 0
            probes = choice.recompute_probes if choice is not None else 0
        settled = None
        for i in range(len(asked)):
            if all(request.ratio <= 1.2 for request in asked[i:]):
                settled = i + 1
                break
        return SlowDiskRestart(ms, asked, settled, skipped, probes)


WARM_OBJECT_BYTES = 64 << 20  # what the bench puts at a time to make the store's pool resident


class _Store:
    """The shared tier's store for one bench run: a Mooncake master on loopback, a process of
    the bench's giving the pool ``segment`` bytes (so the pool outlives each engine; made
    resident first), and the run's secret in this process's environment (where the engines
    read it)."""

    def __init__(self, segment: int) -> None:
        self.master = EmbeddedMaster()
        self.holder: HeldSegment | None = None
        self._secret_before = os.environ.get(SECRET_ENV)
        self.address = self.master.start()
        try:
            self.holder = HeldSegment(self.address, segment)
            self.holder.start()
        except Exception:
            self.master.stop()
            raise
        os.environ[SECRET_ENV] = new_secret().hex()
        try:
            self._warm(segment)
        except BaseException:
            self.close()
            raise

    def _warm(self, segment: int) -> None:
        """Fill the pool's segment with objects of the bench's and remove them: its memory is
        then resident before any engine puts into it, as each engine's CPU pool is before its
        rounds. A store that has run a while has its segment's pages; a fresh one pays their
        faults on its first fill (measured: the pool's process spent 0.15 s of CPU per no-reuse
        batch on a fresh segment, 0.05 s on a warm one, on the model's cores)."""
        buffer = mmap.mmap(-1, WARM_OBJECT_BYTES)
        pointer = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        client = connect(StoreEndpoint(self.address), 0, LOCAL_BUFFER)
        names: list[str] = []
        try:
            if client.register_buffer(pointer, WARM_OBJECT_BYTES) != 0:
                client.close()
                raise VllmBenchError("the store refused the bench's buffer to warm its pool")
            try:
                # short of the whole segment: the store evicts near its top
                for i in range(int(segment * 0.9) // WARM_OBJECT_BYTES):
                    name = f"raykv-bench-warm/{os.getpid()}/{i}"
                    if client.put_from(name, pointer, WARM_OBJECT_BYTES) != 0:
                        break  # what is resident by then is what the store would take
                    names.append(name)
                left = [name for name in names if client.remove(name, True) != 0]
                if left:  # they would hold the engines' room in the pool
                    raise VllmBenchError(
                        f"the store kept {len(left)} of the objects that warmed its pool"
                    )
            finally:
                client.unregister_buffer(pointer)
                client.close()
        finally:
            buffer.close()

    def pool_cpu_s(self) -> float | None:
        """The CPU seconds the pool's process has spent (None where it cannot be read)."""
        pid = self.holder.pid if self.holder is not None else None
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self._secret_before is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = self._secret_before
        if self.holder is not None:
            self.holder.stop()
        self.master.stop()


def run_vllm_bench(options: VllmBenchOptions, progress: Progress | None = None) -> VllmBenchReport:
    """Every way for every length (see the module's docstring)."""
    import vllm

    say = progress or (lambda _: None)
    lengths, repeat = options.prompt_tokens, options.repeat
    prompts = _Prompts(options.seed, _vocab(options.model))
    per_token = kv_bytes_per_token(options.model, options.dtype)
    tier_bytes = int(sum(lengths) * repeat * per_token * 1.25) + (64 << 20)
    # each throughput contender stores all of its batches (and the third puts them all into
    # the store): room for every one, so none is refused for want of it
    throughput_tokens = (
        options.throughput_rounds
        * options.throughput_requests
        * (options.throughput_prompt_tokens + options.throughput_output_tokens)
    )
    throughput_bytes = int(throughput_tokens * per_token * 1.25) + (64 << 20)
    engine_args = dict(
        dtype=options.dtype,
        kv_cache_memory_bytes=options.kv_cache_bytes,
        max_model_len=max(
            max(lengths) + 64,
            options.throughput_prompt_tokens + options.throughput_output_tokens + 64,
        ),
        block_size=options.block_tokens,
        enable_prefix_caching=True,
        seed=0,
        enforce_eager=options.enforce_eager,
    )
    own_directory = options.disk_path is None
    disk_root = options.disk_path or tempfile.mkdtemp(prefix="raykv-bench-vllm-")
    directory = tempfile.mkdtemp(prefix="run-", dir=disk_root)
    cpu = {"cpu_bytes": tier_bytes, "take_hits": "always"}  # the tiers, not the choice
    disk_tier = {"enabled": True, "path": directory, "capacity": tier_bytes}
    tiers = {"all": {**cpu, "disk": disk_tier}, "disk": {**cpu, "disk": disk_tier}}
    extra = {"block_size": options.block_tokens}  # one offloaded chunk: one vLLM block
    run = _Run(options, prompts, engine_args, tiers, extra, say)
    store: _Store | None = None
    throughput: VllmThroughput | None = None
    transport = "tcp on loopback"
    try:
        problem = mooncake_problem()
        if problem is None:
            say("the shared tier's store (a Mooncake master on loopback)")
            try:  # and room for the limit's object
                store = _Store(
                    tier_bytes + throughput_bytes + max(lengths) * per_token + (64 << 20)
                )
            except SharedStoreError as exc:
                raise VllmBenchError(f"the shared tier's store did not start: {exc}") from None
            shared_tier = {
                "enabled": True,
                "master": store.address,
                "mount": False,
                "segment": tier_bytes,
            }
            tiers["all"]["shared"] = shared_tier
            tiers["shared"] = {**cpu, "shared": shared_tier}
        else:
            transport = f"not measured ({problem})"
        # one engine a call: an engine's last reference must go before the next one starts
        # (freeing it tears down vLLM's process-wide state)
        recompute = run.alone()
        gc.collect()
        cpu, page_bytes = run.writer()
        gc.collect()
        files = [str(p) for p in Path(directory).rglob("*") if p.is_file()]
        settle_files(files, drop=True)  # cold: whatever the disk engine's I/O mode was
        disk = run.reader("disk")
        gc.collect()
        shared = run.reader("shared") if store is not None else {}
        gc.collect()
        slow = None
        if options.slow_disk_ms:
            settle_files([str(p) for p in Path(directory).rglob("*") if p.is_file()], drop=True)
            slow = run.slow_restart()
            gc.collect()
        if options.throughput_requests:
            throughput = _throughput(options, run, store, throughput_bytes, directory, say)
        say("copy limits")
        rows = []
        disk_io = ""
        for n in lengths:
            hit = cpu[n][1]
            nbytes = hit // options.block_tokens * page_bytes
            limit = memcpy_s(nbytes)
            read, disk_io = cold_read_s(directory, nbytes)
            fetched = store_read_s(store.address, nbytes) if store is not None else None
            loaded = shared.get(n)
            rows.append(
                VllmTTFTRow(
                    prompt_tokens=n,
                    recompute_s=recompute[n],
                    cpu_tier_s=cpu[n][0],
                    disk_tier_s=disk[n][0],
                    shared_tier_s=loaded[0] if loaded else None,
                    limit_s=limit,
                    disk_limit_s=read + limit,
                    shared_limit_s=None if fetched is None else fetched + limit,
                    cpu_load_s=cpu[n][2],
                    disk_load_s=disk[n][2],
                    shared_load_s=loaded[2] if loaded else None,
                    kv_bytes=nbytes,
                    cpu_hit_tokens=hit,
                    disk_hit_tokens=disk[n][1],
                    shared_hit_tokens=loaded[1] if loaded else 0,
                    cpu_speedup=recompute[n] / cpu[n][0],
                    disk_speedup=recompute[n] / disk[n][0],
                    shared_speedup=recompute[n] / loaded[0] if loaded else None,
                )
            )
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(directory, ignore_errors=True)
        if own_directory:
            shutil.rmtree(disk_root, ignore_errors=True)
    return VllmBenchReport(
        model=options.model,
        vllm_version=vllm.__version__,
        dtype=options.dtype,
        block_tokens=options.block_tokens,
        threads=torch.get_num_threads(),
        disk_io=disk_io,
        repeat=repeat,
        rows=rows,
        throughput=throughput,
        shared_transport=transport,
        slow_disk_restart=slow,
    )


ALONE, WITH, WITH_ALL = "vLLM alone", "CPU and disk tiers", "all three tiers"


def _throughput(
    options: VllmBenchOptions,
    run: _Run,
    store: _Store | None,
    tier_bytes: int,
    directory: str,
    say: Progress,
) -> VllmThroughput:
    """vLLM's throughput with no reuse: alone, with raykv's CPU and disk tiers, and with the
    shared tier too (where the store runs), measured in pairs (``paired.py``), each with raykv's
    defaults (``take_hits: faster``: its lookups pay for the choice)."""
    contenders = [Contender(ALONE, None)]
    for name, shared in ((WITH, False), (WITH_ALL, True)):
        if shared and store is None:
            continue
        path = tempfile.mkdtemp(prefix="throughput-", dir=directory)
        raykv: dict[str, Any] = {
            "cpu_bytes": tier_bytes,
            "disk": {"enabled": True, "path": path, "capacity": tier_bytes},
        }
        if shared and store is not None:
            raykv["shared"] = {
                "enabled": True,
                "master": store.address,
                "mount": False,
                "segment": tier_bytes,
            }
        contenders.append(Contender(name, raykv, {"block_size": options.block_tokens}))
    around = {WITH_ALL: store.pool_cpu_s} if store is not None else None
    rounds, grew = paired_throughput(
        options.model,
        contenders,
        run.engine_args,
        run.throughput_batch,
        options.throughput_rounds,
        options.throughput_output_tokens,
        say,
        around,
    )
    tokens = options.throughput_requests * (
        options.throughput_prompt_tokens + options.throughput_output_tokens
    )
    shared_measured = store is not None
    return VllmThroughput(
        requests=options.throughput_requests,
        prompt_tokens=options.throughput_prompt_tokens,
        output_tokens=options.throughput_output_tokens,
        rounds=options.throughput_rounds,
        without_tokens_per_s=tokens / rounds.median_s(ALONE),
        with_tokens_per_s=tokens / rounds.median_s(WITH),
        ratio=rounds.ratio(ALONE, WITH),
        ratios=rounds.ratios(ALONE, WITH),
        with_shared_tokens_per_s=tokens / rounds.median_s(WITH_ALL) if shared_measured else None,
        shared_ratio=rounds.ratio(ALONE, WITH_ALL) if shared_measured else None,
        shared_ratios=rounds.ratios(ALONE, WITH_ALL) if shared_measured else None,
        shared_pool_cpu_s=grew.get(WITH_ALL) if shared_measured else None,
    )


def format_vllm_table(report: VllmBenchReport) -> list[list[str]]:
    """The report's rows as text cells (header first), for the CLI's table."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}x"

    cells = [
        [
            "prompt tokens",
            "recompute ms",
            "CPU tier ms",
            "speedup",
            "disk tier ms",
            "speedup",
            "shared tier ms",
            "speedup",
            "CPU load / limit ms",
            "disk load / limit ms",
            "shared load / limit ms",
        ]
    ]
    for row in report.rows:
        cells.append(
            [
                f"{row.prompt_tokens:,}",
                ms(row.recompute_s),
                ms(row.cpu_tier_s),
                times(row.cpu_speedup),
                ms(row.disk_tier_s),
                times(row.disk_speedup),
                ms(row.shared_tier_s),
                times(row.shared_speedup),
                f"{ms(row.cpu_load_s)} / {ms(row.limit_s)}",
                f"{ms(row.disk_load_s)} / {ms(row.disk_limit_s)}",
                f"{ms(row.shared_load_s)} / {ms(row.shared_limit_s)}",
            ]
        )
    return cells

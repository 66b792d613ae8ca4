"""The config's sections, one pydantic model each: the model, the GPU cache, the CPU tier, the
ranks, the engine, the workload and the server."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from raykv.config.base import ByteSize, _Strict
from raykv.config.disk import DiskTierConfig, check_policy
from raykv.config.shared import SharedTierConfig


class OffloadConfig(_Strict):
    """The CPU tier."""

    enabled: bool = Field(
        default=True, description="Use the CPU tier at all (--no-offload sets it false)."
    )
    cpu_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="CPU tier size in bytes across all ranks (e.g. 8GiB); at least one chunk.",
    )
    cpu_slots: int | None = Field(
        default=None, gt=0, description="CPU tier size in chunks; exclusive with cpu_bytes."
    )
    blocks_per_chunk: int = Field(default=1, gt=0, description="GPU blocks per CPU chunk.")
    policy: str = Field(
        default="recall",
        description="Eviction policy: a registered name (lru, arc, recall) or module:Class.",
    )
    store_threshold: int = Field(
        default=0, ge=0, description="Store only chunks looked up this often (>= 2 enables)."
    )
    max_tracker_size: int = Field(
        default=64_000, gt=0, description="Keys remembered by the store_threshold filter."
    )
    events: bool = Field(
        default=True,
        description="Emit BlockStored/BlockRemoved KV events (GPU prefix cache and CPU tier).",
    )
    shared_pool: bool = Field(
        default=True,
        description="Keep each rank's CPU-pool shard in shared memory (a file in "
        "shared_pool_dir), so a rank that dies and is replaced finds the CPU tier intact; off: "
        "a rank's death empties the tier.",
    )
    shared_pool_dir: str = Field(
        default="/dev/shm",
        min_length=1,
        description="A tmpfs directory for the shared CPU-pool shards (on every node of ranks).",
    )
    copy_thread: bool | None = Field(
        default=None,
        description="CPU ranks copy in a thread of their own, beside the model (None: yes, "
        "except with a real model, whose compute threads would lose their cores to it: then "
        "the copies run at the step's transfer points, between the model's computations).",
    )
    verify: bool = Field(
        default=False,
        description="Check what every load brings back from the CPU tier: each pool row it "
        "reads must still have the CRC-32 its store recorded, or the load fails as corrupt "
        "(CPU and CUDA ranks alike; computed on the host, which costs a pass over every stored "
        "and loaded page); with the synthetic model each loaded block is also compared with "
        "what recomputing it gives.",
    )
    load_in_step: bool | None = Field(
        default=None,
        description="A request whose prefix comes from the CPU tier computes the rest in the "
        "step that loads it (each rank finishes the load before its model runs) instead of in "
        "the step after every rank acked the load. None: yes where the ranks copy at the step's "
        "transfer points (a real model on CPU ranks), where the load takes its time from that "
        "step anyway; no where copies overlap the model (a copy thread, CUDA streams), where "
        "waiting would stall the whole batch for one request's load.",
    )

    disk: DiskTierConfig = DiskTierConfig()
    shared: SharedTierConfig = SharedTierConfig()
    take_hits: Literal["faster", "always"] = Field(
        default="faster",
        description="Which tier hits are loaded. faster: only where the scheduler predicts the "
        "first token sooner than by recomputing, from each tier's measured load cost and the "
        "model's measured prefill cost (the rest are recomputed and counted as skipped_slower; "
        "until a tier has a few measured loads, a load that waits for its acks is priced at a "
        "whole step, the least it can delay its request); always: every hit.",
    )

    @field_validator("policy")
    @classmethod
    def _policy_spec(cls, value: str) -> str:
        return check_policy(value)

    @model_validator(mode="after")
    def _one_size(self) -> OffloadConfig:
        if self.cpu_bytes is not None and self.cpu_slots is not None:
            raise ValueError(
                f"cpu_bytes ({self.cpu_bytes}) and cpu_slots ({self.cpu_slots}) are exclusive; "
                "set one"
            )
        return self


class ModelConfig(_Strict):
    """The model whose KV is cached: the synthetic one (no ``path``), or a real checkpoint."""

    path: str | None = Field(
        default=None,
        description="A real model: a preset (smollm2-135m-instruct), a Hugging Face directory "
        "or a .gguf file; its checkpoint then sets the layers, KV heads, head size, vocabulary "
        "and KV groups.",
    )
    kv_layers_per_group: int | None = Field(
        default=None, gt=0, description="Layers a KV page holds (set from the checkpoint)."
    )
    max_positions: int | None = Field(
        default=None,
        gt=0,
        description="Prompt plus output tokens one request may hold (a real model: its context "
        "from the checkpoint, or less where set lower; a larger value is refused with a warning "
        "and the checkpoint's kept; None: no limit but the GPU pool's).",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Tokens that end a request (a real model: its EOS tokens are added from "
        "the checkpoint).",
    )
    weights_cache_dir: str = Field(
        default_factory=lambda: os.environ.get(
            "RAYKV_WEIGHTS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "raykv")
        ),
        description="Where a GGUF checkpoint's dequantized weights (safetensors, with its "
        "config), its config and its converted tokenizer are kept, so that a second start "
        "skips the dequantization, the metadata's parsing and the conversion ('' turns the "
        "cache off).",
    )

    @property
    def cache_dir(self) -> str | None:
        """``weights_cache_dir``, None where it is off ('')."""
        return self.weights_cache_dir or None

    num_layers: int = Field(
        default=4,
        gt=0,
        description="Layers, split evenly over the KV groups (a checkpoint's go by attention "
        "kind; set from the checkpoint).",
    )
    num_kv_heads: int = Field(default=4, gt=0, description="KV heads in total, split over ranks.")
    head_dim: int = Field(
        default=32, gt=0, description="Size of one head (set from the checkpoint)."
    )
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        default="float16", description="The KV cache's (and a real model's) element type."
    )
    vocab_size: int = Field(
        default=32000,
        ge=16,
        description="The vocabulary: token ids a prompt may hold (the synthetic sampler's top "
        "id is EOS; set from the checkpoint).",
    )
    eos_every: int = Field(
        default=0, ge=0, description="EOS is sampled about once per this many tokens (0: never)."
    )


class GroupConfig(_Strict):
    """One KV-cache group: layers sharing an attention pattern."""

    kind: Literal["full_attention", "sliding_window"] = Field(
        default="full_attention", description="The attention pattern of the group's layers."
    )
    window_tokens: int | None = Field(
        default=None,
        gt=0,
        description="A sliding window's length in tokens, the current one included (only for "
        "sliding_window).",
    )

    @model_validator(mode="after")
    def _window(self) -> GroupConfig:
        if self.kind == "sliding_window" and self.window_tokens is None:
            raise ValueError("a sliding_window group needs window_tokens")
        if self.kind == "full_attention" and self.window_tokens is not None:
            raise ValueError("window_tokens applies only to sliding_window groups")
        return self


class CacheConfig(_Strict):
    """The paged GPU KV cache."""

    block_size: int = Field(default=16, gt=0, description="Tokens per GPU block.")
    num_gpu_blocks: int = Field(default=192, ge=2, description="Blocks per rank (block 0 is null).")
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig()], min_length=1)


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(
        default=1,
        gt=0,
        description="Ranks (each holds num_kv_heads / tp heads of every block).",
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu",
        description="cpu (the CPU transfer engine) or cuda (CUDA streams, events, a pinned "
        "pool; one GPU per rank on Ray).",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="STRICT_PACK", description="Ray placement group strategy for the rank workers."
    )
    step_timeout_s: float = Field(
        default=120.0, gt=0, description="A rank that does not answer a step this long is dead."
    )
    control_plane: Literal["auto", "graph", "calls"] = Field(
        default="auto",
        description="How the scheduler actor reaches the rank actors each step. graph: one "
        "execution of a Ray Compiled Graph (shared-memory channels, whose readers spin: a core "
        "each while they wait); calls: one Ray actor call per rank (also the fallback where a "
        "graph cannot be compiled); auto: graph for cuda ranks, calls for cpu ranks, whose "
        "model the spinning would slow down.",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A real model's tensor-parallel collective (all-reduce) waits at most this "
        "long for the other ranks; then the rank leaves and its TP group is restarted.",
    )
    cpu_threads_per_rank: int | None = Field(
        default=None,
        gt=0,
        description="torch threads of each CPU rank (default: the node's cores shared among "
        "the ranks, at least 1).",
    )


SchedulePolicy = Literal["fcfs", "shortest-prefill"]  # the engine scheduler's admission orders


class EngineConfig(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _gone_keys(cls, data: object) -> object:
        # waits were once counted in steps, whose length depends on the load: an idle
        # engine's steps are short, and its requests gave up on their disk hits
        if isinstance(data, dict) and "max_deferred_steps" in data:
            raise ValueError(
                "max_deferred_steps is gone: a request's wait is bounded by time "
                "(engine.max_wait_s, in seconds)"
            )
        return data

    max_num_seqs: int = Field(default=32, gt=0, description="Requests running or loading at once.")
    max_num_batched_tokens: int = Field(
        default=2048,
        gt=0,
        description="Tokens computed per step (longer prompts prefill in chunks).",
    )
    schedule_policy: SchedulePolicy = Field(
        default="fcfs",
        description="Order of admission. fcfs: arrival order. shortest-prefill: the waiting "
        "request with the fewest prompt tokens left to compute after the GPU prefix cache and "
        "the CPU tier first (ties by arrival), bounded by max_bypass_steps.",
    )
    max_bypass_steps: int = Field(
        default=16,
        gt=0,
        description="shortest-prefill: steps a request may be passed over before it is admitted "
        "first, in arrival order.",
    )
    short_prefill_alone: int = Field(
        default=0,
        ge=0,
        description="A step whose prompt work gives a first token and computes at most this many "
        "tokens (a prompt the caches served) runs without the decodes, which go next step; "
        "never two steps in a row, never while requests are left waiting (0: never).",
    )
    async_scheduling: bool = Field(
        default=False,
        description="Plan each step while the ranks run the one before (its decodes' input "
        "tokens written in once that one answers); acks count a step later.",
    )
    max_wait_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds a request may wait, in all, before it is admitted for what the "
        "tiers hold (chunks still being written or loaded by another request, a promotion from "
        "disk or the shared store, room in the CPU tier) before it recomputes instead; with "
        "offload.take_hits: faster it also stops waiting once recomputing would have been "
        "sooner. Its own load or stores in flight always make it wait: they end by themselves "
        "(acked, asked again, or failed with a rank declared dead).",
    )
    ack_timeout_steps: int = Field(
        default=32,
        gt=0,
        description="Steps a job may go unacked before its ranks are asked to finish and "
        "report it again.",
    )
    rank_timeout_steps: int = Field(
        default=256,
        gt=0,
        description="Steps a job may go unacked in all before the silent ranks count as dead.",
    )
    keep_finished: bool = Field(
        default=True,
        description="Keep finished requests' state (for reports and CPU-tier checks); off for "
        "long-running serving, where only their outputs are kept (and only the latest "
        "requests' first-token records and refusals).",
    )
    latency_samples: int = Field(
        default=65536,
        gt=0,
        description="TTFT and ITL values kept for the percentiles: all of them up to this "
        "many, then a uniform sample of this many (the mean stays exact), so a server's "
        "memory stays flat however long it runs.",
    )


class WorkloadConfig(_Strict):
    """What ``raykv run`` replays."""

    kind: Literal["synthetic", "trace", "chat"] = Field(
        default="synthetic",
        description="synthetic: token-id conversations; trace: a Mooncake trace; chat: a real "
        "model's conversations in text, each answer fed into the next turn (needs model.path).",
    )
    trace: str | None = Field(default=None, description="Mooncake JSONL file (kind: trace).")
    chat_turns: int = Field(default=4, gt=0, description="Questions per conversation (chat).")
    num_requests: int = Field(default=200, gt=0, description="Requests to run (--num-requests).")
    seed: int = Field(
        default=0, description="Seeds the synthetic generator and the trace's token ids."
    )
    arrival_rate: float | None = Field(
        default=None,
        ge=0,
        description="Requests arriving per engine step (0: all at once). None: 2 for the "
        "synthetic workload; a trace at half the rate the engine serves (its seats, token "
        "budget and GPU pool), its own timestamps setting the gaps.",
    )
    max_tokens: int = Field(default=24, gt=0, description="Tokens generated per request.")
    system_prompts: int = Field(
        default=6, gt=0, description="Shared system prompts (picked with a skew to the first)."
    )
    system_prompt_tokens: int = Field(
        default=192, gt=0, description="Mean system prompt length in tokens."
    )
    user_tokens: int = Field(default=48, gt=0, description="Mean new user tokens per turn.")
    answer_tokens: int = Field(default=32, gt=0, description="Answer tokens kept in history.")
    mean_turns: float = Field(default=4.0, ge=1, description="Mean turns per conversation.")
    concurrent_conversations: int = Field(
        default=16,
        gt=0,
        description="Conversations open at once, taking turns at random.",
    )
    trace_time_scale: float | None = Field(
        default=None,
        gt=0,
        description="Replay a trace at its own timestamps on the wall clock: seconds times "
        "this factor (2: half the recorded rate); None: on the engine-step clock (arrival_rate).",
    )
    trace_tokens_per_block: int = Field(
        default=512, gt=0, description="Tokens per trace hash id (512 in Mooncake traces)."
    )
    trace_order: Literal["time", "conversations"] = Field(
        default="time",
        description="time: a trace's requests in its own order and timestamps; conversations: "
        "whole conversations (requests sharing their first hash id), one after another in the "
        "order each first appears, each conversation's turns in trace order, arriving at "
        "arrival_rate per engine step.",
    )

    @model_validator(mode="after")
    def _trace(self) -> WorkloadConfig:
        if self.kind == "trace" and not self.trace:
            raise ValueError("kind: trace needs a trace file (workload.trace)")
        if self.trace_order == "conversations" and self.trace_time_scale is not None:
            raise ValueError(
                "trace_order: conversations arrives on the engine-step clock; it takes no "
                "trace_time_scale"
            )
        return self


# measured: docs/serving.md ("The KV-aware router")
SHARED_HIT_COST = 0.05


class RouterWeightsConfig(_Strict):
    """The KV-aware router's cost of sending a request to a replica, in prompt tokens to
    compute: ``computed + cpu_hit_cost * loaded_from_cpu + disk_hit_cost * loaded_from_disk +
    shared_hit_cost * loaded_from_shared + spilled_queue + decode_cost * decoding`` (a GPU hit costs
    nothing; ``spilled_queue`` is the queued prefill that does not fit in the replica's next step
    beside the prompt); docs/serving.md ("The KV-aware router") says how each was measured."""

    cpu_hit_cost: float = Field(
        default=0.02, ge=0, description="A prompt token loaded from the CPU tier, in computed ones."
    )
    disk_hit_cost: float = Field(
        default=0.03,
        ge=0,
        description="A prompt token promoted from the disk tier into the CPU tier and then "
        "loaded, in computed ones: the TTFT slope of prompts only on disk against computing "
        "them (raykv bench route-weights --prompt-tokens 256,1024 --repeat 5, SmolLM2 float32, "
        "O_DIRECT on ext4, 2 cores: 0.010-0.027 in four runs, median 0.024), rounded up to "
        "stay above cpu_hit_cost: a disk hit is a CPU-tier load after a promotion.",
    )
    shared_hit_cost: float = Field(
        default=SHARED_HIT_COST,
        ge=0,
        description="A prompt token read from the shared tier (Mooncake Store) into the CPU "
        "tier and then loaded, in computed ones: the TTFT slope of prompts another engine "
        "published against computing them (raykv bench route-weights --prompt-tokens 256,1024 "
        "--no-disk, SmolLM2 float32, the store on loopback TCP, 2 cores: 0.025-0.055 in three "
        "runs, median 0.046), rounded up.",
    )
    decode_cost: float = Field(
        default=4.0, ge=0, description="A request decoding on the replica, in computed tokens."
    )
    imbalance: float = Field(
        default=2.0,
        ge=1,
        description="Power of two choices instead when the cheapest replica's queue is this "
        "many times the least busy one's",
    )
    imbalance_tokens: int = Field(
        default=2048, ge=0, description="... and longer than it by this many tokens."
    )


class VllmEngineConfig(_Strict):
    """``serve.vllm``: vLLM's own engine arguments for ``serve.engine: vllm``, under vLLM's own
    names (``vllm.EngineArgs``). The common ones are typed here; any other is passed through
    after ``raykv serve`` checks it names an engine argument of the installed vLLM. What raykv
    decides itself (the model, the connector, the KV event stream, the hash seed) is refused by
    name there."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, frozen=False)

    block_size: int | None = Field(
        default=None,
        gt=0,
        description="Tokens per KV block. None: 128 on the CPU platform (its attention takes "
        "multiples of 32), 16 on GPUs. The router hashes prompts in blocks of this size.",
    )
    dtype: str = Field(default="auto", description="The weights' and activations' dtype.")
    max_model_len: int | None = Field(
        default=None, gt=0, description="The context; None: the model's own."
    )
    enforce_eager: bool = Field(
        default=False, description="No torch.compile or CUDA graphs (starts sooner)."
    )
    tensor_parallel_size: int = Field(default=1, gt=0, description="vLLM's TP ranks a replica.")
    max_num_seqs: int | None = Field(default=None, gt=0, description="Requests a step at most.")
    max_num_batched_tokens: int | None = Field(
        default=None, gt=0, description="Tokens a step at most (the router's step budget)."
    )
    kv_cache_memory_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="The KV cache's size. None on the CPU platform: 1GiB (vLLM refuses to "
        "start there without a cap); on GPUs vLLM's gpu_memory_utilization decides.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="The share of a GPU's memory vLLM may use (its KV cache takes the rest of "
        "it); None: vLLM's default. Not used on the CPU platform.",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="vLLM's GPU prefix cache (raykv's tiers sit under it)."
    )
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        default="sha256",
        description="vLLM's block hash; the router computes it too. With the xxhash ones raykv "
        "gives every replica and the router one random seed per serve start (PYTHONHASHSEED, "
        "when it is not set): the tiers' files then match only within one start.",
    )
    seed: int = Field(default=0, description="vLLM's sampling seed.")


class ServeConfig(_Strict):
    """``raykv serve``: where to listen, how many replicas, how requests pick one. The API key
    is never read from a file: ``--api-key`` or RAYKV_API_KEY."""

    host: str = Field(default="127.0.0.1", description="Where to listen (loopback by default).")
    port: int = Field(default=8000, gt=0, lt=65536, description="Where to listen.")
    replicas: int = Field(default=1, gt=0, description="Engine replicas.")
    engine: Literal["raykv", "vllm"] = Field(
        default="raykv",
        description="What computes under each replica: raykv's own engine, or vLLM's "
        "(AsyncLLM with raykv's tiers as its offloading spec; make vllm installs it).",
    )
    replica_cpus: int = Field(
        default=1,
        gt=0,
        description="CPU cores each vLLM replica takes (its Ray resources, and on vLLM's CPU "
        "platform its compute threads): replicas never share a core.",
    )
    vllm: VllmEngineConfig = VllmEngineConfig()
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources each replica asks for beside its CPU (e.g. a node "
        "type's, or a one-per-node slot to spread replicas over nodes).",
    )
    router: Literal["kv", "pow2", "prefix"] | None = Field(
        default=None, description="None: kv with more than one replica, else pow2."
    )
    insecure: bool = Field(default=False, description="Allow a non-loopback host without a key.")
    cache_isolation: Literal["per_key", "request_salt", "required"] = Field(
        default="per_key",
        description="Whose cached KV a request may hit. per_key: one tenant per API key "
        "(RAYKV_API_KEY or --api-key may name several, comma-separated), within it the "
        "request's cache_salt; request_salt: only the request's cache_salt (one tenant for all "
        "keys); required: as per_key, and a request without cache_salt is refused (400). "
        "Requests of different tenants share no block in any tier or in the router's view.",
    )
    router_weights: RouterWeightsConfig = RouterWeightsConfig()
    max_request_bytes: ByteSize = Field(
        default=4 * 2**20,
        gt=0,
        description="The largest request body the server reads (a bigger one is refused with "
        "413 before it is parsed): 4 MiB holds a 128k-token prompt as text or as token ids "
        "(parsing holds the interpreter for about 20 ms per MiB of token ids).",
    )

"""``raykv serve``: the Serve application (the HTTP ingress and N engine replicas, each with its
ranks in a placement group of its own), started on an embedded Ray or a joined cluster, served
until interrupted, and torn down leaving no Ray process and no shard file behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from raykv.config import ConfigError, RaykvConfig, ServeConfig
from raykv.serve.kv_index import KVLayout
from raykv.serve.tenants import api_keys

APP_NAME = "raykv"
ENGINE_DEPLOYMENT = "raykv-engine"
INGRESS_DEPLOYMENT = "raykv-ingress"

# vLLM's block size where serve.vllm leaves it: its CPU attention takes multiples of 32 (and
# chose 128 for SmolLM2 itself); 16 is its default on GPUs
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16
# vLLM's step token budget where serve.vllm leaves max_num_batched_tokens to it (its OpenAI
# server's default with chunked prefill on its CPU platform; GPUs' is larger, which only makes
# the router count more of a queue as spilled than the engine does)
VLLM_STEP_TOKENS = 2048

# request routers by name: raykv's KV-aware one, and as the baselines Serve's default (power
# of two choices) and Ray Serve LLM's text prefix tree
ROUTERS = {
    "kv": "raykv.serve.kv_router:KVAwareRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter"
    ),
}

# requests a replica takes at once: its engine batches them (Serve's default of 5 would starve
# the batch)
MAX_ONGOING_PER_REPLICA = 64
MAX_ONGOING_INGRESS = 1024
# what a replica's stop takes besides its spill: the drain of what is in flight (the engine
# actor's DRAIN_S, 30 s), its loop's end and its ranks' shutdown (their I/O threads, 30 s)
STOP_MARGIN_S = 90.0


@dataclass(slots=True)
class ServeOptions:
    """How to serve: where to listen, how many replicas, which router (None: ``kv`` with more
    than one replica, else ``pow2``), the API key."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    replica_resources: dict[str, float] = field(default_factory=dict)
    router: str | None = None
    api_key: str | None = None  # one key, or several separated by commas (one tenant each)
    insecure: bool = False
    cache_isolation: str = "per_key"

    @classmethod
    def of(cls, serve: ServeConfig, api_key: str | None = None, **flags: Any) -> ServeOptions:
        """The config's ``serve:`` section, with the flags given (not None) over it."""
        values = {
            "host": serve.host,
            "port": serve.port,
            "replicas": serve.replicas,
            "replica_resources": dict(serve.replica_resources),
            "router": serve.router,
            "insecure": serve.insecure,
            "cache_isolation": serve.cache_isolation,
        }
        values.update({k: v for k, v in flags.items() if v is not None and v is not False})
        return cls(api_key=api_key, **values)

    @property
    def router_name(self) -> str:
        if self.router is not None:
            return self.router
        return "kv" if self.replicas > 1 else "pow2"

    def check(self) -> None:
        """ConfigError naming the option at fault."""
        if self.replicas < 1:
            raise ConfigError(f"--replicas {self.replicas}: must be at least 1")
        if self.router is not None and self.router not in ROUTERS:
            raise ConfigError(f"--router {self.router!r}: expected one of {', '.join(ROUTERS)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: not a port number")
        if self.api_key is not None and not api_keys(self.api_key):
            raise ConfigError("--api-key: no key given (RAYKV_API_KEY or --api-key is empty)")
        if not _loopback(self.host) and not self.api_key and not self.insecure:
            raise ConfigError(
                f"--host {self.host}: serving beyond this machine needs --api-key KEY "
                "(or RAYKV_API_KEY), or --insecure to serve without one"
            )


def check_router(cfg: RaykvConfig, options: ServeOptions) -> None:
    """ConfigError where the router cannot work with ``cfg``: the kv router mirrors what each
    replica holds from its KV events alone, and without them would route as if nothing were
    cached, for ever."""
    if options.router_name == "kv" and not cfg.offload.events:
        raise ConfigError(
            "offload.events: false, but the kv router follows the replicas' KV events; "
            "set offload.events=true or choose --router pow2"
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_config(cfg: RaykvConfig) -> tuple[RaykvConfig, str]:
    """``cfg`` with the checkpoint's geometry and the tokenizer's EOS (what every replica runs),
    and the model's file (for vLLM replicas: ``cfg`` with vLLM's block size settled, and the
    Hugging Face directory vLLM loads)."""
    if cfg.serve.engine == "vllm":
        return _served_vllm_config(cfg)
    from raykv.model.checkpoint import configure, with_stop_tokens
    from raykv.model.tokenizer import Tokenizer

    cfg, _, path = configure(cfg)
    tokenizer = Tokenizer.of(path, cfg.model.cache_dir)
    if tokenizer is not None:
        cfg = with_stop_tokens(cfg, [tokenizer.eos_token_id])
    # a server runs for days: finished requests are forgotten (their outputs went out)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"keep_finished": False})})
    return cfg, str(path)


def _served_vllm_config(cfg: RaykvConfig) -> tuple[RaykvConfig, str]:
    import json
    from pathlib import Path

    from raykv.model.hf_directory import model_directory

    try:
        from raykv.vllm.serving import check_section, cpu_platform, spec_settings
    except ImportError as exc:
        raise ConfigError(
            f"serve.engine: vllm needs vLLM ({exc}); make vllm installs vLLM's CPU build"
        ) from None
    section = cfg.serve.vllm
    check_section(section.model_dump())
    updates: dict[str, Any] = {}
    if section.block_size is None:
        updates["block_size"] = CPU_BLOCK_SIZE if cpu_platform() else GPU_BLOCK_SIZE
    if cfg.offload.enabled:  # what the spec would refuse in each replica, refused here
        spec_settings(cfg.offload)
    directory = model_directory(str(cfg.model.path))
    hf = json.loads((Path(directory) / "config.json").read_text())
    context = section.max_model_len or hf.get("max_position_embeddings")
    model = {"max_positions": context, "vocab_size": hf.get("vocab_size") or cfg.model.vocab_size}
    cfg = cfg.model_copy(
        update={
            "serve": cfg.serve.model_copy(update={"vllm": section.model_copy(update=updates)}),
            "model": cfg.model.model_copy(update=model),
        }
    )
    return cfg, directory


def vllm_hash_seed(cfg: RaykvConfig) -> str:
    """The seed vLLM's block hashes start from, the same in every replica and the router:
    PYTHONHASHSEED where set; for the xxhash algorithms (whose seed must stay secret) a random
    one for this serve; else empty (vLLM's fixed default)."""
    import os
    import secrets

    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if cfg.serve.vllm.prefix_caching_hash_algo.startswith("xxhash"):
        return str(secrets.randbelow(2**32))  # an int: Python itself reads PYTHONHASHSEED
    return ""


def model_name(cfg: RaykvConfig) -> str:
    """The name ``/v1/models`` gives: the preset's, or the checkpoint's file or directory."""
    from pathlib import Path

    path = str(cfg.model.path)
    return Path(path).stem if ("/" in path or path.endswith(".gguf")) else path


def build_app(cfg: RaykvConfig, model_file: str, options: ServeOptions) -> Any:
    """The Serve application for ``cfg`` (configured by ``served_config``) and the model's
    file (its tokenizer's source)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from raykv.cluster.rank_actor import rank_bundle
    from raykv.serve.replica import EngineReplica

    tp = cfg.parallel.tensor_parallel_size
    if cfg.serve.engine == "vllm":
        seed = vllm_hash_seed(cfg)
        engine = _vllm_deployment(cfg, options, model_file, seed)
        return _ingress(cfg, model_file, options, engine, seed)
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": 1},
        # the replica first, then its ranks: one TP group, one node
        placement_group_bundles=[{"CPU": 1.0, **options.replica_resources}]
        + [rank_bundle(cfg) for _ in range(tp)],
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.router_name],
            request_router_kwargs=router_kwargs(cfg, options.router_name),
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
        # a replica's stop drains what is in flight, spills its CPU tier to the disk tier
        # (offload.disk.spill_on_stop_s) and then stops its loop and ranks: Serve waits that
        # long for it (20 s by default)
        graceful_shutdown_timeout_s=STOP_MARGIN_S + cfg.offload.disk.spill_on_stop_s,
    )
    return _ingress(cfg, model_file, options, engine.bind(cfg.model_dump(mode="json"), model_file))


def _vllm_deployment(cfg: RaykvConfig, options: ServeOptions, model_dir: str, seed: str) -> Any:
    """The engine deployment of vLLM replicas, bound: each one process (vLLM starts its engine
    core beside it) with ``serve.replica_cpus`` cores per vLLM rank, or a GPU per rank."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from raykv.serve.vllm_replica import VllmReplica

    tp = cfg.serve.vllm.tensor_parallel_size
    actor: dict[str, Any] = {"num_cpus": cfg.serve.replica_cpus * tp}
    if cfg.parallel.device == "cuda":
        actor = {"num_cpus": 1, "num_gpus": tp}
    if options.replica_resources:
        actor["resources"] = dict(options.replica_resources)
    engine = serve.deployment(VllmReplica).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        ray_actor_options=actor,
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.router_name],
            request_router_kwargs=router_kwargs(cfg, options.router_name, seed),
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=STOP_MARGIN_S + cfg.offload.disk.spill_on_stop_s,
    )
    return engine.bind(cfg.model_dump(mode="json"), model_dir, seed)


def _ingress(
    cfg: RaykvConfig, model_file: str, options: ServeOptions, engine: Any, hash_seed: str = ""
) -> Any:
    """The ingress deployment in front of the bound ``engine`` deployment."""
    from raykv.serve.ingress import ingress_deployment

    ingress = ingress_deployment().options(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=MAX_ONGOING_INGRESS,
    )
    limits = {
        "max_positions": cfg.model.max_positions,
        "vocab_size": cfg.model.vocab_size,
        "max_request_bytes": cfg.serve.max_request_bytes,
    }
    hashing = None
    if cfg.serve.engine == "vllm" and options.router_name == "kv":
        hashing = (cfg.serve.vllm.prefix_caching_hash_algo, hash_seed or None)
    return ingress.bind(
        engine,
        model_name(cfg),
        model_file,
        options.api_key,
        options.router_name == "prefix",
        cfg.model.cache_dir,
        limits,
        options.cache_isolation,
        hashing,
    )


def kv_layout(cfg: RaykvConfig, hash_seed: str = "") -> KVLayout:
    """How the engine of ``cfg`` turns a prompt into KV keys (what a router hashes)."""
    if cfg.serve.engine == "vllm":
        section = cfg.serve.vllm
        assert section.block_size is not None  # settled by served_config
        return KVLayout(
            section.block_size,
            cfg.offload.blocks_per_chunk if cfg.offload.enabled else 1,
            (0,),
            f"vllm:{section.prefix_caching_hash_algo}",
            hash_seed or None,
        )
    groups = [i for i, g in enumerate(cfg.cache.groups) if g.kind == "full_attention"]
    return KVLayout(
        cfg.cache.block_size,
        cfg.offload.blocks_per_chunk if cfg.offload.enabled else 1,
        tuple(groups or [0]),
    )


def router_kwargs(cfg: RaykvConfig, router: str, hash_seed: str = "") -> dict[str, Any]:
    """What the KV-aware router needs to hash prompts as the engine does, its weights, and
    the engine's step token budget."""
    if router != "kv":
        return {}
    layout = kv_layout(cfg, hash_seed)
    step_tokens = cfg.engine.max_num_batched_tokens
    if cfg.serve.engine == "vllm":
        step_tokens = cfg.serve.vllm.max_num_batched_tokens or VLLM_STEP_TOKENS
    return {
        "block_size": layout.block_size,
        "blocks_per_chunk": layout.blocks_per_chunk,
        "groups": list(layout.groups),
        "weights": cfg.serve.router_weights.model_dump(),
        "step_tokens": step_tokens,
        "hasher": layout.hasher,
        "hash_seed": layout.hash_seed,
    }


def ray_resources(cfg: RaykvConfig, replicas: int) -> tuple[int, int | None]:
    """CPUs and GPUs an embedded Ray needs for ``replicas``: one CPU per replica, its ranks'
    (a CPU or a GPU each), and one for the ingress and Serve."""
    cuda = cfg.parallel.device == "cuda"
    if cfg.serve.engine == "vllm":
        tp = cfg.serve.vllm.tensor_parallel_size
        if cuda:
            return replicas + 1, replicas * tp
        return replicas * cfg.serve.replica_cpus * tp + 1, None
    tp = cfg.parallel.tensor_parallel_size
    return replicas * (1 + (0 if cuda else tp)) + 1, (replicas * tp if cuda else None)


class Server:
    """A running ``raykv serve``: ``start`` deploys and returns once every replica is up;
    ``url``; ``stop`` tears it all down."""

    def __init__(self, cfg: RaykvConfig, options: ServeOptions, address: str | None = None):
        options.check()
        check_router(cfg, options)
        self.cfg, self.model_file = served_config(cfg)
        self.options = options
        self.address = address
        self._ray: Any = None

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.options.port}"

    def start(self) -> Server:
        from ray import serve
        from ray.serve.config import HTTPOptions

        from raykv.cluster.runtime import connect

        cpus, gpus = ray_resources(self.cfg, self.options.replicas)
        self._ray = connect(self.address, num_cpus=cpus, num_gpus=gpus)
        try:
            serve.start(http_options=HTTPOptions(host=self.options.host, port=self.options.port))
            serve.run(
                build_app(self.cfg, self.model_file, self.options), name=APP_NAME, route_prefix="/"
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every replica (its ranks and shard files with it), Serve, and Ray if raykv started
        it."""
        from ray import serve

        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        with contextlib.suppress(Exception):
            serve.shutdown()
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
